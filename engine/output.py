"""From sampled tokens to what a client sees: text deltas, stops and finish reasons."""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field, fields

from engine.detokenizer import IncrementalDetokenizer
from engine.sampler import SampleOutput, TokenLogprob
from engine.sequence import FinishReason, Sequence
from engine.tokenizer import Tokenizer


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    total_ms: float
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class RequestOutput:
    """One event of a request's stream: new text, and on the last one why it ended."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None
    usage: Usage | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def absorb(self, later: "RequestOutput") -> None:
        """Fold the next event of the same request into this one (for a reader that fell behind)."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        if later.finished:
            self.finish_reason, self.stop_string, self.stop_token_id = later.finish_reason, later.stop_string, later.stop_token_id
            self.usage, self.error = later.usage, later.error

    def __reduce__(self):
        # (every event crosses from the engine's process to the server's: its constructor's
        # arguments pickle in 3/4 and load in 1/3 of the time of the default state dict)
        return RequestOutput, _request_output_fields(self)


_request_output_fields = operator.attrgetter(*(f.name for f in fields(RequestOutput)))


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


class OutputStream:
    """Per sequence: records sampled tokens, applies the stop rules, yields deltas.

    Recording is cheap and happens as soon as a step's tokens are back: it puts the
    token after the others (one pending token fewer) and decides the stops (a stop token, the
    length). Emitting does the rest (detokenizing, stop strings) and may run while the
    GPU computes the next step; a stop string found then drops the tokens after it.

    Stop strings are never emitted, so text that could still be the start of one
    is held back until it can no longer match.
    """

    def __init__(self, seq: Sequence, tokenizer: Tokenizer):
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_ids, seq.params.skip_special_tokens)
        self.longest_stop = max((len(s) for s in seq.params.stop), default=0)
        # The end of the output's text: what is not emitted yet, after the last
        # longest_stop - 1 emitted characters (where a stop string may still begin). Text
        # before them is dropped once sent, so a long output is not copied at each token.
        self.text = ""
        self.sent = 0  # characters of self.text already emitted
        # (both are banned before min_tokens, so sampling one means the end)
        self.stop_ids = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(seq.eos_token_ids))
        self.unsent: list[SampleOutput] = []  # recorded, not yet emitted
        self.recorded = 0  # output tokens back from the device (those after it are pending)
        self.finish_reason: FinishReason | None = None  # set by record(): a stop token or the length

    def record(self, sample: SampleOutput) -> bool:
        """Take a sampled token back from pending; True if it ends the sequence."""
        seq = self.seq
        seq.output_ids.append(sample.token_id)
        seq.num_pending -= 1
        self.recorded += 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        self.unsent.append(sample)
        # (a guide allows eos only where its structure is complete: that eos ends it, ignore_eos or not)
        complete = seq.guide is not None and sample.token_id in seq.eos_token_ids
        if sample.token_id in self.stop_ids or complete:
            self.finish_reason = FinishReason.STOP
        elif self.recorded >= seq.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        if self.finish_reason is not None:
            seq.drop_pending()  # (sampled by a step that ran ahead)
        return self.finish_reason is not None

    def emit(self) -> RequestOutput:
        """The delta of the tokens recorded since the last call."""
        seq, params = self.seq, self.seq.params
        if len(self.unsent) == 1 and self.finish_reason is None and not params.stop:
            return self._emit_one()
        out = RequestOutput(seq.request_id)
        first = self.recorded - len(self.unsent)  # index of the first unsent token
        for i, sample in enumerate(self.unsent):
            token, last = sample.token_id, i == len(self.unsent) - 1
            out.token_ids.append(token)
            if sample.logprob is not None:
                out.logprobs.append(sample.logprob)
            if last and self.finish_reason is FinishReason.STOP:  # a stop token: not part of the text
                out.finish_reason, out.stop_token_id = FinishReason.STOP, token
                self.text += self.detokenizer.flush()
                break
            searched_from = len(self.text) - self.longest_stop + 1
            self.text += self.detokenizer.add(token)
            if params.stop and first + i + 1 >= params.min_tokens and self._match_stop_string(out, max(0, searched_from)):
                del seq.output_ids[first + i + 1 :]  # recorded past the stop string
                break
            if last and self.finish_reason is FinishReason.LENGTH:
                out.finish_reason = FinishReason.LENGTH
                self.text += self.detokenizer.flush()
        self.unsent.clear()

        end = len(self.text)
        if params.stop and not out.finished:  # hold back what may still become a stop string
            end -= _partial_stop_suffix(self.text, params.stop)
        out.text = self.text[self.sent : end]
        self._sent_to(max(self.sent, end))
        return out

    def _sent_to(self, sent: int) -> None:
        """Mark self.text emitted up to `sent`, and drop what no stop string can begin in."""
        drop = min(sent, max(0, len(self.text) - self.longest_stop + 1))
        self.text, self.sent = self.text[drop:], sent - drop

    def _emit_one(self) -> RequestOutput:
        """emit() of a decode step's one token, where nothing can end the text (no stop
        strings, not the last token): its delta without the general path's bookkeeping,
        which a host-bound step of hundreds of sequences pays for each. (Without stop
        strings every emit sends all the text, so self.text is empty between them.)"""
        sample = self.unsent.pop()
        return RequestOutput(self.seq.request_id, self.detokenizer.add(sample.token_id), [sample.token_id],
                             [sample.logprob] if sample.logprob is not None else [])

    def _match_stop_string(self, out: RequestOutput, searched_from: int) -> bool:
        hits = [(i, s) for s in self.seq.params.stop if (i := self.text.find(s, searched_from)) >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            out.finish_reason, out.stop_string = FinishReason.STOP, stop
        return bool(hits)

"""The allowed tokens of each sequence's next sample, from its grammar (llguidance)."""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np

from engine.sampling_params import InvalidRequest
from engine.structured.constraint import Constraint
from engine.tokenizer import Tokenizer

DEFAULT_MAX_GRAMMAR_BYTES = 65536


class GuideCompiler:
    """Checks constraints and starts guides for one model's tokenizer. Building
    llguidance's view of the tokenizer takes a second or so for a large vocabulary: it
    is built once, on first use, in whichever thread needs it first."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_grammar_bytes: int):
        self.tokenizer, self.vocab_size, self.max_grammar_bytes = tokenizer, vocab_size, max_grammar_bytes
        self._lock = threading.Lock()
        self._llg_tokenizer: llguidance.LLTokenizer | None = None

    def __getstate__(self) -> dict:  # (sent to the engine's process: it builds its own)
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "max_grammar_bytes": self.max_grammar_bytes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.tokenizer.eos_token_ids)
            return self._llg_tokenizer

    def grammar(self, constraint: Constraint) -> str:
        """The constraint's grammar, checked; raises InvalidRequest with llguidance's own
        description of what is wrong. llguidance bounds the work of compiling it (its
        default parser limits); the specification's size is bounded here."""
        if constraint.size > self.max_grammar_bytes:
            raise InvalidRequest(f"structured.{constraint.kind}: {constraint.size} bytes, more than the "
                                 f"{self.max_grammar_bytes} this server takes (--max-grammar-bytes): send a smaller one")
        grammar = constraint.grammar()
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.llg_tokenizer)
        if failed:
            raise InvalidRequest(f"structured.{constraint.kind}: {messages[0].strip()}")
        return grammar

    def guide(self, grammar: str) -> "Guide":
        """A guide at the start of a checked grammar (compiling it takes milliseconds and
        lets go of the GIL: start it off the engine's thread)."""
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the grammar could not be compiled: {matcher.get_error()}")
        return Guide(matcher, self.tokenizer.eos_token_ids)


class Guide:
    """One sequence's place in its grammar: the tokens its next sample may be, and the
    tokens it has accepted. End of sequence (eos) is allowed exactly where the grammar
    accepts the output so far; once the grammar is complete, only eos is."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: list[int]):
        self.matcher, self.eos_token_ids = matcher, eos_token_ids
        self.must_stop = False  # its last mask allowed nothing but eos


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """llguidance's pool of threads for computing masks, one for the process."""
    return llguidance.LLExecutor()


def accept_tokens(accepted: list[tuple[Guide, int]]) -> None:
    """Advance each guide past its sampled token (one its last mask allowed), in
    parallel on llguidance's threads."""
    if accepted:
        taken = llguidance.numpy.consume_token_par(_executor(), [(g.matcher, t) for g, t in accepted])
        for (guide, token), ok in zip(accepted, taken):
            if not ok:
                raise RuntimeError(f"the grammar refused token {token}: {guide.matcher.get_error()}")


def fill_masks(guides: list[Guide], vocab_size: int, out: np.ndarray | None = None) -> np.ndarray:
    """The guides' bitmask rows, in order (int32 [guides, words]; token t is bit t % 32
    of word t // 32), computed in parallel by llguidance's threads, in the first rows of
    `out` if given. Marks the guides whose row allows nothing but eos (must_stop): only
    an accepting grammar allows eos, so only those rows are read."""
    masks = _rows(out, len(guides), vocab_size)
    if guides:
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(g.matcher, i) for i, g in enumerate(guides)], masks)
        _mark_must_stop(guides, masks)
    return masks


@dataclass(frozen=True)
class FillingMasks:
    """A step's masks, being filled on a thread of their own: `rows` (the memory they
    land in, known at once) holds them once `done` has completed (its result: `rows`)."""

    rows: np.ndarray
    done: Future[np.ndarray]

    def result(self) -> np.ndarray:
        """The rows, once filled (raises what filling them raised)."""
        return self.done.result()


def start_filling_masks(guides: list[Guide], vocab_size: int, out: np.ndarray | None,
                        accepted: list[tuple[Guide, int]]) -> FillingMasks:
    """accept_tokens(accepted), then fill_masks, on a thread of their own, which lets go
    of the GIL while llguidance computes: the caller's thread goes on. No guide may be
    touched before the masks are done."""
    rows = _rows(out, len(guides), vocab_size)

    def fill() -> np.ndarray:
        accept_tokens(accepted)
        return fill_masks(guides, vocab_size, rows)
    return FillingMasks(rows, _mask_thread().submit(fill))


def _rows(out: np.ndarray | None, n: int, vocab_size: int) -> np.ndarray:
    shape = llguidance.numpy.get_bitmask_shape(n, vocab_size)
    if out is None:
        return np.empty(shape, np.int32)
    if out.shape[1:] != shape[1:] or len(out) < n:
        raise ValueError(f"a mask buffer of shape {out.shape} cannot hold {shape}")
    return out[:n]


def _mark_must_stop(guides: list[Guide], masks: np.ndarray) -> None:
    no_eos = _without(tuple(guides[0].eos_token_ids), masks.shape[1])
    for guide, row in zip(guides, masks):
        guide.must_stop = guide.matcher.is_accepting() and not (row.view(np.uint32) & no_eos).any()


@functools.cache
def _mask_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="llamastream-masks")


@functools.lru_cache(maxsize=4)
def _without(tokens: tuple[int, ...], words: int) -> np.ndarray:
    """A bitmask row (uint32) allowing every token but `tokens`."""
    row = np.full(words, 0xFFFFFFFF, np.uint32)
    for t in tokens:
        row[t // 32] &= ~np.uint32(1 << (t % 32))
    return row

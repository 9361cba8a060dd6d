"""Translate between llamastream.v1 messages and the engine's types."""

from __future__ import annotations

import re
import uuid

from engine.output import RequestOutput
from engine.sampler import TokenLogprob
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.sequence import FinishReason
from engine.structured import Constraint
from engine.tokenizer import CHAT_ROLES, ChatTemplateError, Tokenizer
from llamastream.v1 import generation_pb2 as pb

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
MAX_CHAT_MESSAGES = 1024
# Every response message carries the id, and every request log line: bounded, and
# made of characters that print as themselves (UUIDs, ULIDs, "chatcmpl-..." all fit).
MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(r"[!-~]*")  # printable ASCII, no space


def _optional(msg, name: str, default):
    return getattr(msg, name) if msg.HasField(name) else default


def request_id(req: pb.GenerateRequest) -> str:
    """The request's id, or a new one if it has none."""
    rid = req.request_id
    if not rid:
        return uuid.uuid4().hex
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id has {len(rid)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
    if not _REQUEST_ID.fullmatch(rid):
        bad = next(c for c in rid if not _REQUEST_ID.fullmatch(c))
        raise InvalidRequest(f"request_id holds {ascii(bad)}: use printable ASCII characters (letters, digits, "
                             "punctuation) and no spaces")
    return rid


def sampling_params(req: pb.GenerateRequest) -> SamplingParams:
    s, stop, out = req.sampling, req.stop, req.output
    return SamplingParams(
        temperature=_optional(s, "temperature", 1.0),
        top_p=_optional(s, "top_p", 1.0),
        top_k=_optional(s, "top_k", -1),
        min_p=_optional(s, "min_p", 0.0),
        repetition_penalty=_optional(s, "repetition_penalty", 1.0),
        presence_penalty=_optional(s, "presence_penalty", 0.0),
        frequency_penalty=_optional(s, "frequency_penalty", 0.0),
        seed=_optional(s, "seed", None),
        max_tokens=_optional(stop, "max_tokens", None),
        min_tokens=stop.min_tokens,
        stop=list(stop.stop),
        stop_token_ids=list(stop.stop_token_ids),
        ignore_eos=stop.ignore_eos,
        top_logprobs=_optional(out, "top_logprobs", None),
        skip_special_tokens=out.skip_special_tokens,
        constraint=constraint(req.structured),
    )


def constraint(structured) -> Constraint | None:
    """The structured-output constraint of a message with a `constraint` oneof of
    json_schema, json_object, regex, choice (its `choices`) and grammar: our
    StructuredOutput, and vLLM's SamplingParams, which names them alike."""
    kind = structured.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not structured.json_object):
        return None
    if kind == "choice":
        return Constraint(kind, tuple(structured.choice.choices))
    return Constraint(kind, "" if kind == "json_object" else getattr(structured, kind))


def chat_messages(chat: pb.Chat) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidRequest("chat.messages is empty: send at least one message")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"chat.messages has {len(chat.messages)} messages; at most {MAX_CHAT_MESSAGES} are allowed")
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequest(f"chat.messages[{i}].role is {m.role!r}; it must be one of {', '.join(CHAT_ROLES)}")
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def render_chat(tokenizer: Tokenizer, chat: pb.Chat) -> tuple[list[int], str]:
    try:
        return tokenizer.encode_chat(chat_messages(chat), _optional(chat, "add_generation_prompt", True))
    except ChatTemplateError as e:
        raise InvalidRequest(str(e)) from e


def prompt_ids(req: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    kind = req.WhichOneof("input")
    if kind == "prompt":
        if not req.prompt:
            raise InvalidRequest("prompt is empty: send some text, a chat or token_ids")
        return tokenizer.encode(req.prompt)
    if kind == "chat":
        return render_chat(tokenizer, req.chat)[0]
    if kind == "token_ids":
        return list(req.token_ids.ids)
    raise InvalidRequest("the request has no input: set one of prompt, chat or token_ids")


def tokenize(req: pb.TokenizeRequest, tokenizer: Tokenizer) -> pb.TokenizeResponse:
    kind = req.WhichOneof("input")
    if kind == "text":
        return pb.TokenizeResponse(token_ids=tokenizer.encode(req.text, req.add_special_tokens), rendered_prompt=req.text)
    if kind == "chat":
        ids, rendered = render_chat(tokenizer, req.chat)
        return pb.TokenizeResponse(token_ids=ids, rendered_prompt=rendered)
    raise InvalidRequest("the request has no input: set text or chat")


def _logprob(lp: TokenLogprob, tokenizer: Tokenizer) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        token=tokenizer.id_to_token(lp.token_id),
        logprob=lp.logprob,
        top=[pb.TokenLogprob(token_id=t, token=tokenizer.id_to_token(t), logprob=p) for t, p in lp.top],
    )


def responses(out: RequestOutput, tokenizer: Tokenizer) -> list[pb.GenerateResponse]:
    """The messages for one engine output: a Delta if anything is new, then Finished at the end."""
    msgs = []
    if out.text or out.token_ids:
        delta = pb.Delta(text=out.text, token_ids=out.token_ids, logprobs=[_logprob(lp, tokenizer) for lp in out.logprobs])
        msgs.append(pb.GenerateResponse(request_id=out.request_id, delta=delta))
    if out.finished:
        u = out.usage
        finished = pb.Finished(
            reason=_FINISH_REASONS[out.finish_reason],
            usage=pb.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_tokens=u.cached_tokens,
                time_to_first_token_ms=u.time_to_first_token_ms,
                total_ms=u.total_ms,
            ),
        )
        if out.stop_string is not None:
            finished.stop_string = out.stop_string
        elif out.stop_token_id is not None:
            finished.stop_token_id = out.stop_token_id
        msgs.append(pb.GenerateResponse(request_id=out.request_id, finished=finished))
    return msgs

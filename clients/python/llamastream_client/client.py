"""Client and AsyncClient: the same calls, blocking or awaited."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc

from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc

SERVICE = "llamastream.v1.Generation"
Message = tuple[str, str]  # (role, content)


@dataclass(frozen=True)
class TextDelta:
    """New text of the stream, and the token ids it came from."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    total_ms: float


@dataclass(frozen=True)
class Completion:
    """The end of a stream: all its text, why it stopped, and the usage."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop", "length" or "abort"
    usage: Usage
    stop_string: str | None = None
    stop_token_id: int | None = None


Event = TextDelta | Completion


def _channel_options(retries: int) -> list[tuple[str, object]]:
    if retries < 1:
        return [("grpc.enable_retries", 0)]
    policy = {"maxAttempts": retries + 1, "initialBackoff": "0.2s", "maxBackoff": "5s", "backoffMultiplier": 2,
              "retryableStatusCodes": ["UNAVAILABLE"]}
    config = {"methodConfig": [{"name": [{"service": SERVICE}], "retryPolicy": policy}]}
    return [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


def _credentials(tls: bool, root_certificates: bytes | None, client_cert: bytes | None,
                 client_key: bytes | None) -> grpc.ChannelCredentials | None:
    if not (tls or root_certificates or client_cert):
        return None
    return grpc.ssl_channel_credentials(root_certificates, client_key, client_cert)


def generate_request(prompt: str | None = None, *, chat: Sequence[Message] | None = None,
                     token_ids: Sequence[int] | None = None, request_id: str = "", max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                     seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False) -> pb.GenerateRequest:
    """The GenerateRequest for exactly one of prompt, chat or token_ids."""
    if sum(x is not None for x in (prompt, chat, token_ids)) != 1:
        raise ValueError("give exactly one of prompt, chat or token_ids")
    sampling = pb.SamplingParams(**{k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k,
                                                             seed=seed).items() if v is not None})
    stop_criteria = pb.StopCriteria(stop=list(stop), ignore_eos=ignore_eos,
                                    **({} if max_tokens is None else {"max_tokens": max_tokens}))
    request = pb.GenerateRequest(request_id=request_id, sampling=sampling, stop=stop_criteria)
    if prompt is not None:
        request.prompt = prompt
    elif chat is not None:
        request.chat.messages.extend(pb.ChatMessage(role=role, content=content) for role, content in chat)
    else:
        request.token_ids.ids.extend(token_ids)
    return request


class _Assembler:
    """Turns a Generate stream's messages into TextDeltas and a final Completion."""

    def __init__(self) -> None:
        self.request_id, self.text, self.token_ids = "", [], []

    def feed(self, msg: pb.GenerateResponse) -> Event | None:
        self.request_id = msg.request_id
        if msg.HasField("delta"):
            self.text.append(msg.delta.text)
            self.token_ids += msg.delta.token_ids
            return TextDelta(msg.delta.text, tuple(msg.delta.token_ids))
        if msg.HasField("finished"):
            f, u = msg.finished, msg.finished.usage
            matched = f.WhichOneof("matched")
            return Completion(
                request_id=self.request_id, text="".join(self.text), token_ids=tuple(self.token_ids),
                finish_reason=pb.FinishReason.Name(f.reason).removeprefix("FINISH_REASON_").lower(),
                usage=Usage(u.prompt_tokens, u.completion_tokens, u.time_to_first_token_ms, u.total_ms),
                stop_string=f.stop_string if matched == "stop_string" else None,
                stop_token_id=f.stop_token_id if matched == "stop_token_id" else None,
            )
        return None  # Started


class _Base:
    def __init__(self, grpc_module, target: str, token: str | None, tls: bool, root_certificates: bytes | None,
                 client_cert: bytes | None, client_key: bytes | None, timeout: float | None, retries: int):
        """`grpc_module` is grpc or grpc.aio: they make channels alike."""
        self.target = target
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout
        creds, options = _credentials(tls, root_certificates, client_cert, client_key), _channel_options(retries)
        self.channel = (grpc_module.secure_channel(target, creds, options) if creds
                        else grpc_module.insecure_channel(target, options))
        self.stub = pb_grpc.GenerationStub(self.channel)

    def _call_args(self, timeout: float | None) -> dict:
        return {"metadata": self.metadata, "timeout": self.timeout if timeout is None else timeout}


class Client(_Base):
    """Blocking client. `target` is host:port; TLS with `tls=True` (system roots) or
    `root_certificates`; mutual TLS with `client_cert` and `client_key` (PEM bytes);
    `token` is sent as a bearer token; `timeout` (seconds) is every call's deadline."""

    def __init__(self, target: str = "localhost:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None, client_key: bytes | None = None,
                 timeout: float | None = 600.0, retries: int = 4):
        super().__init__(grpc, target, token, tls, root_certificates, client_cert, client_key, timeout, retries)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **fields) -> Iterator[Event]:
        """Stream TextDeltas, then one Completion. Fields as in `generate_request`."""
        assembler = _Assembler()
        for msg in self.stub.Generate(generate_request(prompt, **fields), **self._call_args(timeout)):
            event = assembler.feed(msg)
            if event is not None:
                yield event

    def chat(self, messages: Sequence[Message], **fields) -> Iterator[Event]:
        return self.generate(chat=messages, **fields)

    def complete(self, prompt: str | None = None, **fields) -> Completion:
        """The whole generation at once."""
        *_, completion = self.generate(prompt, **fields)
        return completion

    def tokenize(self, text: str, add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self.stub.Tokenize(request, **self._call_args(timeout)).token_ids)

    def info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call_args(timeout))

    def abort(self, *request_ids: str, timeout: float | None = None) -> int:
        return self.stub.Abort(pb.AbortRequest(request_ids=request_ids), **self._call_args(timeout)).aborted

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """The same as Client for asyncio: `generate` and `chat` are async iterators, the
    other calls coroutines."""

    def __init__(self, target: str = "localhost:50051", *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | None = None, client_cert: bytes | None = None, client_key: bytes | None = None,
                 timeout: float | None = 600.0, retries: int = 4):
        super().__init__(grpc.aio, target, token, tls, root_certificates, client_cert, client_key, timeout, retries)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **fields) -> AsyncIterator[Event]:
        assembler = _Assembler()
        async for msg in self.stub.Generate(generate_request(prompt, **fields), **self._call_args(timeout)):
            event = assembler.feed(msg)
            if event is not None:
                yield event

    def chat(self, messages: Sequence[Message], **fields) -> AsyncIterator[Event]:
        return self.generate(chat=messages, **fields)

    async def complete(self, prompt: str | None = None, **fields) -> Completion:
        completion = None
        async for completion in self.generate(prompt, **fields):
            pass
        return completion

    async def tokenize(self, text: str, add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self.stub.Tokenize(request, **self._call_args(timeout))).token_ids)

    async def info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._call_args(timeout))

    async def abort(self, *request_ids: str, timeout: float | None = None) -> int:
        return (await self.stub.Abort(pb.AbortRequest(request_ids=request_ids), **self._call_args(timeout))).aborted

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

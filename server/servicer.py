"""The Generation service: translates between the wire and the engine, nothing more.

Handlers run on the server's asyncio loop; the engine runs elsewhere (EngineClient)
and hands outputs over through an OutputHub.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from engine.output import RequestOutput
from engine.sampling_params import InvalidRequest
from engine.sequence import FinishReason, Sequence
from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server import protocol
from server.engine_client import DuplicateRequest, EngineClient
from server.observability import Observer, RequestRecord
from server.streams import AsyncOutputs, EngineStopped, OutputHub, StreamBacklogExceeded

log = logging.getLogger("llamastream.server")
PREPARE_THREADS = 4  # requests tokenized at once (the tokenizer releases the GIL)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, engine: EngineClient, hub: OutputHub, observer: Observer, max_in_flight: int,
                 log_prompts: bool = False):
        self.engine = engine
        self.info = engine.info
        self.hub = hub
        self.observer = observer
        self.tokenizer = engine.info.tokenizer
        self.max_in_flight = max_in_flight
        self.log_prompts = log_prompts  # prompts are never logged otherwise
        self.accepting = threading.Event()  # set once warmed up; cleared when draining
        # Tokenizing and rendering a chat take up to seconds for megabytes of prompt: off
        # the event loop, which every stream and health check shares.
        self._prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="prepare")
        self._owners: dict[str, str | None] = {}  # in-flight request id -> who may abort it (caller_identity)
        self._cut: set[str] = set()  # requests ended by the shutdown (cut_all)

    def close(self) -> None:
        self._prepare.shutdown(wait=False, cancel_futures=True)

    async def _refuse(self, context: grpc.aio.ServicerContext, record: RequestRecord,
                      code: grpc.StatusCode, details: str) -> None:
        """End the call with `code`, noting it for the metrics and the request log."""
        record.status, record.ended = code.name, True
        await context.abort(code, details)

    async def _check_available(self, context: grpc.aio.ServicerContext, record: RequestRecord) -> None:
        if not self.accepting.is_set():
            await self._refuse(context, record, grpc.StatusCode.UNAVAILABLE,
                               "the server is loading or draining: retry shortly, or another replica")
        if not self.engine.alive:
            await self._refuse(context, record, grpc.StatusCode.UNAVAILABLE,
                               f"the engine has stopped: {self.engine.fatal_error or 'restart the server'}")

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        record = RequestRecord("-")  # (until the request's id is known to be fit to log)
        try:
            async with contextlib.aclosing(self._generate(request, context, record)) as responses:
                async for response in responses:
                    yield response
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or its deadline passed
            if not record.ended:
                remaining = context.time_remaining()
                record.status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            raise
        finally:
            self.observer.finished(record)

    def _sequence(self, request: pb.GenerateRequest, request_id: str) -> Sequence:
        """The checked sequence of a request (run in the _prepare threads: tokenizes)."""
        ids = protocol.prompt_ids(request, self.tokenizer)
        return self.info.make_sequence(request_id, ids, protocol.sampling_params(request))

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, record: RequestRecord):
        await self._check_available(context, record)
        try:
            request_id = record.request_id = protocol.request_id(request)
            seq = await asyncio.get_running_loop().run_in_executor(self._prepare, self._sequence, request, request_id)
        except InvalidRequest as e:
            await self._refuse(context, record, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        await self._check_available(context, record)  # (again: tokenizing may have taken a while)
        if self.engine.num_in_flight() >= self.max_in_flight:
            await self._refuse(context, record, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.max_in_flight} requests are in flight, the most this server queues: retry with backoff")
        if self.log_prompts:
            log.info("request %s prompt: %r", request_id, self.tokenizer.decode(seq.prompt_ids))
        outputs = self.hub.outputs(on_overflow=lambda: self.engine.abort(request_id))
        try:
            self.engine.submit(seq, outputs)
        except DuplicateRequest as e:
            await self._refuse(context, record, grpc.StatusCode.ALREADY_EXISTS, str(e))
        self._owners[request_id] = caller_identity(context)
        try:
            record.prompt_tokens = len(seq.prompt_ids)
            yield pb.GenerateResponse(
                request_id=request_id, started=pb.Started(prompt_tokens=record.prompt_tokens, model=self.info.model_name)
            )
            while not record.ended:
                out = await self._next_output(outputs, context, record)
                if out.finish_reason is FinishReason.ERROR:
                    await self._refuse(context, record, grpc.StatusCode.INTERNAL, out.error or "engine fault")
                cut = out.finish_reason is FinishReason.ABORT and request_id in self._cut
                for response in protocol.responses(out, self.tokenizer):
                    if cut and response.HasField("finished"):
                        break
                    record.completion_tokens += len(response.delta.token_ids)
                    yield response
                if cut:
                    await self._refuse(context, record, grpc.StatusCode.UNAVAILABLE,
                                       f"the server is shutting down: the stream was cut after {record.completion_tokens} "
                                       "tokens; retry on another replica")
                if out.finished:
                    record.finish_reason, record.usage = out.finish_reason.name.lower(), out.usage
                    record.ended = True
        finally:  # a cancel, a deadline or a failed write ends the RPC early: free the sequence
            if not record.ended:
                self.engine.abort(request_id)
            self._owners.pop(request_id, None)
            self._cut.discard(request_id)

    async def _next_output(self, outputs: AsyncOutputs, context: grpc.aio.ServicerContext,
                           record: RequestRecord) -> RequestOutput:
        try:
            return await outputs.get()
        except StreamBacklogExceeded as e:
            await self._refuse(context, record, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"the client read too slowly: {e}; read the stream as it arrives "
                               "(the server's --max-stream-backlog sets the limit)")
        except EngineStopped as e:
            await self._refuse(context, record, grpc.StatusCode.INTERNAL, f"the engine stopped: {e}")

    def cut_all(self) -> int:
        """End every stream still in flight (the shutdown's grace has run out): each ends
        with UNAVAILABLE saying how many tokens it was sent. Returns how many."""
        in_flight = list(self._owners)
        self._cut.update(in_flight)
        for request_id in in_flight:
            self.engine.abort(request_id)
        return len(in_flight)

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._prepare, protocol.tokenize, request,
                                                                    self.tokenizer)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        info = self.info
        return pb.ModelInfo(
            model=info.model_name,
            max_context_length=info.max_model_len,
            vocab_size=info.config.vocab_size,
            eos_token_ids=self.tokenizer.eos_token_ids,
            has_chat_template=self.tokenizer.chat_template is not None,
            backend=info.backend_name,
            kv_cache_blocks=info.num_kv_blocks,
            block_size=info.block_size,
            prefix_caching=info.prefix_caching,
        )

    async def FlushCache(self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext) -> pb.FlushCacheResponse:
        self.engine.reset_prefix_cache()
        return pb.FlushCacheResponse()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        """Abort the named requests that the caller may abort: with mutual TLS, those made
        with the same client certificate; otherwise any (see caller_identity)."""
        caller = caller_identity(context)
        mine = [rid for rid in set(request.request_ids) if rid in self._owners and self._owners[rid] == caller]
        return pb.AbortResponse(aborted=sum(self.engine.abort(rid) for rid in mine))


def caller_identity(context: grpc.aio.ServicerContext) -> str | None:
    """Who is calling, as far as the transport says: the client certificate under mutual
    TLS, else None. A bearer token is one identity shared by all who hold it, so without
    client certificates every caller is the same one."""
    certificate = context.auth_context().get("x509_pem_cert")
    return certificate[0].decode() if certificate else None

"""The Generation service: translates between the wire and the engine, nothing more.

Handlers run on the server's asyncio loop; the engine runs elsewhere (EngineClient)
and hands outputs over through an OutputHub.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc

from engine.output import RequestOutput
from engine.sampling_params import InvalidRequest
from engine.sequence import FinishReason
from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server import protocol
from server.engine_client import DuplicateRequest, EngineClient
from server.observability import Observer, RequestRecord
from server.streams import AsyncOutputs, EngineStopped, OutputHub, StreamBacklogExceeded

log = logging.getLogger("llamastream.server")


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

    async def _refuse(self, context: grpc.aio.ServicerContext, record: RequestRecord,
                      code: grpc.StatusCode, details: str) -> None:
        """End the call with `code`, noting it for the metrics and the request log."""
        record.status = code.name
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
            async for response in self._generate(request, context, record):
                yield response
        except asyncio.CancelledError:  # the client went away, or its deadline passed
            remaining = context.time_remaining()
            record.status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            raise
        finally:
            self.observer.finished(record)

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, record: RequestRecord):
        await self._check_available(context, record)
        try:
            request_id = record.request_id = protocol.request_id(request)
            ids = protocol.prompt_ids(request, self.tokenizer)
            seq = self.info.make_sequence(request_id, ids, protocol.sampling_params(request))
        except InvalidRequest as e:
            await self._refuse(context, record, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.engine.num_in_flight() >= self.max_in_flight:
            await self._refuse(context, record, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{self.max_in_flight} requests are in flight, the most this server queues: retry with backoff")
        if self.log_prompts:
            log.info("request %s prompt: %r", request_id, self.tokenizer.decode(ids))
        outputs = self.hub.outputs(on_overflow=lambda: self.engine.abort(request_id))
        try:
            self.engine.submit(seq, outputs)
        except DuplicateRequest as e:
            await self._refuse(context, record, grpc.StatusCode.ALREADY_EXISTS, str(e))
        finished = False
        try:
            yield pb.GenerateResponse(
                request_id=request_id, started=pb.Started(prompt_tokens=len(ids), model=self.info.model_name)
            )
            while not finished:
                out = await self._next_output(outputs, context, record)
                finished = out.finished
                if out.finish_reason is FinishReason.ERROR:
                    await self._refuse(context, record, grpc.StatusCode.INTERNAL, out.error or "engine fault")
                if finished:
                    record.finish_reason, record.usage = out.finish_reason.name.lower(), out.usage
                for response in protocol.responses(out, self.tokenizer):
                    yield response
        finally:  # a cancel, a deadline or a failed write ends the RPC early: free the sequence
            if not finished:
                self.engine.abort(request_id)

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

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            return protocol.tokenize(request, self.tokenizer)
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
        )

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=sum(self.engine.abort(rid) for rid in set(request.request_ids)))

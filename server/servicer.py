"""The Generation service: translates between the wire and the engine, nothing more."""

from __future__ import annotations

import queue
import threading
import uuid

import grpc

from engine.engine_loop import DuplicateRequest, EngineLoop
from engine.output import RequestOutput
from engine.sampling_params import InvalidRequest
from engine.sequence import FinishReason
from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server import protocol


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, loop: EngineLoop, backend_name: str, max_in_flight: int):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = loop.engine.tokenizer
        self.backend_name = backend_name
        self.max_in_flight = max_in_flight
        self.accepting = threading.Event()  # set once warmed up; cleared when draining

    def _check_available(self, context: grpc.ServicerContext) -> None:
        if not self.accepting.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading or draining: retry shortly, or another replica")
        if not self.loop.alive:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine has stopped: {self.loop.fatal_error or 'restart the server'}")

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        self._check_available(context)
        request_id = request.request_id or uuid.uuid4().hex
        try:
            ids = protocol.prompt_ids(request, self.tokenizer)
            seq = self.engine.make_sequence(request_id, ids, protocol.sampling_params(request))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self.loop.num_in_flight() >= self.max_in_flight:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.max_in_flight} requests are in flight, the most this server queues: retry with backoff")
        try:
            outputs = self.loop.submit(seq)
        except DuplicateRequest as e:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        # Runs when the RPC ends for any reason: a cancel or deadline aborts the sequence.
        context.add_callback(lambda: self.loop.abort(request_id))
        yield pb.GenerateResponse(
            request_id=request_id, started=pb.Started(prompt_tokens=len(ids), model=self.engine.model.name)
        )
        while True:
            out = self._next_output(outputs, context)
            if out.finish_reason is FinishReason.ERROR:
                context.abort(grpc.StatusCode.INTERNAL, out.error or "engine fault")
            yield from protocol.responses(out, self.tokenizer)
            if out.finished:
                return

    def _next_output(self, outputs: queue.SimpleQueue, context: grpc.ServicerContext) -> RequestOutput:
        """The next event; if the client fell behind, everything queued since, as one."""
        while True:
            try:
                out = outputs.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.loop.alive:
                    context.abort(grpc.StatusCode.INTERNAL, f"the engine stopped: {self.loop.fatal_error}")
        while not out.finished:
            try:
                out.absorb(outputs.get_nowait())
            except queue.Empty:
                break
        return out

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        try:
            return protocol.tokenize(request, self.tokenizer)
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        e = self.engine
        return pb.ModelInfo(
            model=e.model.name,
            max_context_length=e.max_model_len,
            vocab_size=e.model.config.vocab_size,
            eos_token_ids=self.tokenizer.eos_token_ids,
            has_chat_template=self.tokenizer.chat_template is not None,
            backend=self.backend_name,
            kv_cache_blocks=e.block_manager.num_blocks,
            block_size=e.block_manager.block_size,
        )

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=sum(self.loop.abort(rid) for rid in set(request.request_ids)))

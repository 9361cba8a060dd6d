"""The Generation service: translates between the wire and the engine, nothing more
(what happens to a request on the way is server/requests.py's)."""

from __future__ import annotations

import contextlib

import grpc

from engine.sampling_params import InvalidRequest
from engine.sequence import Sequence
from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server import protocol
from server.observability import RequestRecord
from server.requests import Requests


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, requests: Requests):
        self.requests = requests
        self.engine = requests.engine
        self.info = requests.engine.info
        self.tokenizer = self.info.tokenizer

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        async with self.requests.call(context) as record:
            async with contextlib.aclosing(self._generate(request, context, record)) as responses:
                async for response in responses:
                    yield response

    def _sequence(self, request: pb.GenerateRequest, request_id: str) -> Sequence:
        """The checked sequence of a request (run on the preparing threads: tokenizes)."""
        ids = protocol.prompt_ids(request, self.tokenizer)
        return self.info.make_sequence(request_id, ids, protocol.sampling_params(request))

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, record: RequestRecord):
        await self.requests.check_available(context, record)
        try:
            request_id = record.request_id = protocol.request_id(request)
            seq = await self.requests.prepare(self._sequence, request, request_id)
        except InvalidRequest as e:
            await self.requests.refuse(context, record, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        async with contextlib.aclosing(self.requests.outputs(seq, context, record)) as outputs:
            async for out in outputs:
                if out is None:  # the engine has it
                    yield pb.GenerateResponse(request_id=request_id, started=pb.Started(
                        prompt_tokens=record.prompt_tokens, model=self.info.model_name))
                    continue
                for response in protocol.responses(out, self.tokenizer):
                    yield response

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        try:
            return await self.requests.prepare(protocol.tokenize, request, self.tokenizer)
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
            weight_format=info.weight_format,
            weight_dtype=info.weight_dtype,
            weight_bytes=info.weight_bytes,
            kv_cache_dtype=info.kv_cache_dtype,
        )

    async def FlushCache(self, request: pb.FlushCacheRequest, context: grpc.aio.ServicerContext) -> pb.FlushCacheResponse:
        self.engine.reset_prefix_cache()
        return pb.FlushCacheResponse()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self.requests.abort(context, request.request_ids))

"""vLLM's gRPC engine protocol (`vllm.grpc.engine.VllmEngine`, the stubs of the
smg-grpc-proto package), which the Shepherd Model Gateway and other routers speak to
their workers: translated onto the same engine and request flow as our own service
(server/requests.py), on the same port.

What the protocol offers and llamastream does not do is refused with INVALID_ARGUMENT
(a field of a request) or UNIMPLEMENTED (an RPC), naming it; nothing is ignored.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import tempfile
import time
import zipfile
from pathlib import Path

import grpc
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.output import RequestOutput
from engine.sampler import TokenLogprob
from engine.sampling_params import MAX_TOP_LOGPROBS, InvalidRequest, SamplingParams
from engine.sequence import FinishReason, Sequence
from engine.models import architecture_of
from server import package_version, protocol
from server.kv_events import KvEventPublisher, SubscriberTooSlow
from server.observability import RequestRecord
from server.requests import Requests

SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
TOKENIZER_CHUNK_BYTES = 1 << 20
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
# Request fields llamastream has no use for: set, they are refused, by name.
_UNSUPPORTED = {
    "mm_inputs": "multimodal inputs (llamastream serves text models)",
    "extra_mm_inputs": "multimodal inputs (llamastream serves text models)",
    "media_refs": "multimodal inputs (llamastream serves text models)",
    "kv_transfer_params": "KV transfer between workers",
    "kv_transfer_params_json": "KV transfer between workers",
}
_UNSUPPORTED_SAMPLING = {
    "prompt_logprobs": "prompt logprobs",
    "truncate_prompt_tokens": "prompt truncation",
    "logit_bias": "logit bias",
    "include_stop_str_in_output": "stop strings in the output",
    "structural_tag": "structural tags",
}


def _refusal(field: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{field}: {what} is not supported by llamastream; leave it unset")


def sampling_params(p: vpb.SamplingParams) -> SamplingParams:
    """Our SamplingParams for vLLM's, with vLLM's meaning of proto3's zero defaults
    (top_p 0 and repetition_penalty 0 are unset; top_k 0 is no limit)."""
    for field, what in _UNSUPPORTED_SAMPLING.items():
        if _is_set(p, field):
            raise _refusal(f"sampling_params.{field}", what)
    if p.n > 1:
        raise _refusal("sampling_params.n", f"n = {p.n} (several samples of one prompt)")
    if p.HasField("logprobs") and not 0 <= p.logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"sampling_params.logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {p.logprobs}")
    return SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p or 1.0,
        top_k=p.top_k or -1,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty or 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        min_tokens=p.min_tokens,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        top_logprobs=p.logprobs if p.HasField("logprobs") else None,
        skip_special_tokens=p.skip_special_tokens,
        constraint=protocol.constraint(p),  # (what the gateway sends for an OpenAI response_format)
    )


def _is_set(message, field: str) -> bool:
    try:
        return message.HasField(field)
    except ValueError:  # (a scalar without presence, or a map: set when not empty or zero)
        return bool(getattr(message, field))


def output_logprobs(logprobs: list[TokenLogprob]) -> vpb.OutputLogProbs:
    return vpb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs], token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[vpb.TopLogProbs(values=[v for _, v in lp.top], token_ids=[t for t, _ in lp.top])
                      for lp in logprobs])


class VllmEngineServicer(vpb_grpc.VllmEngineServicer):
    def __init__(self, requests: Requests, kv_events: KvEventPublisher, model_path: str):
        self.requests, self.kv_events = requests, kv_events
        self.engine = requests.engine
        self.info = requests.engine.info
        self.tokenizer = self.info.tokenizer
        self.model_path = model_path
        self.started = time.time()
        self.last_receive = 0.0

    # -- Generate -----------------------------------------------------------------------
    async def Generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext):
        self.last_receive = time.time()
        async with self.requests.call(context) as record:
            async with contextlib.aclosing(self._generate(request, context, record)) as responses:
                async for response in responses:
                    yield response

    def _sequence(self, request: vpb.GenerateRequest, request_id: str) -> Sequence:
        """The checked sequence of a request (run on the preparing threads: tokenizes)."""
        for field, what in _UNSUPPORTED.items():
            if _is_set(request, field):
                raise _refusal(field, what)
        if request.data_parallel_rank:
            raise InvalidRequest(f"data_parallel_rank is {request.data_parallel_rank}: llamastream runs one rank, 0")
        kind = request.WhichOneof("input")
        if kind == "tokenized":
            ids = list(request.tokenized.input_ids)
        elif kind == "text":
            ids = self.tokenizer.encode(request.text, add_special_tokens=True)
        else:
            raise InvalidRequest("input is empty: send tokenized.input_ids or text")
        try:
            return self.info.make_sequence(request_id, ids, sampling_params(request.sampling_params))
        except InvalidRequest as e:  # (our checks name our own message's fields)
            raise InvalidRequest(str(e).replace("output.top_logprobs", "sampling_params.logprobs")
                                 .replace("sampling.", "sampling_params.").replace("stop.", "sampling_params.")
                                 .replace("structured.", "sampling_params.")) from e

    async def _generate(self, request: vpb.GenerateRequest, context: grpc.aio.ServicerContext, record: RequestRecord):
        await self.requests.check_available(context, record)
        try:
            record.request_id = protocol.request_id(request)
            seq = await self.requests.prepare(self._sequence, request, record.request_id)
        except InvalidRequest as e:
            await self.requests.refuse(context, record, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        wants_logprobs = seq.params.top_logprobs is not None
        whole = RequestOutput(seq.request_id)  # what a request that does not stream gets at the end
        async with contextlib.aclosing(self.requests.outputs(seq, context, record)) as outputs:
            async for out in outputs:
                if out is None:
                    continue
                if not request.stream:
                    whole.absorb(out)
                    out = whole
                    if not out.finished:
                        continue
                if request.stream and out.token_ids:
                    chunk = vpb.GenerateStreamChunk(token_ids=out.token_ids, prompt_tokens=len(seq.prompt_ids),
                                                    completion_tokens=len(out.token_ids))
                    if wants_logprobs:
                        chunk.output_logprobs.CopyFrom(output_logprobs(out.logprobs))
                    yield vpb.GenerateResponse(chunk=chunk)
                if out.finished:
                    yield vpb.GenerateResponse(complete=self._complete(out, wants_logprobs))

    @staticmethod
    def _complete(out: RequestOutput, wants_logprobs: bool) -> vpb.GenerateComplete:
        """The last message: why it ended and the request's token counts, with every token
        for a request that does not stream. A streamed request has had every token in its
        chunks, the last delta included; as vLLM's does, the complete repeats that delta
        (gateways read the tokens of a stream from its chunks)."""
        u = out.usage
        complete = vpb.GenerateComplete(output_ids=out.token_ids, finish_reason=_FINISH_REASONS[out.finish_reason],
                                        prompt_tokens=u.prompt_tokens, completion_tokens=len(out.token_ids),
                                        cached_tokens=u.cached_tokens)
        if out.stop_string is not None:
            complete.matched_stop_str = out.stop_string
        elif out.stop_token_id is not None:
            complete.matched_token_id = out.stop_token_id
        if wants_logprobs:
            complete.output_logprobs.CopyFrom(output_logprobs(out.logprobs))
        return complete

    async def Abort(self, request: vpb.AbortRequest, context: grpc.aio.ServicerContext) -> vpb.AbortResponse:
        self.requests.abort(context, request.request_ids)
        return vpb.AbortResponse()

    # -- the worker's state -------------------------------------------------------------
    async def HealthCheck(self, request, context: grpc.aio.ServicerContext) -> vpb.HealthCheckResponse:
        if not self.engine.alive:
            return vpb.HealthCheckResponse(healthy=False, message=f"the engine has stopped: {self.engine.fatal_error}")
        if self.requests.draining.is_set():
            # Still healthy: a gateway stops reading the streams of a worker it takes for
            # unhealthy, and these must finish. New calls are refused (UNAVAILABLE), and
            # retried elsewhere; the worker leaves the pool when it exits.
            return vpb.HealthCheckResponse(healthy=True, message="draining: new requests are refused")
        if not self.requests.accepting.is_set():
            return vpb.HealthCheckResponse(healthy=False, message="loading")
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request, context: grpc.aio.ServicerContext) -> vpb.GetModelInfoResponse:
        info, config = self.info, self.info.config
        architecture = architecture_of(config)
        return vpb.GetModelInfoResponse(
            model_path=self.model_path, is_generation=True, max_context_length=info.max_model_len,
            vocab_size=config.vocab_size, supports_vision=False, served_model_name=info.model_name,
            model_type=architecture.model_types[0], architectures=list(architecture.hf_architectures),
            eos_token_ids=self.tokenizer.eos_token_ids, max_req_input_len=info.max_model_len - 1)

    async def GetServerInfo(self, request, context: grpc.aio.ServicerContext) -> vpb.GetServerInfoResponse:
        info = self.info
        return vpb.GetServerInfoResponse(
            active_requests=self.engine.num_in_flight(), is_paused=False, last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started, server_type="vllm-grpc", data_parallel_size=1,
            block_size=info.block_size, max_num_seqs=info.max_num_seqs,
            model_dtype=info.weight_dtype)

    async def GetLoads(self, request: vpb.GetLoadsRequest, context: grpc.aio.ServicerContext) -> vpb.GetLoadsResponse:
        info, stats = self.info, self.engine.stats()
        capacity = info.num_kv_blocks * info.block_size
        used = (info.num_kv_blocks - stats.kv_blocks_free) * info.block_size
        load = vpb.SchedulerLoad(dp_rank=0, num_running_reqs=stats.running, num_waiting_reqs=stats.waiting,
                                 num_total_reqs=stats.running + stats.waiting, num_used_tokens=used,
                                 max_total_num_tokens=capacity, token_usage=used / capacity)
        return vpb.GetLoadsResponse(timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                    version=package_version(), dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context: grpc.aio.ServicerContext):
        """The tokenizer's files (tokenizer.json, tokenizer_config.json with the chat
        template, generation_config.json) as one zip, in chunks; the last says its SHA-256."""
        data = await self.requests.prepare(self._tokenizer_zip)
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            last = start + TOKENIZER_CHUNK_BYTES >= len(data)
            yield common.GetTokenizerChunk(data=data[start : start + TOKENIZER_CHUNK_BYTES],
                                           sha256=hashlib.sha256(data).hexdigest() if last else "")

    def _tokenizer_zip(self) -> bytes:
        buffer = io.BytesIO()
        with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            self.tokenizer.save_hf(Path(tmp))
            for path in sorted(Path(tmp).iterdir()):
                archive.write(path, path.name)
        return buffer.getvalue()

    async def FlushCache(self, request: common.FlushCacheRequest, context: grpc.aio.ServicerContext):
        self.engine.reset_prefix_cache()
        return common.FlushCacheResponse(
            success=True, message="the cached prefixes no running request holds are dropped before the next step")

    # -- what llamastream does not do ---------------------------------------------------
    async def Embed(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Embed: llamastream serves generation models, not embeddings")

    async def StartProfile(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StartProfile: use bench/profile_server.py to profile llamastream")

    async def StopProfile(self, request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StopProfile: use bench/profile_server.py to profile llamastream")

    # -- the prefix cache's events -----------------------------------------------------
    async def SubscribeKvEvents(self, request: common.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext):
        """Blocks stored in and removed from the prefix cache, a batch per engine step
        (server/kv_events.py), until the caller hangs up."""
        if not self.info.prefix_caching:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "SubscribeKvEvents: this server runs with "
                                "--no-prefix-caching, so there are no cached blocks to report")
        await context.send_initial_metadata(())  # (a subscriber waits for the stream's headers, not for a batch)
        try:
            async for batch in self.kv_events.subscribe(request.start_sequence_number):
                yield batch
        except SubscriberTooSlow:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "SubscribeKvEvents: the subscriber left too many "
                                "batches unread; subscribe again with start_sequence_number")


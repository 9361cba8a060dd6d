"""vLLM's gRPC engine protocol (vllm.grpc.engine.VllmEngine) on the server's port, called
through smg-grpc-proto's generated stubs over a real socket: every RPC, its answers
checked against our own service's, and the clear errors for what llamastream does not do."""

from __future__ import annotations

import hashlib
import io
import json
import queue
import threading
import time
import zipfile

import grpc
import pytest
import tokenizers
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llamastream.v1 import generation_pb2 as pb
from tests.serving import collect, local_server, stub

PROMPT = [1, 5, 9, 42, 7, 300, 12]


@pytest.fixture(scope="module")
def server():
    s = local_server(num_kv_blocks=160, engine_process=True)
    yield s
    s.drain()


@pytest.fixture(scope="module")
def vllm(server):
    return vpb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))


def greedy(max_tokens: int = 12, **fields) -> vpb.SamplingParams:
    return vpb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


def ours(server, ids: list[int], max_tokens: int = 12) -> list[int]:
    """The same request through llamastream's own service."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(temperature=0.0),
                                 stop=pb.StopCriteria(max_tokens=max_tokens, ignore_eos=True))
    messages, _ = collect(stub(f"127.0.0.1:{server.port}").Generate(request, timeout=30))
    return [t for m in messages for t in m.delta.token_ids]


def generate(vllm, stream: bool, sampling: vpb.SamplingParams, ids=PROMPT, **fields) -> list[vpb.GenerateResponse]:
    request = vpb.GenerateRequest(request_id=fields.pop("request_id", ""), tokenized=vpb.TokenizedInput(input_ids=ids),
                                  sampling_params=sampling, stream=stream, **fields)
    return list(vllm.Generate(request, timeout=30))


def test_streamed_generation_is_chunks_then_complete_and_equals_our_service(server, vllm):
    """As vLLM streams: every token in the chunks, the last delta included, then a
    complete that repeats that delta (gateways take a stream's tokens from its chunks)."""
    responses = generate(vllm, True, greedy())
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[-1] == "complete" and set(kinds[:-1]) == {"chunk"}
    tokens = [t for r in responses[:-1] for t in r.chunk.token_ids]
    assert tokens == ours(server, PROMPT)
    complete = responses[-1].complete
    assert list(complete.output_ids) == list(responses[-2].chunk.token_ids)
    assert (complete.finish_reason, complete.prompt_tokens) == ("length", len(PROMPT))
    assert sum(r.chunk.completion_tokens for r in responses[:-1]) == 12


def test_unstreamed_generation_is_one_complete_with_every_token(server, vllm):
    (response,) = generate(vllm, False, greedy())
    assert list(response.complete.output_ids) == ours(server, PROMPT)
    assert response.complete.completion_tokens == 12


def test_text_input_is_tokenized_with_special_tokens(server, vllm):
    text = "The capital of France is"
    request = vpb.GenerateRequest(text=text, sampling_params=greedy(6), stream=False)
    (response,) = list(vllm.Generate(request, timeout=30))
    ids = server.engine.info.tokenizer.encode(text, add_special_tokens=True)
    assert response.complete.prompt_tokens == len(ids)
    assert list(response.complete.output_ids) == ours(server, ids, 6)


def test_logprobs_stop_strings_and_stop_tokens(server, vllm):
    (response,) = generate(vllm, False, greedy(logprobs=3))
    lps = response.complete.output_logprobs
    assert list(lps.token_ids) == list(response.complete.output_ids)
    assert all(len(top.values) == 3 and top.token_ids[0] == t for top, t in zip(lps.top_logprobs, lps.token_ids))
    first = ours(server, PROMPT, 3)
    (stopped,) = generate(vllm, False, greedy(stop_token_ids=[first[2]]))
    assert (stopped.complete.finish_reason, stopped.complete.matched_token_id) == ("stop", first[2])
    text = server.engine.info.tokenizer.decode(ours(server, PROMPT))
    stop = text[len(text) // 2 :][:3]
    (by_string,) = generate(vllm, False, greedy(stop=[stop]))
    assert (by_string.complete.finish_reason, by_string.complete.matched_stop_str) == ("stop", stop)


@pytest.mark.parametrize("fields, sampling, named", [
    (dict(mm_inputs=vpb.MultimodalInputs(im_token_id=3)), {}, "mm_inputs"),
    (dict(kv_transfer_params=vpb.KvTransferParams(remote_host="h", remote_port=1)), {}, "kv_transfer_params"),
    (dict(data_parallel_rank=1), {}, "data_parallel_rank"),
    ({}, dict(n=2), "sampling_params.n"),
    ({}, dict(structural_tag='{"structures": []}'), "sampling_params.structural_tag"),
    ({}, dict(json_schema='{"type": "banana"}'), "sampling_params.json_schema: Invalid type: banana"),
    ({}, dict(choice=vpb.ChoiceConstraint(choices=[])), "sampling_params.choice"),
    ({}, dict(prompt_logprobs=1), "sampling_params.prompt_logprobs"),
    ({}, dict(logit_bias={5: 1.0}), "sampling_params.logit_bias"),
    ({}, dict(logprobs=-1), "sampling_params.logprobs"),
    ({}, dict(temperature=-1.0), "sampling_params.temperature"),
    ({}, dict(min_tokens=20), "sampling_params.min_tokens"),
])
def test_what_llamastream_does_not_do_is_refused_by_name(vllm, fields, sampling, named):
    params = vpb.SamplingParams(max_tokens=4)
    for key, value in sampling.items():
        if isinstance(value, dict):
            getattr(params, key).update(value)
        elif isinstance(value, vpb.ChoiceConstraint):
            getattr(params, key).SetInParent()  # (set, even with no choices)
            getattr(params, key).CopyFrom(value)
        else:
            setattr(params, key, value)
    with pytest.raises(grpc.RpcError) as e:
        generate(vllm, True, params, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in e.value.details(), e.value.details()


def test_abort_ends_a_stream_with_finish_reason_abort(vllm):
    request = vpb.GenerateRequest(request_id="to-abort", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                                  sampling_params=greedy(2000), stream=True)
    responses = vllm.Generate(request, timeout=30)
    first = next(responses)  # (it runs)
    vllm.Abort(vpb.AbortRequest(request_ids=["to-abort"]), timeout=5)
    rest = list(responses)
    assert first.WhichOneof("response") == "chunk" and rest[-1].complete.finish_reason == "abort"
    assert sum(len(r.chunk.token_ids) for r in [first] + rest[:-1]) < 2000


def test_health_model_server_and_load_information(server, vllm):
    assert vllm.HealthCheck(vpb.HealthCheckRequest(), timeout=5).healthy
    model = vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=5)
    info = server.engine.info
    assert (model.served_model_name, model.vocab_size, model.max_context_length) == (
        info.model_name, info.config.vocab_size, info.max_model_len)
    assert list(model.architectures) == ["LlamaForCausalLM"] and model.is_generation and not model.supports_vision
    server_info = vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=5)
    assert (server_info.server_type, server_info.block_size, server_info.max_num_seqs) == ("vllm-grpc", 16, 64)
    loads = vllm.GetLoads(vpb.GetLoadsRequest(), timeout=5)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens == 160 * 16
    assert 0.0 <= loads.loads[0].token_usage <= 1.0


def test_the_tokenizer_is_served_as_a_zip_that_tokenizes_alike(server, vllm):
    chunks = list(vllm.GetTokenizer(common.GetTokenizerRequest(), timeout=10))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and not any(c.sha256 for c in chunks[:-1])
    files = zipfile.ZipFile(io.BytesIO(data))
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(files.namelist())
    served = tokenizers.Tokenizer.from_str(files.read("tokenizer.json").decode())
    text = "Paris is the capital of France."
    assert served.encode(text, add_special_tokens=False).ids == server.engine.info.tokenizer.encode(text, False)
    assert "chat_template" in json.loads(files.read("tokenizer_config.json"))


def test_flush_cache_and_the_rpcs_llamastream_does_not_implement(vllm):
    assert vllm.FlushCache(common.FlushCacheRequest(), timeout=5).success
    calls = [lambda: vllm.Embed(vpb.EmbedRequest(), timeout=5),
             lambda: vllm.StartProfile(common.StartProfileRequest(), timeout=5)]
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and e.value.details()


class Subscription:
    """A SubscribeKvEvents stream read on a thread: its batches so far, and the blocks
    they say are cached (hash -> (parent hash, token ids))."""

    def __init__(self, vllm, start: int = 0):
        self.call = vllm.SubscribeKvEvents(common.SubscribeKvEventsRequest(start_sequence_number=start))
        self.batches: list[common.KvEventBatch] = []
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self._arrived.put(batch)
        except grpc.RpcError as e:  # (cancelled at the end of the test)
            assert e.code() == grpc.StatusCode.CANCELLED

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc) -> None:
        self.call.cancel()

    def snapshot(self) -> dict[int, tuple[int | None, list[int]]]:
        """The cached blocks of the snapshot a subscriber gets first."""
        self.until(lambda s: s.batches and s.batches[-1].snapshot.index == s.batches[-1].snapshot.count - 1)
        return self.blocks()

    def until(self, done, timeout: float = 10) -> None:
        """Read batches until done(self) holds."""
        deadline = time.monotonic() + timeout
        while not done(self):
            self.batches.append(self._arrived.get(timeout=max(0.01, deadline - time.monotonic())))

    def blocks(self) -> dict[int, tuple[int | None, list[int]]]:
        cached: dict[int, tuple[int | None, list[int]]] = {}
        for event in (e for b in self.batches for e in b.events):
            kind = event.WhichOneof("data")
            if kind == "cleared":
                cached.clear()
            elif kind == "removed":
                for h in event.removed.block_hashes:
                    del cached[h]
            else:
                parent = event.stored.parent_block_hash if event.stored.HasField("parent_block_hash") else None
                for block in event.stored.blocks:
                    cached[block.block_hash], parent = (parent, list(block.token_ids)), block.block_hash
        return cached


def prefix_blocks(cached, prompt: list[int]) -> list[int] | None:
    """The hashes of the chain of cached blocks that spells `prompt`'s full blocks, or None."""
    by_parent = {(parent, tuple(tokens)): h for h, (parent, tokens) in cached.items()}
    chain, parent = [], None
    for i in range(0, len(prompt) - len(prompt) % 16, 16):
        parent = by_parent.get((parent, tuple(prompt[i : i + 16])))
        if parent is None:
            return None
        chain.append(parent)
    return chain


def test_kv_events_tell_what_is_cached_from_a_snapshot_resumed_or_live(server, vllm):
    prompt = [(7 * i) % 500 for i in range(3, 43)]  # 2 full blocks of 16 (the rest is never cached)
    earlier = [(11 * i) % 500 for i in range(20)]  # cached before the subscription: in its snapshot
    generate(vllm, False, greedy(2), ids=earlier)
    with Subscription(vllm) as live:
        before = live.snapshot()
        assert live.batches[0].events[0].WhichOneof("data") == "cleared" and len(prefix_blocks(before, earlier)) == 1
        generate(vllm, False, greedy(2), ids=prompt)
        live.until(lambda s: prefix_blocks(s.blocks(), prompt))
        chain = prefix_blocks(live.blocks(), prompt)
        assert len(chain) == 2 and live.blocks()[chain[0]][0] is None  # a chain from the prompt's start
        seen = live.batches[-1].sequence_number
        assert vllm.FlushCache(common.FlushCacheRequest(), timeout=5).success
        live.until(lambda s: not set(chain) & set(s.blocks()))  # removed, as no request holds them
        with Subscription(vllm) as late:
            assert late.snapshot() == live.blocks() and prefix_blocks(live.blocks(), prompt) is None
        with Subscription(vllm, start=seen) as resumed:
            resumed.until(lambda s: s.batches and s.batches[-1].sequence_number == live.batches[-1].sequence_number)
            after_seen = [b for b in live.batches if b.sequence_number >= seen]
            assert [(b.sequence_number, b.events) for b in resumed.batches] == [(b.sequence_number, b.events) for b in after_seen]


def test_no_kv_events_without_prefix_caching():
    s = local_server(prefix_caching=False)
    try:
        events = vpb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{s.port}")).SubscribeKvEvents(
            common.SubscribeKvEventsRequest(), timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            list(events)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--no-prefix-caching" in e.value.details()
    finally:
        s.drain()


def test_a_subscription_is_answered_before_any_event():
    """A gateway gives up on a subscription whose headers do not come (smg: "did not
    answer within"): they come at once, on a server with no cached block yet."""
    s = local_server()
    try:
        call = vpb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{s.port}")).SubscribeKvEvents(
            common.SubscribeKvEventsRequest())
        headers = threading.Thread(target=call.initial_metadata, daemon=True)
        headers.start()
        headers.join(timeout=5)
        assert not headers.is_alive()
        call.cancel()
    finally:
        s.drain()

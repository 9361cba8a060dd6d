"""Every RPC, cancellation and bad input, against a server in this process on a real socket
(in-process so the tests can see the engine's KV blocks)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from safetensors.numpy import load_file

from engine.sampling_params import MAX_STOP_STRINGS
from server.protocol import MAX_REQUEST_ID_CHARS
from llamastream.v1 import generation_pb2 as pb
from tests.conftest import TINY_MODEL
from tests.serving import check_stream_shape, collect, local_server, stub

GREEDY = pb.SamplingParams(temperature=0.0)
CONTEXT = 4096  # the tiny model's longest: a full-context stream outlasts a short deadline on any machine
KV_BLOCKS = 288  # one full-context sequence and room to spare


@pytest.fixture(scope="module")
def server():
    s = local_server(num_kv_blocks=KV_BLOCKS, max_model_len=CONTEXT, engine_process=True)  # as `llamastream serve` runs
    yield s
    s.drain()


@pytest.fixture
def client(server):
    return stub(f"127.0.0.1:{server.port}")


def wait_until(condition, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def all_blocks_free(server) -> bool:
    return server.engine.stats().kv_blocks_free == server.engine.info.num_kv_blocks and server.engine.num_in_flight() == 0


def long_request(max_tokens: int = 200, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="a long one", sampling=GREEDY,
                              stop=pb.StopCriteria(max_tokens=max_tokens, ignore_eos=True), **fields)


def test_prompt_and_token_ids_inputs_agree(client, server):
    tok = server.engine.info.tokenizer
    ids = tok.encode("hello there")
    _, by_text = collect(client.Generate(pb.GenerateRequest(prompt="hello there", sampling=GREEDY), timeout=30))
    _, by_ids = collect(client.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=GREEDY), timeout=30))
    assert by_text == by_ids


def test_logprobs_and_request_id(client):
    request = pb.GenerateRequest(request_id="mine", prompt="x", sampling=GREEDY,
                                 stop=pb.StopCriteria(max_tokens=4, ignore_eos=True), output=pb.OutputOptions(top_logprobs=3))
    msgs, _ = collect(client.Generate(request, timeout=30))
    check_stream_shape(msgs)
    assert {m.request_id for m in msgs} == {"mine"}
    logprobs = [lp for m in msgs if m.HasField("delta") for lp in m.delta.logprobs]
    assert len(logprobs) == 4
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.token_id == lp.top[0].token_id  # greedy takes the best
        assert lp.logprob <= 0


def test_cancelled_stream_frees_its_blocks(client, server):
    call = client.Generate(long_request(), timeout=60)
    next(call), next(call)  # started, first delta: it holds blocks now
    assert server.engine.stats().kv_blocks_free < server.engine.info.num_kv_blocks
    call.cancel()
    assert wait_until(lambda: all_blocks_free(server)), "the cancelled sequence kept its blocks"


def test_deadline_frees_blocks(client, server):
    call = client.Generate(long_request(max_tokens=CONTEXT - 8), timeout=0.3)
    with pytest.raises(grpc.RpcError) as e:
        next(call), next(call)  # started, first delta: it holds blocks now
        assert server.engine.stats().kv_blocks_free < server.engine.info.num_kv_blocks
        list(call)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: all_blocks_free(server))


def test_abort_rpc_ends_the_stream(client, server):
    call = client.Generate(long_request(request_id="to-abort"), timeout=60)
    next(call)
    assert client.Abort(pb.AbortRequest(request_ids=["to-abort", "unknown"]), timeout=5).aborted == 1
    msgs = list(call)
    assert msgs[-1].finished.reason == pb.FINISH_REASON_ABORT
    assert wait_until(lambda: all_blocks_free(server))


def test_duplicate_request_id_is_refused(client):
    call = client.Generate(long_request(request_id="dup"), timeout=60)
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        list(client.Generate(long_request(request_id="dup"), timeout=10))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    call.cancel()


def test_a_request_id_of_the_longest_allowed_length_is_echoed(client):
    rid = "x" * MAX_REQUEST_ID_CHARS
    msgs, _ = collect(client.Generate(long_request(max_tokens=3, request_id=rid), timeout=30))
    assert {m.request_id for m in msgs} == {rid}


def test_tokenize_and_model_info(client, server):
    tok = server.engine.info.tokenizer
    r = client.Tokenize(pb.TokenizeRequest(text="hello world", add_special_tokens=True), timeout=5)
    assert list(r.token_ids) == tok.encode("hello world", add_special_tokens=True)
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    r = client.Tokenize(pb.TokenizeRequest(chat=chat), timeout=5)
    assert r.rendered_prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert list(r.token_ids) == tok.encode_chat([{"role": "user", "content": "hi"}])[0]
    info = client.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert (info.model, info.max_context_length, info.vocab_size, info.backend) == ("tiny-llama", CONTEXT, 512, "cpu")
    assert list(info.eos_token_ids) == tok.eos_token_ids and info.has_chat_template
    assert (info.kv_cache_blocks, info.block_size) == (KV_BLOCKS, 16)
    parameters = sum(t.size for t in load_file(str(TINY_MODEL / "model.safetensors")).values())
    assert (info.weight_format, info.weight_dtype, info.weight_bytes, info.kv_cache_dtype) == \
        ("float32", "float32", 4 * parameters, "float32")


def _req(**fields) -> pb.GenerateRequest:
    if not {"prompt", "chat", "token_ids"} & fields.keys():
        fields["prompt"] = "hi"
    return pb.GenerateRequest(**fields)


BAD_REQUESTS = [
    ("no input", pb.GenerateRequest(), "no input"),
    ("empty prompt", _req(prompt=""), "empty"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "empty"),
    ("empty chat", pb.GenerateRequest(chat=pb.Chat()), "chat.messages is empty"),
    ("unknown chat role", pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])), "role"),
    ("prompt longer than the context", _req(token_ids=pb.TokenIds(ids=[7] * (CONTEXT + 5))), "context"),
    ("prompt fills the context", _req(token_ids=pb.TokenIds(ids=[7] * CONTEXT)), "context"),
    ("token id outside the vocabulary", _req(token_ids=pb.TokenIds(ids=[1, 512])), "vocabulary"),
    ("max_tokens 0", _req(stop=pb.StopCriteria(max_tokens=0)), "max_tokens"),
    ("max_tokens past the context", _req(stop=pb.StopCriteria(max_tokens=CONTEXT)), "max_tokens"),
    ("min_tokens over max_tokens", _req(stop=pb.StopCriteria(max_tokens=3, min_tokens=5)), "min_tokens"),
    ("temperature < 0", _req(sampling=pb.SamplingParams(temperature=-0.5)), "temperature"),
    ("temperature NaN", _req(sampling=pb.SamplingParams(temperature=float("nan"))), "temperature"),
    ("top_p 0", _req(sampling=pb.SamplingParams(top_p=0.0)), "top_p"),
    ("top_p above 1", _req(sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    ("top_k < -1", _req(sampling=pb.SamplingParams(top_k=-3)), "top_k"),
    ("min_p above 1", _req(sampling=pb.SamplingParams(min_p=2.0)), "min_p"),
    ("repetition_penalty 0", _req(sampling=pb.SamplingParams(repetition_penalty=0.0)), "repetition_penalty"),
    ("presence_penalty out of range", _req(sampling=pb.SamplingParams(presence_penalty=5.0)), "presence_penalty"),
    ("frequency_penalty out of range", _req(sampling=pb.SamplingParams(frequency_penalty=-5.0)), "frequency_penalty"),
    ("thousands of stop strings", _req(stop=pb.StopCriteria(stop=[f"s{i}" for i in range(3000)])), "at most"),
    ("empty stop string", _req(stop=pb.StopCriteria(stop=[""])), "stop"),
    ("huge stop string", _req(stop=pb.StopCriteria(stop=["x" * 10000])), "stop"),
    ("stop token outside the vocabulary", _req(stop=pb.StopCriteria(stop_token_ids=[99999])), "stop_token_ids"),
    ("too many top_logprobs", _req(output=pb.OutputOptions(top_logprobs=1000)), "top_logprobs"),
    ("a 100,000-character request_id", _req(request_id="r" * 100_000), "at most 128"),
    ("a 3 MiB request_id", _req(request_id="r" * 3 * 2**20), "at most 128"),
    ("a request_id with a newline", _req(request_id="a\nINFO llamastream.requests: request_id=b status=OK"), "'\\n'"),
    ("a request_id with an ANSI escape", _req(request_id="a\x1b[31m"), "'\\x1b'"),
    ("a request_id with a space", _req(request_id="a b"), "no spaces"),
]


@pytest.mark.parametrize("label, request_, expected", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_get_invalid_argument(client, server, label, request_, expected):
    call = client.Generate(request_, timeout=10)
    with pytest.raises(grpc.RpcError) as e:
        next(call)  # refused before the first message
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, label
    assert expected in e.value.details(), e.value.details()
    assert all_blocks_free(server)


def test_bad_requests_do_not_disturb_other_streams(client, server):
    good = pb.GenerateRequest(prompt="steady", sampling=GREEDY, stop=pb.StopCriteria(max_tokens=40, ignore_eos=True))
    _, expected = collect(client.Generate(good, timeout=30))
    results = []
    threads = [threading.Thread(target=lambda: results.append(collect(client.Generate(good, timeout=60))[1])) for _ in range(4)]
    for t in threads:
        t.start()
    for _, bad, _ in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError):
            list(client.Generate(bad, timeout=10))
    for t in threads:
        t.join(60)
    assert results == [expected] * 4
    assert wait_until(lambda: all_blocks_free(server))


def test_tokenize_rejects_bad_chat(client):
    with pytest.raises(grpc.RpcError) as e:
        client.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")])), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_too_many_stop_strings_limit_is_documented():
    assert MAX_STOP_STRINGS < 3000


def test_an_fp8_kv_cache_holds_four_times_the_tokens_and_says_so():
    servers = {dtype: local_server(device="cpu", num_kv_blocks=None, kv_cache_memory_gb=0.01, kv_cache_dtype=dtype)
               for dtype in ("auto", "fp8")}  # (the CPU backends', for now)
    try:
        blocks = {dtype: server.engine.info.num_kv_blocks for dtype, server in servers.items()}
        assert 4 * blocks["auto"] <= blocks["fp8"] < 4 * (blocks["auto"] + 1)  # (each rounded down)
        client = stub(f"127.0.0.1:{servers['fp8'].port}")
        assert client.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).kv_cache_dtype == "fp8_e4m3"
        msgs, _ = collect(client.Generate(pb.GenerateRequest(prompt="hello", stop=pb.StopCriteria(max_tokens=4,
                                                                                                 ignore_eos=True)),
                                          timeout=30))
        assert msgs[-1].finished.usage.completion_tokens == 4
    finally:
        for server in servers.values():
            server.drain()

"""No request holds up the others, against a server on a real socket: a stream keeps
receiving tokens while a long prompt is prefilled, a short request does not wait for
it, and health answers while megabytes of prompt are tokenized."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llamastream.v1 import generation_pb2 as pb
from tests.serving import local_server, stub

GREEDY = pb.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def server():
    s = local_server(num_kv_blocks=1024, max_model_len=8192, engine_process=True, max_num_batched_tokens=128)
    yield s
    s.drain()


def timed_stream(call) -> list[tuple[float, pb.GenerateResponse]]:
    return [(time.monotonic(), m) for m in call]


def first_token_time(messages) -> float:
    return next(t for t, m in messages if m.HasField("delta"))


def test_a_running_stream_gets_tokens_while_a_long_prompt_is_prefilled(server):
    client = stub(f"127.0.0.1:{server.port}")
    budget = server.engine.info.max_num_batched_tokens
    running = client.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=GREEDY,
                                                 stop=pb.StopCriteria(max_tokens=2000, ignore_eos=True)), timeout=120)
    next(running), next(running)  # started, and decoding
    received: list[float] = []  # when each of its tokens arrived

    def read() -> None:
        try:
            for m in running:
                received.extend([time.monotonic()] * len(m.delta.token_ids))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED

    reader = threading.Thread(target=read)
    reader.start()
    prefill_steps = 20
    prompt_len = prefill_steps * budget  # 20 steps of prefill at least
    long = timed_stream(client.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[9] * prompt_len), sampling=GREEDY,
                                                           stop=pb.StopCriteria(max_tokens=2)), timeout=120))
    submitted, first = long[0][0], first_token_time(long)
    running.cancel()
    reader.join(30)
    during = sum(submitted < t < first for t in received)
    # The stream decodes in each prefill step; a prefill that held it up would leave it
    # none. (A quarter of the steps: on a busy machine some of its tokens reach the
    # reader thread only after the prompt's first token: 11 of 20 once, in 0.40 s.)
    assert during >= prefill_steps // 4, \
        f"the running stream got {during} tokens in the {first - submitted:.2f} s of a long prefill"


def test_a_short_request_behind_a_long_prompt_does_not_wait_for_it(server):
    client = stub(f"127.0.0.1:{server.port}")
    budget = server.engine.info.max_num_batched_tokens
    long_call = client.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[9] * (30 * budget)), sampling=GREEDY,
                                                   stop=pb.StopCriteria(max_tokens=2)), timeout=120)
    next(long_call)  # started: it is in the engine
    results: dict[str, list] = {}
    reader = threading.Thread(target=lambda: results.update(long=timed_stream(long_call)))
    reader.start()
    short = timed_stream(client.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 5), sampling=GREEDY,
                                                            stop=pb.StopCriteria(max_tokens=2)), timeout=120))
    reader.join(120)
    assert first_token_time(short) < first_token_time(results["long"])


def test_health_answers_while_megabytes_of_prompt_are_tokenized(server):
    address = f"127.0.0.1:{server.port}"
    prompt = ("The quick brown fox jumps over the lazy dog. " * 90000)[:3_900_000]
    outcomes: list[grpc.StatusCode] = []

    def send() -> None:
        try:
            list(stub(address).Generate(pb.GenerateRequest(prompt=prompt), timeout=120))
        except grpc.RpcError as e:
            outcomes.append(e.code())

    senders = [threading.Thread(target=send) for _ in range(3)]
    for t in senders:
        t.start()
    latencies = []
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while any(t.is_alive() for t in senders):
            start = time.monotonic()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    for t in senders:
        t.join()
    assert outcomes == [grpc.StatusCode.INVALID_ARGUMENT] * 3  # a million tokens: longer than the context
    assert len(latencies) >= 10 and max(latencies) < 1.0, f"{len(latencies)} checks, the slowest {max(latencies):.2f} s"

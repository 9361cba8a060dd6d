"""Load, faults of the client and bad input, against a server in this process (so the
tests can see its KV blocks): a reader that stops reading, fuzzed requests and bytes,
and a soak of at least 500 streams from 50 clients over at least 60 seconds."""

from __future__ import annotations

import collections
import random
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server.app import Server
from tests.conftest import greedy, make_engine, run, tokens
from tests.serving import check_stream_shape, local_server

GREEDY = pb.SamplingParams(temperature=0.0)


def idle(server: Server, timeout: float = 10.0) -> bool:
    """Every KV block free, nothing in flight or queued, the engine empty."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = server.engine.stats()
        if (stats.kv_blocks_free == server.engine.info.num_kv_blocks and server.engine.num_in_flight() == 0
                and stats.live_requests == 0 and stats.running == stats.waiting == 0):
            return True
        time.sleep(0.05)
    return False


def healthy(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def server():
    s = local_server(num_kv_blocks=128, max_model_len=1024, engine_process=True)  # as `llamastream serve` runs
    yield s
    s.drain()


@pytest.fixture(scope="module")
def address(server) -> str:
    return f"127.0.0.1:{server.port}"


# -- backpressure -------------------------------------------------------------------
def test_past_the_waiting_queue_requests_are_refused_at_once():
    server = local_server(num_kv_blocks=64, max_num_seqs=1, max_waiting=1)  # room for 2 in flight
    client = pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))
    long = pb.GenerateRequest(prompt="x", sampling=GREEDY, stop=pb.StopCriteria(max_tokens=400, ignore_eos=True))
    try:
        held = [client.Generate(long, timeout=60) for _ in range(2)]
        for call in held:
            next(call)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            next(client.Generate(long, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in e.value.details()
        assert time.monotonic() - start < 2  # at once, not after a wait
        assert all(list(call)[-1].finished.usage.completion_tokens == 400 for call in held)
        assert idle(server)
    finally:
        server.drain()


# -- a reader that stops reading -------------------------------------------------
def test_a_reader_that_stops_reading_is_cut_off_and_others_go_on(tiny_model):
    server = local_server(num_kv_blocks=300, max_stream_backlog=64)
    address = f"127.0.0.1:{server.port}"
    try:
        # a small HTTP/2 window, so the server's writes block soon after the client stops reading
        slow = pb_grpc.GenerationStub(grpc.insecure_channel(
            address, options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]))
        call = slow.Generate(pb.GenerateRequest(prompt="x", sampling=GREEDY,
                                                stop=pb.StopCriteria(max_tokens=3000, ignore_eos=True)), timeout=120)
        next(call)  # Started; then the client reads nothing
        other = pb_grpc.GenerationStub(grpc.insecure_channel(address))
        msgs = list(other.Generate(pb.GenerateRequest(prompt="y", sampling=GREEDY,
                                                      stop=pb.StopCriteria(max_tokens=50, ignore_eos=True)), timeout=60))
        assert msgs[-1].finished.usage.completion_tokens == 50  # the engine never waited for the slow reader
        assert idle(server, timeout=60), "the unread stream's sequence kept running or kept its blocks"
        with pytest.raises(grpc.RpcError) as e:
            list(call)  # the client comes back: what was sent, then the status
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "read too slowly" in e.value.details()
        assert healthy(address)
    finally:
        server.drain()


# -- fuzzing -------------------------------------------------------------------
# Two kinds of requests, half each: any values in every field (mostly refused), and
# values in their valid ranges (mostly served), so both paths are fuzzed.
def _sampling(t, p, k, m, r, pr, f, seed) -> pb.SamplingParams:
    fields = dict(temperature=t, top_p=p, top_k=k, min_p=m, repetition_penalty=r, presence_penalty=pr,
                  frequency_penalty=f, seed=seed)
    return pb.SamplingParams(**{name: v for name, v in fields.items() if v is not None})


def _stop(max_tokens, min_tokens, stop, stop_ids, ignore_eos) -> pb.StopCriteria:
    return pb.StopCriteria(min_tokens=min_tokens, stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos,
                           **({} if max_tokens is None else {"max_tokens": max_tokens}))


def _output(top, skip) -> pb.OutputOptions:
    return pb.OutputOptions(skip_special_tokens=skip, **({} if top is None else {"top_logprobs": top}))


def _f(lo: float, hi: float):
    return st.one_of(st.none(), st.floats(lo, hi, width=32))


ANY_FLOAT = st.one_of(st.none(), st.floats(width=32))
ANY_INT = st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1))
ANY_UINT = st.integers(0, 2**32 - 1)
texts = st.text(max_size=40)
inputs = st.one_of(
    st.just({}),
    texts.map(lambda t: {"prompt": t}),
    st.lists(ANY_UINT | st.integers(0, 300), max_size=30).map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
    st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", "tool", "", "robot"]), texts), max_size=4).map(
        lambda ms: {"chat": pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in ms])}),
)
wild = st.tuples(
    inputs,
    st.builds(_sampling, *[ANY_FLOAT] * 2, ANY_INT, *[ANY_FLOAT] * 4, st.one_of(st.none(), st.integers(0, 2**64 - 1))),
    st.builds(_stop, st.one_of(st.none(), ANY_UINT), ANY_UINT, st.lists(texts, max_size=20),
              st.lists(ANY_UINT, max_size=5), st.booleans()),
    st.builds(_output, st.one_of(st.none(), ANY_UINT), st.booleans()),
)
valid = st.tuples(
    st.one_of(
        st.text(min_size=1, max_size=40).map(lambda t: {"prompt": t}),
        st.lists(st.integers(0, 255), min_size=1, max_size=30).map(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}),
        st.lists(st.tuples(st.sampled_from(["user", "system", "assistant"]), texts), min_size=1, max_size=3).map(
            lambda ms: {"chat": pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in ms])}),
    ),
    st.builds(_sampling, _f(0, 2), _f(0.125, 1), st.one_of(st.none(), st.just(-1), st.integers(1, 50)), _f(0, 1),
              _f(0.5, 2), _f(-2, 2), _f(-2, 2), st.one_of(st.none(), st.integers(0, 2**64 - 1))),
    st.builds(_stop, st.integers(4, 24), st.integers(0, 3), st.lists(st.text(min_size=1, max_size=4), max_size=3),
              st.lists(st.integers(0, 300), max_size=3), st.booleans()),
    st.builds(_output, st.one_of(st.none(), st.integers(0, 5)), st.booleans()),
)
requests = st.one_of(wild, valid).map(
    lambda parts: pb.GenerateRequest(sampling=parts[1], stop=parts[2], output=parts[3], **parts[0]))
EXPECTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}


def outcome(call) -> grpc.StatusCode:
    try:
        msgs = list(call)
    except grpc.RpcError as e:
        assert e.code() in EXPECTED, f"{e.code()}: {e.details()}"  # never INTERNAL, never stuck (a deadline)
        return e.code()
    check_stream_shape(msgs)
    return grpc.StatusCode.OK


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests)
def test_fuzzed_requests_end_cleanly(address, request):
    outcome(pb_grpc.GenerationStub(grpc.insecure_channel(address)).Generate(request, timeout=60))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_fuzzed_bytes_end_cleanly(address, data):
    with grpc.insecure_channel(address) as channel:
        outcome(channel.unary_stream("/llamastream.v1.Generation/Generate")(data, timeout=60))


def test_after_fuzzing_the_server_is_idle_and_healthy(server, address):
    assert idle(server) and healthy(address)


# -- the soak ---------------------------------------------------------------------
CLIENTS, MIN_STREAMS, MIN_SECONDS = 50, 500, 60.0


def rss_bytes() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024


def request_threads() -> int:
    """Threads, less the servicer's pool for tokenizing (at most PREPARE_THREADS, started as needed)."""
    return sum(not t.name.startswith("prepare") for t in threading.enumerate())


@pytest.mark.slow
def test_soak(tiny_model):
    """Mixed traffic: plain requests, client cancels, short deadlines, Abort calls and
    bad requests. Every well-formed request either completes with the tokens it gives
    alone or ends with the status its client caused; then nothing is left behind."""
    rng = random.Random(0)
    pool = [([rng.randrange(5, tiny_model.config.vocab_size) for _ in range(rng.randrange(3, 60))], rng.randrange(4, 40))
            for _ in range(16)]
    alone = []
    for ids, n in pool:
        engine = make_engine(tiny_model)
        alone.append(tokens(run(engine, [engine.make_sequence("x", ids, greedy(n))])["x"]))
    # a cache too small for everyone at once: queueing and preemption are part of the soak
    server = local_server(num_kv_blocks=64, max_num_seqs=16, max_waiting=64, max_model_len=256, engine_process=True)
    address = f"127.0.0.1:{server.port}"
    threads_before, rss_before = request_threads(), rss_bytes()
    counts: collections.Counter[str] = collections.Counter()
    wrong: list[str] = []
    lock = threading.Lock()
    start = time.monotonic()

    def client(k: int) -> None:
        r = random.Random(k)
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(address))
        done = 0
        while done < MIN_STREAMS // CLIENTS or time.monotonic() - start < MIN_SECONDS:
            kind = r.choices(["plain", "cancel", "deadline", "abort", "bad"], weights=[45, 20, 15, 10, 10])[0]
            p = r.randrange(len(pool))
            rid = f"c{k}-{done}"
            request = pb.GenerateRequest(request_id=rid, token_ids=pb.TokenIds(ids=pool[p][0]), sampling=GREEDY,
                                         stop=pb.StopCriteria(max_tokens=pool[p][1], ignore_eos=True))
            if kind == "bad":
                request.sampling.top_p = r.choice([0.0, 1.5, float("nan")])
            call = stub.Generate(request, timeout=r.uniform(0.01, 0.5) if kind == "deadline" else 120)
            got, finish, status = [], None, "OK"
            try:
                for i, msg in enumerate(call):
                    got += msg.delta.token_ids
                    if msg.HasField("finished"):
                        finish = msg.finished.reason
                    if kind == "cancel" and i == r.randrange(1, 6):
                        call.cancel()
                    if kind == "abort" and i == 1:
                        stub.Abort(pb.AbortRequest(request_ids=[rid]), timeout=10)
            except grpc.RpcError as e:
                status = e.code().name
            expected = {"bad": {"INVALID_ARGUMENT"}, "deadline": {"OK", "DEADLINE_EXCEEDED"},
                        "cancel": {"OK", "CANCELLED"}, "abort": {"OK"}, "plain": {"OK"}}[kind]
            outcome = {"OK": "completed", "CANCELLED": "cancelled", "DEADLINE_EXCEEDED": "expired"}.get(status, f"rejected {status}")
            if finish == pb.FINISH_REASON_ABORT:
                outcome = "aborted"
            with lock:
                counts[outcome] += 1
                if status not in expected or (kind != "abort" and finish == pb.FINISH_REASON_ABORT):
                    wrong.append(f"{rid} ({kind}): {status}")
                elif outcome == "completed" and got != alone[p]:
                    wrong.append(f"{rid} ({kind}): tokens differ from the request alone")
            done += 1

    workers = [threading.Thread(target=client, args=(k,)) for k in range(CLIENTS)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - start
    try:
        print(f"\nsoak: {sum(counts.values())} streams from {CLIENTS} clients in {elapsed:.0f} s: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
              + f"; {server.engine.stats().num_preemptions} preemptions")
        assert not wrong, wrong[:10]
        assert sum(counts.values()) >= MIN_STREAMS and elapsed >= MIN_SECONDS
        assert {"completed", "cancelled", "aborted", "rejected INVALID_ARGUMENT"} <= set(counts), counts
        assert idle(server), "blocks, queues or sequences were left behind"
        assert healthy(address)
        assert request_threads() <= threads_before, "a thread was left behind"
        growth = rss_bytes() - rss_before
        assert growth < 200 * 2**20, f"the process grew by {growth / 2**20:.0f} MB"
    finally:
        server.drain()

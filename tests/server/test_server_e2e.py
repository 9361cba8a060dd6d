"""The server as users meet it: a subprocess on a real socket, the embedded default model."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llamastream.v1 import generation_pb2 as pb
from tests.conftest import TINY_MODEL
from tests.serving import ROOT, ServerProcess, chat, check_stream_shape, collect, stub

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
GREEDY = pb.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "32") as s:
        yield s


def test_chat_answers_paris(server):
    msgs, text = collect(stub(server.address).Generate(chat("What is the capital of France?", sampling=GREEDY), timeout=120))
    check_stream_shape(msgs)
    assert "Paris" in text
    finished = msgs[-1].finished
    assert finished.reason == pb.FINISH_REASON_STOP and finished.usage.completion_tokens == sum(
        len(m.delta.token_ids) for m in msgs if m.HasField("delta"))
    assert msgs[0].started.prompt_tokens == finished.usage.prompt_tokens > 0


@pytest.mark.parametrize("example", [0, 1], ids=["client library", "raw stubs"])
def test_the_readmes_python_examples_answer_paris(server, example, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    exec(blocks[example].replace("localhost:50051", server.address), {})
    assert "Paris" in capsys.readouterr().out


def test_twenty_concurrent_streams_match_alone(server):
    questions = [f"Give me one fact about the number {i}." for i in range(20)]
    client = stub(server.address)

    def ask(q: str) -> str:
        request = chat(q, sampling=GREEDY, stop=pb.StopCriteria(max_tokens=24))
        msgs, text = collect(client.Generate(request, timeout=300))
        check_stream_shape(msgs)
        return text

    alone = [ask(q) for q in questions[:4]]
    with ThreadPoolExecutor(20) as pool:
        together = list(pool.map(ask, questions))
    assert together[:4] == alone
    assert all(together)


def test_health_is_serving(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "llamastream.v1.Generation"):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def grpcurl(*args: str) -> str:
    return subprocess.run([GRPCURL, *args], capture_output=True, text=True, timeout=120, check=True).stdout


def test_grpcurl_lists_services_and_streams_through_reflection(server):
    services = grpcurl("-plaintext", server.address, "list").split()
    assert {"llamastream.v1.Generation", "grpc.health.v1.Health"} <= set(services)
    # The README's command, as written (only the address differs).
    body = '{"chat":{"messages":[{"role":"user","content":"Hi"}]}}'
    out = grpcurl("-plaintext", "-d", body, server.address, "llamastream.v1.Generation/Generate")
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert "started" in messages[0] and "finished" in messages[-1]
    assert any(m.get("delta", {}).get("text") for m in messages)


def test_sigterm_drains_in_flight_streams():
    with ServerProcess("--model", str(TINY_MODEL), "--grace", "60") as s:
        client = stub(s.address)
        tokens = 3000  # long enough to be in flight through the whole drain
        request = pb.GenerateRequest(prompt="drain", sampling=GREEDY, stop=pb.StopCriteria(max_tokens=tokens, ignore_eos=True))
        streams = [client.Generate(request, timeout=120) for _ in range(10)]
        assert all(next(st).HasField("started") for st in streams)  # all ten are in flight
        results = []
        threads = [threading.Thread(target=lambda st=st: results.append(collect(st)[0])) for st in streams]
        for t in threads:
            t.start()
        s.terminate()
        with grpc.insecure_channel(s.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                time.sleep(0.01)  # (NOT_SERVING as soon as the drain begins)
        assert not results, "the streams ended before the drain began: make them longer"
        with pytest.raises(grpc.RpcError) as e:
            list(client.Generate(request, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(120)
        assert [m[-1].finished.usage.completion_tokens for m in results] == [tokens] * 10
        assert s.proc.wait(60) == 0


def test_the_engine_in_the_servers_own_process_streams_the_same():
    """`--engine-in-process` (the engine on a thread of the server's process, not in
    a process of its own) gives the same stream."""
    request = pb.GenerateRequest(prompt="Once upon a time", sampling=GREEDY, stop=pb.StopCriteria(max_tokens=40, ignore_eos=True))
    texts = []
    for where in ([], ["--engine-in-process"]):
        with ServerProcess("--model", str(TINY_MODEL), *where) as s:
            msgs, text = collect(stub(s.address).Generate(request, timeout=60))
            check_stream_shape(msgs)
            texts.append((text, msgs[-1].finished.usage.completion_tokens))
    assert texts[0] == texts[1] and texts[0][0] and texts[0][1] == 40


def test_streams_the_grace_cuts_end_with_unavailable_and_are_logged():
    with ServerProcess("--model", str(TINY_MODEL), "--grace", "1") as s:
        client = stub(s.address)
        request = pb.GenerateRequest(prompt="cut", sampling=GREEDY, stop=pb.StopCriteria(max_tokens=4000, ignore_eos=True))
        streams = [client.Generate(request, timeout=120) for _ in range(3)]
        assert all(next(st).HasField("started") for st in streams)
        outcomes = []

        def read(call) -> None:
            received = 0
            try:
                for m in call:
                    received += len(m.delta.token_ids)
            except grpc.RpcError as e:
                outcomes.append((e.code(), e.details(), received))

        threads = [threading.Thread(target=read, args=(st,)) for st in streams]
        for t in threads:
            t.start()
        time.sleep(0.1)  # (then the grace's 1 s: far less than 4,000 tokens take on any machine)
        s.terminate()
        for t in threads:
            t.join(60)
        assert s.proc.wait(60) == 0
        log = s.output()
    assert len(outcomes) == 3
    for code, details, received in outcomes:
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details == (f"the server is shutting down: the stream was cut after {received} tokens; "
                           "retry on another replica")
        assert 0 < received < 4000
    assert "the 1 s grace ran out with 3 streams in flight: they end with UNAVAILABLE" in log
    assert log.count("status=UNAVAILABLE finish_reason=-") == 3

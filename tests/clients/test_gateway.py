"""llamastream behind the Shepherd Model Gateway (smg, from PyPI), which speaks vLLM's gRPC
engine protocol to two llamastream replicas and the OpenAI API to clients: the official
`openai` client and curl, neither written here, against the embedded SmolLM2."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import jsonschema
import openai
import pytest

from devtools.servers import GatewayProcess, ServerProcess, free_port, free_ports, wait_serving
from engine.model_loader import convert_gguf, embedded_model_path
from server.gateway import REPLICA_STARTED, replica_cores
from tests.deploy.test_manifests import container, named
from tests.server.test_observability import scrape

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded GGUF as a Hugging Face directory: the gateway reads its tokenizer there."""
    return convert_gguf(embedded_model_path(), tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Two `llamastream serve` processes, each with its metrics on a port of its own."""
    servers = [replica(model_dir), replica(model_dir)]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def gateway(replicas, model_dir):
    with GatewayProcess([r.address for r in replicas], model_dir, "--policy", "round_robin") as g:
        yield g


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="not-needed", max_retries=0)


def test_models_lists_the_served_model(client, model_dir):
    assert [m.id for m in client.models.list().data] == [model_dir.name]


def test_a_streamed_chat_completion_answers_paris_and_equals_the_unstreamed_one(client, model_dir):
    stream = client.chat.completions.create(model=model_dir.name, messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in streamed
    whole = client.chat.completions.create(model=model_dir.name, messages=QUESTION, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens > 0 and whole.choices[0].finish_reason in ("stop", "length")


def test_a_completion(client, model_dir):
    out = client.completions.create(model=model_dir.name, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert "Paris" in out.choices[0].text


def test_response_format_json_schema_returns_a_valid_object(client, model_dir):
    """The OpenAI client's response_format reaches the replica as vLLM's json_schema
    constraint, and holds the answer to the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30}},
              "required": ["city", "country"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=model_dir.name, messages=QUESTION, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema, "strict": True}})
    answer = json.loads(out.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_a_streamed_completion_cut_by_length_keeps_its_last_token(client, model_dir, max_tokens):
    request = dict(model=model_dir.name, prompt="The capital of France is", max_tokens=max_tokens, temperature=0)
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].finish_reason == "length" and streamed == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == max_tokens


def test_curl_gets_well_formed_server_sent_events(gateway, model_dir):
    body = json.dumps({"model": model_dir.name, "messages": QUESTION, "max_tokens": 8, "stream": True})
    out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                          f"{gateway.url}/v1/chat/completions"], capture_output=True, text=True, timeout=60).stdout
    events = [line for line in out.splitlines() if line]
    assert events and all(line.startswith("data: ") for line in events), out
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_the_gateway_answers_the_probes_of_its_kubernetes_manifest(gateway):
    smg = container(named("Deployment", "gateway"))
    for probe in ("readinessProbe", "livenessProbe"):
        path = smg[probe]["httpGet"]["path"]
        with urllib.request.urlopen(f"{gateway.url}{path}", timeout=5) as response:
            assert response.status == 200, path


def test_requests_are_spread_over_both_replicas(client, replicas, model_dir):
    before = [ok_requests(r) for r in replicas]

    def ask(i: int) -> str:
        out = client.completions.create(model=model_dir.name, prompt=f"Count to {i}:", max_tokens=4, temperature=0)
        return out.choices[0].text
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(64)))
    assert all(answers)
    deadline = time.monotonic() + 10  # (the gateway answers on a stream's last message, before the replica counts it)
    while (served := [ok_requests(r) - b for r, b in zip(replicas, before)]) and sum(served) < 64:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(served) == 64 and min(served) >= 16, served


def test_a_killed_replica_is_routed_around_and_serves_again_once_restarted(model_dir):
    """While 50 streams run, one replica is killed: streams cut on it end with an error the
    client sees, the others and every later request succeed on the other replica; restarted
    on its port, the killed one gets requests again."""
    with replicas_behind_gateway(model_dir) as (servers, stream, streaming):
        with concurrent.futures.ThreadPoolExecutor(50) as pool:
            futures = [pool.submit(stream, i) for i in range(50)]
            assert streaming.wait(timeout=60)
            servers[0].proc.kill()
            outcomes = [f.result(timeout=120) for f in futures]
        counts = {kind: outcomes.count(kind) for kind in ("ok", "error", "cut")}
        print(f"\nkilled mid-load: {counts}")
        assert counts["ok"] >= 25 and sum(counts.values()) == 50  # (every one ended: none hangs)
        after = [stream(i) for i in range(10)]
        assert after == ["ok"] * 10  # all on the survivor
        servers[0].stop()
        servers[0] = replica(model_dir, servers[0].port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stream(0)
            if ok_requests(servers[0]) > 0:
                break
        else:
            raise AssertionError("the restarted replica got no request in 30 s")


def test_a_draining_replica_finishes_its_streams_and_no_request_fails(model_dir):
    """SIGTERM to one replica while streams run on both and more keep coming: its streams
    finish, new requests go to the other one, and every client request succeeds. (Two
    CPU replicas share this machine's cores: the grace is long enough for a slow one.)"""
    with replicas_behind_gateway(model_dir, "--grace", "120") as (servers, stream, streaming):
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            early = [pool.submit(stream, i) for i in range(12)]
            assert streaming.wait(timeout=60)
            servers[0].terminate()
            late = [pool.submit(stream, i) for i in range(12, 24)]
            outcomes = [f.result(timeout=180) for f in early + late]
        assert outcomes == ["ok"] * 24, f"{stream.errors}\n{servers[0].output()[-3000:]}"
        assert servers[0].proc.wait(timeout=60) == 0
        assert "grace ran out" not in servers[0].output()


def replica(model_dir, port: int | None = None, *args: str) -> ServerProcess:
    """A `llamastream serve` process, SERVING, with its metrics on a port of its own; on
    one thread, as two replicas sharing this machine's cores must be (the launcher pins
    each to cores of its own)."""
    metrics_port = free_port()
    server = ServerProcess("--model", str(model_dir), "--device", "cpu", "--threads", "1", "--metrics-port",
                           str(metrics_port), *args, port=port)
    server.__enter__()
    server.metrics_port = metrics_port
    return server


def ok_requests(server: ServerProcess) -> float:
    """The requests a replica has answered with OK, from its metrics."""
    return scrape(server.metrics_port).get(("llamastream:requests_total", (("status", "OK"),)), 0.0)


@contextlib.contextmanager
def replicas_behind_gateway(model_dir, *replica_args: str):
    """Two replicas (a list: a test may replace one) behind a gateway that checks their
    health every second; a streamer through it, and the event it sets once streaming."""
    servers = [replica(model_dir, None, *replica_args), replica(model_dir, None, *replica_args)]
    try:
        with GatewayProcess([s.address for s in servers], model_dir, "--policy", "round_robin",
                            "--health-check-interval-secs", "1", "--health-failure-threshold", "1") as gateway:
            streaming = threading.Event()
            yield servers, streamer(gateway, model_dir, streaming), streaming
    finally:
        for server in servers:
            server.stop()


def streamer(gateway: GatewayProcess, model_dir, streaming: threading.Event | None = None):
    """A function that streams one completion through the gateway: "ok"; "error" if the
    client saw the request fail, "cut" if its stream ended with no finish reason;
    `streaming` is set once a stream has text."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="not-needed", max_retries=0, timeout=60)

    def stream(i: int) -> str:
        text, finished = "", False
        try:
            for chunk in client.completions.create(model=model_dir.name, prompt=f"Story {i}:", max_tokens=48,
                                                   temperature=0, stream=True):
                text += "".join(c.text for c in chunk.choices)
                finished = finished or any(c.finish_reason for c in chunk.choices)
                if text and streaming is not None:
                    streaming.set()
        except openai.APIError as e:
            stream.errors.append(f"request {i}: {type(e).__name__}: {e}")
            return "error"
        return "ok" if text and finished else "cut"  # (a stream that ended without a finish reason was cut)
    stream.errors = []  # what the client saw of each error
    return stream


def test_with_a_cache_aware_policy_a_shared_system_prompt_is_mostly_found_cached(model_dir):
    """20 chats that share a long system prompt, one after another, through the gateway's
    cache-aware policy: they mostly land on the replica that holds the prompt, so most
    of their prompt tokens come from its prefix cache. The gateway knows what each
    replica caches from its KV events (SubscribeKvEvents): its index holds exactly the
    blocks each replica has cached, with no gap in the events and no block whose parent
    it did not know."""
    system = " ".join(f"Rule {i}: answer briefly and politely, in plain words." for i in range(40))
    replicas = [replica(model_dir), replica(model_dir)]
    try:
        with GatewayProcess([r.address for r in replicas], model_dir, "--policy", "cache_aware") as gateway:
            client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="not-needed", max_retries=0, timeout=60)
            prompt_tokens = 0
            for i in range(20):
                out = client.chat.completions.create(
                    model=model_dir.name, max_tokens=2, temperature=0,
                    messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Question {i}?"}])
                prompt_tokens += out.usage.prompt_tokens
            hits = [scrape(r.metrics_port).get(("llamastream:prefix_cache_hits_total", ()), 0) for r in replicas]
            cached = [scrape(r.metrics_port)[("llamastream:kv_cache_blocks_evictable", ())] for r in replicas]
            workers = [(("worker", f"grpc://{r.address}"),) for r in replicas]

            def indexed() -> list[float]:
                metrics = scrape(gateway.metrics_port)
                return [metrics.get(("smg_kv_index_blocks", w), 0) for w in workers]  # (unset before a first store)
            wait_for(lambda: indexed() == cached, 10, lambda: f"the gateway indexes {indexed()} blocks, cached: {cached}")
            metrics = scrape(gateway.metrics_port)
        print(f"\ncache-aware routing: {sum(hits):.0f} of {prompt_tokens} prompt tokens cached (by replica: {hits}); "
              f"blocks cached by replica, and in the gateway's index: {cached}")
        assert sum(hits) >= 0.8 * prompt_tokens
        for w in workers:
            assert metrics[("smg_kv_event_subscriptions_total", w)] >= 1 and sum(cached) > 0
            assert metrics[("smg_kv_event_parentless_stores_total", w)] == 0
            assert sum(v for (name, labels), v in metrics.items() if name == "smg_kv_event_gaps_total" and labels[1:] == w) == 0
    finally:
        for r in replicas:
            r.stop()


def test_llamastream_gateway_serves_a_replica_per_gpu_and_restarts_a_dead_one(model_dir, tmp_path):
    """`llamastream gateway --gpus` as a user runs it, with a fake device list (the
    replicas run on the CPU): a replica per listed GPU behind smg, each seeing only its
    GPU and labelling its metrics with it; one killed is started again on its port and
    GPU and serves; SIGTERM stops it all cleanly."""
    port, grpc_port, metrics_port = free_port(), free_ports(2), free_ports(2)  # (replica i: the port + i)
    log = (tmp_path / "gateway.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "server", "gateway", "--gpus", "0,1", "--host", "127.0.0.1",
                             "--port", str(port), "--grpc-port", str(grpc_port), "--replica-metrics-port",
                             str(metrics_port), "--gateway-metrics-port", str(free_port()), "--model", str(model_dir),
                             "--", "--device", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT, text=True)

    def logged() -> str:
        log.seek(0)
        return log.read()

    def started() -> list[tuple[int, int, int]]:
        return [(int(i), int(gpu), int(pid)) for i, _, gpu, pid in REPLICA_STARTED.findall(logged())]

    def check_replica(i: int, pid: int) -> None:
        environ = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
        assert environ["CUDA_VISIBLE_DEVICES"] == str(i)
        assert os.sched_getaffinity(pid) == replica_cores(2)[i]  # (cores of its own: half the machine's)
        assert all(("gpu", str(i)) in labels for _, labels in scrape(metrics_port + i))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="not-needed", max_retries=0, timeout=30)
        ask = functools.partial(client.chat.completions.create, model=model_dir.name, messages=QUESTION, max_tokens=12,
                                temperature=0)
        wait_for(lambda: ask(), 180, logged)
        assert "Paris" in ask().choices[0].message.content
        assert sorted((i, gpu) for i, gpu, _ in started()) == [(0, 0), (1, 1)]
        for i, _, pid in started():
            check_replica(i, pid)
        first_pid = next(pid for i, _, pid in started() if i == 0)
        os.kill(first_pid, signal.SIGKILL)
        wait_for(lambda: [i for i, _, _ in started()].count(0) == 2 or None, 60, logged)
        wait_serving(f"127.0.0.1:{grpc_port}", timeout=120)
        check_replica(0, [pid for i, _, pid in started() if i == 0][-1])
        assert all("Paris" in ask().choices[0].message.content for _ in range(6))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, logged()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("spec, replicas, environment, expected", [
    ("0,1", None, None, ["0", "1"]),
    ("3", 1, None, ["3"]),
    ("all", None, "4,6", ["4", "6"]),
    ("all", None, "", "no GPU is visible"),
    ("0,0", None, None, "listed twice"),
    ("0,x", None, None, "GPU indices separated by commas"),
    ("0,1", 3, None, "one replica per GPU"),
])
def test_gpus_name_one_replica_each(spec, replicas, environment, expected, monkeypatch):
    from server.gateway import replica_gpus

    if environment is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", environment)
    if isinstance(expected, list):
        assert replica_gpus(spec, replicas) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            replica_gpus(spec, replicas)


def test_gpus_all_without_a_driver_says_what_to_do(monkeypatch, tmp_path):
    from server.gateway import replica_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # (no nvidia-smi)
    with pytest.raises(ValueError, match=r"nvidia-smi could not list the GPUs .* give the indices"):
        replica_gpus("all", None)


def wait_for(attempt, timeout: float, logged):
    """attempt() until it returns something truthy without raising."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if attempt():
                return
        time.sleep(0.5)
    raise TimeoutError(f"not done in {timeout} s:\n{logged()}")

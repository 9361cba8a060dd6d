"""llamastream behind the Shepherd Model Gateway (smg, from PyPI), which speaks vLLM's gRPC
engine protocol to two llamastream replicas and the OpenAI API to clients: the official
`openai` client and curl, neither written here, against the embedded SmolLM2."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import subprocess

import openai
import pytest

from devtools.servers import GatewayProcess, ServerProcess, free_port
from engine.model_loader import convert_gguf, embedded_model_path
from tests.server.test_observability import scrape

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded GGUF as a Hugging Face directory: the gateway reads its tokenizer there."""
    return convert_gguf(embedded_model_path(), tmp_path_factory.mktemp("smollm2"))


@pytest.fixture(scope="module")
def replicas(model_dir):
    """Two `llamastream serve` processes, each with its metrics on a port of its own."""
    with contextlib.ExitStack() as stack:
        servers = []
        for _ in range(2):
            metrics_port = free_port()
            server = stack.enter_context(ServerProcess("--model", str(model_dir), "--device", "cpu",
                                                       "--metrics-port", str(metrics_port)))
            server.metrics_port = metrics_port
            servers.append(server)
        yield servers


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


def test_curl_gets_well_formed_server_sent_events(gateway, model_dir):
    body = json.dumps({"model": model_dir.name, "messages": QUESTION, "max_tokens": 8, "stream": True})
    out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                          f"{gateway.url}/v1/chat/completions"], capture_output=True, text=True, timeout=60).stdout
    events = [line for line in out.splitlines() if line]
    assert events and all(line.startswith("data: ") for line in events), out
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_requests_are_spread_over_both_replicas(client, replicas, model_dir):
    def ok_requests(server) -> float:
        metrics = scrape(server.metrics_port)
        return metrics.get(("llamastream:requests_total", (("status", "OK"),)), 0.0)
    before = [ok_requests(r) for r in replicas]

    def ask(i: int) -> str:
        out = client.completions.create(model=model_dir.name, prompt=f"Count to {i}:", max_tokens=4, temperature=0)
        return out.choices[0].text
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(64)))
    assert all(answers)
    served = [ok_requests(r) - b for r, b in zip(replicas, before)]
    assert sum(served) == 64 and min(served) >= 16, served

"""The clients in clients/ (Python, Node.js, Go) against a live server: each streams a
chat request to completion, reads the final usage, and gets INVALID_ARGUMENT for a bad
request. The Node.js and Go clients are built by `make test`; where their package
manager could not be reached they are skipped with the reason, except under CI."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from llamastream_client import AsyncClient, Client, Completion, TextDelta

from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from tests.serving import ROOT, free_port, local_server

TOKEN = "client-test-token"
CHAT = [("user", "Say hi")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    s = local_server(auth_token_file=str(token_file))
    yield f"127.0.0.1:{s.port}"
    s.drain()


def check_events(events: list) -> Completion:
    *deltas, completion = events
    assert deltas and all(isinstance(d, TextDelta) for d in deltas)
    assert isinstance(completion, Completion)
    assert completion.text == "".join(d.text for d in deltas)
    assert completion.usage.completion_tokens == len(completion.token_ids) == 5 and completion.finish_reason == "length"
    return completion


def test_python_client(server):
    with Client(server, token=TOKEN, timeout=30) as client:
        check_events(list(client.chat(CHAT, max_tokens=5, ignore_eos=True)))
        assert client.complete("hello", max_tokens=5, ignore_eos=True).usage.prompt_tokens == len(client.tokenize("hello"))
        assert client.info().model == "tiny-llama"
        with pytest.raises(grpc.RpcError) as e:
            list(client.chat(CHAT, temperature=-1.0))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(server, timeout=30) as no_token, pytest.raises(grpc.RpcError) as e:
        no_token.info()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_python_async_client(server):
    async def go():
        async with AsyncClient(server, token=TOKEN, timeout=30) as client:
            events = [e async for e in client.chat(CHAT, max_tokens=5, ignore_eos=True)]
            with pytest.raises(grpc.RpcError) as e:
                await client.complete("x", top_p=0.0)
            return events, e.value.code(), (await client.info()).vocab_size

    events, code, vocab = asyncio.run(go())
    check_events(events)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and vocab == 512


def test_python_client_over_mutual_tls(pki):
    s = local_server(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), tls_client_ca=str(pki["ca"]))
    try:
        # (the server's certificate names localhost)
        with Client(f"localhost:{s.port}", root_certificates=pki["ca"].read_bytes(), client_cert=pki["client_cert"].read_bytes(),
                    client_key=pki["client_key"].read_bytes(), timeout=30) as client:
            check_events(list(client.chat(CHAT, max_tokens=5, ignore_eos=True)))
    finally:
        s.drain()


class FlakyModelInfo(pb_grpc.GenerationServicer):
    """UNAVAILABLE twice, then an answer."""

    def __init__(self):
        self.calls = 0

    def GetModelInfo(self, request, context):
        self.calls += 1
        if self.calls <= 2:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb.ModelInfo(model="flaky")


def test_python_client_retries_unavailable():
    servicer, port = FlakyModelInfo(), free_port()
    flaky = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(servicer, flaky)
    flaky.add_insecure_port(f"127.0.0.1:{port}")
    flaky.start()
    try:
        with Client(f"127.0.0.1:{port}", timeout=30) as client:
            assert client.info().model == "flaky"
        assert servicer.calls == 3
        with Client(f"127.0.0.1:{port}", timeout=30, retries=0) as client:
            servicer.calls = 0
            with pytest.raises(grpc.RpcError) as e:
                client.info()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        flaky.stop(0)


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_python_cli(server):
    cli = [sys.executable, "-m", "llamastream_client.cli", "--target", server, "--token", TOKEN]
    ok = run(*cli, "chat", "Say hi", "--max-tokens", "5", "--temperature", "0")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip() and "completion tokens" in ok.stderr
    bad = run(*cli, "chat", "Say hi", "--temperature", "-1")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    info = run(*cli, "info")
    assert json.loads(info.stdout)["model"] == "tiny-llama"
    raw = run(*cli, "generate", "Once upon", "--max-tokens", "3", "--temperature", "0")
    assert raw.returncode == 0 and "[" in raw.stderr, raw.stderr
    with Client(server, token=TOKEN) as client:
        assert json.loads(run(*cli, "tokenize", "hello there").stdout) == client.tokenize("hello there")
    unauthenticated = run(sys.executable, "-m", "llamastream_client.cli", "--target", server, "info")
    assert unauthenticated.returncode == 1 and "UNAUTHENTICATED" in unauthenticated.stderr


def built(path, log: str) -> None:
    """Skip (or, under CI, fail) with the build's own words when a client was not built."""
    if path.exists():
        return
    log_path = ROOT / log
    why = log_path.read_text()[-2000:] if log_path.exists() else "the build did not run: use `make test`"
    message = f"{path.relative_to(ROOT)} was not built ({log}):\n{why}"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def check_usage_line(stderr: str) -> None:
    usage = json.loads(stderr.strip().splitlines()[-1])
    completion = usage["usage"]["completion_tokens"] if "usage" in usage else usage["completion_tokens"]
    assert 1 <= completion <= 5 and usage["reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")


def test_node_client(server):
    built(ROOT / "clients/node/node_modules/.installed", "clients/node/npm.log")
    node = shutil.which("node")
    ok = run(node, "clients/node/client.js", "--target", server, "--token", TOKEN, "--max-tokens", "5", "chat", "Say hi")
    assert ok.returncode == 0, ok.stderr
    check_usage_line(ok.stderr)
    bad = run(node, "clients/node/client.js", "--target", server, "--token", TOKEN, "--temperature", "-1", "chat", "Say hi")
    assert bad.returncode == 1 and "error: INVALID_ARGUMENT" in bad.stderr


def test_go_client(server):
    binary = ROOT / "clients/go/build/llamastream-chat"
    built(binary, "clients/go/build.log")
    ok = run(str(binary), "-target", server, "-token", TOKEN, "-max-tokens", "5", "Say hi")
    assert ok.returncode == 0, ok.stderr
    check_usage_line(ok.stderr)
    bad = run(str(binary), "-target", server, "-token", TOKEN, "-max-tokens", "100000000", "Say hi")
    assert bad.returncode == 1 and "error: InvalidArgument" in bad.stderr

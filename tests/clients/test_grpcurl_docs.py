"""Every command in docs/grpcurl.md, run against live servers (a plaintext one, and
one with mutual TLS and a bearer token), its output checked."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.serving import ROOT, local_server

DOC = ROOT / "docs" / "grpcurl.md"
COMMANDS = re.findall(r"```sh\n(.*?)```", DOC.read_text(), re.S)
TOKEN = "docs-token"


def json_stream(out: str) -> list[dict]:
    decoder, objects, i = json.JSONDecoder(), [], 0
    while (i := out.find("{", i)) >= 0:
        obj, i = decoder.raw_decode(out, i)
        objects.append(obj)
    return objects


def reply(out: str) -> str:
    return "".join(e["delta"].get("text", "") for e in json_stream(out) if "delta" in e)


def generated(out: str, ok: bool) -> bool:
    events = json_stream(out)
    return ok and "started" in events[0] and "finished" in events[-1] and all("delta" in e for e in events[1:-1])


# (what the command contains, what its output must show); the first match applies
CHECKS = [
    ("topP\": 1.5", lambda out, ok: not ok and "InvalidArgument" in out and "top_p" in out),
    ("localhost:50052 llamastream.v1.Generation/GetModelInfo", lambda out, ok: not ok and "Unauthenticated" in out),
    (" list", lambda out, ok: ok and {"llamastream.v1.Generation", "grpc.health.v1.Health"} <= set(out.split())),
    (" describe", lambda out, ok: ok and "rpc Generate ( .llamastream.v1.GenerateRequest )" in out),
    ("topLogprobs", lambda out, ok: generated(out, ok) and all(len(lp["top"]) == 3 for e in json_stream(out)
                                                                if "delta" in e for lp in e["delta"]["logprobs"])),
    ('"choices"', lambda out, ok: generated(out, ok) and reply(out) in ("yes", "no")),
    ('"regex"', lambda out, ok: generated(out, ok) and re.fullmatch("[0-9]{3}-[0-9]{4}", reply(out))),
    ("Generation/Generate", generated),
    ("Generation/Tokenize", lambda out, ok: ok and json_stream(out)[0]["token_ids"]),
    ("Generation/GetModelInfo", lambda out, ok: ok and json_stream(out)[0]["model"] == "tiny-llama"),
    ("Generation/Abort", lambda out, ok: ok and json_stream(out) == [{}]),  # 0 aborted: the field is left out
    ("Generation/FlushCache", lambda out, ok: ok and json_stream(out) == [{}]),
    ("Health/Check", lambda out, ok: ok and json_stream(out) == [{"status": "SERVING"}]),
]


@pytest.fixture(scope="module")
def servers(pki, tmp_path_factory):
    work = tmp_path_factory.mktemp("grpcurl")
    for name, source in (("ca.pem", "ca"), ("client.pem", "client_cert"), ("client.key", "client_key")):
        (work / name).write_bytes(pki[source].read_bytes())
    (work / "token.txt").write_text(TOKEN)
    plain = local_server()
    secure = local_server(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]),
                          tls_client_ca=str(pki["ca"]), auth_token_file=str(work / "token.txt"))
    yield work, plain.port, secure.port
    for s in (plain, secure):
        s.drain()


def test_the_document_has_commands_for_every_check():
    assert len(COMMANDS) >= 14
    for command in COMMANDS:
        assert any(key in command for key, _ in CHECKS), f"no check for: {command}"


@pytest.mark.parametrize("command", COMMANDS, ids=[f"command{i}" for i in range(len(COMMANDS))])
def test_command(servers, command):
    work, plain_port, secure_port = servers
    line = command.replace("localhost:50051", f"127.0.0.1:{plain_port}").replace("localhost:50052", f"localhost:{secure_port}")
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "TOKEN": TOKEN}
    done = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    check = next(check for key, check in CHECKS if key in command)
    assert check(out, done.returncode == 0), f"{command}\n{out}"

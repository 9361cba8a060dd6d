"""Settings a server cannot start with fail at once, before the model loads, with a
message that names the flag and what to do; nothing is served half-configured."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.cli import main
from tests.conftest import TINY_MODEL
from tests.serving import ROOT, ServerProcess, local_server


def serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", "serve", "--model", str(TINY_MODEL), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_a_busy_port_fails_at_start_naming_the_port():
    with ServerProcess("--model", str(TINY_MODEL)) as first:
        start = time.monotonic()
        second = serve("--host", "127.0.0.1", "--port", str(first.port))
        assert second.returncode == 1
        assert f"--port {first.port}: the port is in use" in second.stderr
        assert time.monotonic() - start < 30
        assert first.proc.poll() is None  # the first one serves on


@pytest.mark.parametrize("flag, value, expected", [
    ("--port", "99999", "must be in [0, 65535]"),
    ("--port", "-1", "must be in [0, 65535]"),
    ("--metrics-port", "70000", "must be in [0, 65535]"),
    ("--max-message-bytes", "10", "must be in [65536"),
    ("--grace", "-5", "must be in [0, 3600]"),
    ("--grace", "nan", "out of range"),
    ("--kv-cache-memory-gb", "0", "must be above 0"),
    ("--gpu-memory-utilization", "1.5", "must be in (0, 1]"),
    ("--max-num-seqs", "0", "must be at least 1"),
    ("--max-waiting", "-1", "must be at least 0"),
    ("--block-size", "x", "is not an integer"),
])
def test_out_of_range_flags_are_refused_by_the_parser(capsys, flag, value, expected):
    with pytest.raises(SystemExit) as e:
        main(["serve", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and expected in err, err


@pytest.fixture
def start_error(capsys):
    """The message `llamastream serve ...` exits 1 with (run in this process; its logging
    set-up is undone afterwards)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def run(*args: str) -> str:
        assert main(["serve", "--model", str(TINY_MODEL), "--host", "127.0.0.1", "--port", "0", *args]) == 1
        return capsys.readouterr().err.strip().splitlines()[-1]
    yield run
    root.handlers[:], root.level = handlers, level


def test_a_host_that_is_no_address_is_named(start_error):
    assert "--host 256.1.1.1 is not an address" in start_error("--host", "256.1.1.1")
    assert "--host 203.0.113.7 is not an address of this machine" in start_error("--host", "203.0.113.7")


def test_tls_files_that_are_not_pem_are_named(start_error, pki, tmp_path):
    der = tmp_path / "server.der"
    der.write_bytes(b"\x30\x82\x01\x0a" + bytes(200))
    message = start_error("--tls-cert", str(der), "--tls-key", str(pki["server_key"]))
    assert f"--tls-cert: {der} is not a PEM file holding certificate" in message
    message = start_error("--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["client_key"]))
    assert "check that the key belongs to the certificate" in message
    message = start_error("--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]),
                          "--tls-client-ca", str(pki["server_key"]))
    assert "--tls-client-ca: " in message and "is not a PEM file holding certificate" in message


def test_a_kv_cache_too_small_for_one_block_names_the_flag_and_the_smallest_value(start_error):
    message = start_error("--kv-cache-memory-gb", "0.0000001")
    assert "--kv-cache-memory-gb 1e-07 holds no KV-cache block" in message and "use at least" in message
    smallest = float(message.split("use at least ")[1].split()[0])
    server = local_server(start=False, num_kv_blocks=None, kv_cache_memory_gb=smallest)  # the value it names works
    try:
        assert server.engine.info.num_kv_blocks >= 1
    finally:
        server.drain()


def truncated(tmp_path: Path, fraction: float) -> Path:
    from engine.model_loader import embedded_model_path

    data = embedded_model_path().read_bytes()
    path = tmp_path / f"cut-{fraction}.gguf"
    path.write_bytes(data[: int(len(data) * fraction)])
    return path


@pytest.mark.parametrize("fraction", [0.5, 0.999])
def test_a_truncated_gguf_names_the_tensor_and_the_expected_size(start_error, tmp_path, fraction):
    path = truncated(tmp_path, fraction)
    message = start_error("--model", str(path))
    assert f"{path} is truncated or corrupt: tensor " in message and "needs bytes" in message


def test_a_gguf_cut_inside_its_header_is_called_truncated_or_corrupt(start_error, tmp_path):
    path = truncated(tmp_path, 0.00005)
    assert f"{path} is not a readable GGUF file, truncated or corrupt" in start_error("--model", str(path))


def test_convert_gguf_on_a_bad_file_prints_one_line(tmp_path):
    path = truncated(tmp_path, 0.5)
    done = subprocess.run([sys.executable, "-m", "server", "convert-gguf", str(path), str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "is truncated or corrupt" in done.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("llamastream ")


def test_the_start_up_line_gives_the_effective_settings(caplog):
    with caplog.at_level(logging.INFO, logger="llamastream"):
        server = local_server(max_num_seqs=8, max_model_len=100_000)
        server.drain()
    messages = [r.getMessage() for r in caplog.records]
    assert (f"serving on 127.0.0.1:{server.port}: model tiny-llama on cpu, float32 weights computed in float32 "
            "(0.7 MB), float32 KV cache, max-num-seqs 8, max-num-batched-tokens 128, 64 KV blocks of 16 tokens, "
            "context 1024, prefix caching, plaintext, no bearer token") in messages
    assert "--max-model-len 100000 is more than what the KV cache holds: the context is 1024 tokens" in messages

"""A server in a subprocess, as a user starts it, for the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from server.gateway import smg_command, wait_serving

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> int:
    """The first of `count` consecutive free ports (for replicas on consecutive ports:
    the port after a free one may be any connection's)."""
    while True:
        first = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first


class ServerProcess:
    """`python -m server serve` in a subprocess, as a user would start it (or `command`,
    given the port after it). Its output goes to a file: a pipe that nobody reads
    fills up with the request log, and the server stalls on its next line."""

    def __init__(self, *args: str, command: tuple[str, ...] = ("-m", "server", "serve", "--host", "127.0.0.1", "--port"),
                 port: int | None = None):
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, *command, str(self.port), *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def output(self) -> str:
        """What the server has printed so far."""
        self.log.seek(0)
        return self.log.read()

    def __enter__(self) -> "ServerProcess":
        try:
            wait_serving(self.address, self.proc, timeout=120)
        except RuntimeError as e:
            output = self.output()
            self.stop()
            raise RuntimeError(f"{e}:\n{output}") from None
        except Exception:
            self.stop()
            raise
        return self

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()

    def __exit__(self, *exc) -> None:
        self.stop()


class GatewayProcess:
    """The Shepherd Model Gateway (`smg launch`, the smg package) on a free port in front
    of `workers` (gRPC addresses), reading the tokenizer from `model_path`; ready once it
    answers a completion through them."""

    def __init__(self, workers: list[str], model_path: Path, *args: str):
        self.port, self.model = free_port(), Path(model_path).name  # (smg names the model after its folder)
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [smg_command(), "launch", "--host", "127.0.0.1", "--port", str(self.port), "--model-path", str(model_path),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
             "--worker-urls", *[f"grpc://{w}" for w in workers], *args],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, text=True)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def __enter__(self) -> "GatewayProcess":
        import json
        import urllib.request

        body = json.dumps({"model": self.model, "prompt": "Hi", "max_tokens": 1}).encode()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"smg exited with {self.proc.returncode}:\n{self.output()}")
            request = urllib.request.Request(f"{self.url}/v1/completions", body, {"Content-Type": "application/json"})
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(request, timeout=10) as response:
                    if response.status == 200:
                        return self
            time.sleep(0.3)
        output = self.output()
        self.stop()
        raise TimeoutError(f"smg did not serve in 60 s:\n{output}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __exit__(self, *exc) -> None:
        self.stop()

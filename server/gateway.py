"""`llamastream gateway`: N replicas of `llamastream serve` on consecutive ports of this
machine and the Shepherd Model Gateway (`smg launch`, the `gateway` extra) in front of
them, serving the OpenAI API. With --gpus, one replica per GPU, each seeing only its
own (its KV cache sized from that GPU's memory). A replica that exits is started again
on its port (and GPU), and the gateway's health checks take it back; SIGTERM drains
every replica, then stops the gateway."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("llamastream.gateway")
START_TIMEOUT_S = 600  # a replica loading its model
POLL_S = 0.5


# The log line of a replica's start, as Replica.start writes it: (index, port, GPU or
# None, pid). Benchmarks and tests that kill replicas find their processes by it.
REPLICA_STARTED = re.compile(r"replica (\d+) started on port (\d+)(?:, GPU (\d+))?(?:, cores [\d,]+)? \(pid (\d+)\)")


@dataclass
class Replica:
    index: int
    port: int
    args: list[str]
    gpu: str | None = None  # the one GPU it sees, or all of the machine's
    cores: set[int] | None = None  # the CPU cores it runs on, or all of the launcher's
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": self.gpu} if self.gpu is not None else {}))
        pin = None if self.cores is None else functools.partial(os.sched_setaffinity, 0, self.cores)
        self.proc = subprocess.Popen([sys.executable, "-m", "server", "serve", "--port", str(self.port), *self.args],
                                     env=env, preexec_fn=pin)
        log.info("replica %d started on port %d%s%s (pid %d)", self.index, self.port,
                 "" if self.gpu is None else f", GPU {self.gpu}",
                 "" if self.cores is None else f", cores {','.join(map(str, sorted(self.cores)))}", self.proc.pid)


def replica_cores(replicas: int) -> list[set[int]] | None:
    """The cores this process may use, shared out evenly among the replicas: a replica's
    CPU backend runs a thread per core it has, and replicas whose threads shared cores
    would each wait on the others' at every kernel. None (all share) where there are
    fewer cores than replicas or the platform cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    each = len(cores) // replicas
    return [set(cores[i * each : (i + 1) * each]) for i in range(replicas)] if each else None


def replica_gpus(spec: str | None, replicas: int | None) -> list[str] | None:
    """The GPUs of --gpus, one replica each: `all` (those CUDA_VISIBLE_DEVICES lists,
    else every GPU nvidia-smi lists) or indices (0,1,...); None without --gpus."""
    if spec is None:
        return None
    if spec == "all":
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = listed.split(",") if listed is not None else _nvidia_smi_gpus()
    else:
        gpus = spec.split(",")
        if not all(g.strip().isdigit() for g in gpus):
            raise ValueError(f"--gpus {spec}: give all, or GPU indices separated by commas (0,1)")
    gpus = [g.strip() for g in gpus if g.strip()]
    if not gpus:
        raise ValueError("--gpus all: no GPU is visible (CUDA_VISIBLE_DEVICES is empty)")
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {spec}: a GPU is listed twice (one replica per GPU)")
    if replicas is not None and replicas != len(gpus):
        raise ValueError(f"--replicas {replicas} with --gpus {spec} ({len(gpus)} GPUs): one replica per GPU, "
                         "leave --replicas out")
    return gpus


def _nvidia_smi_gpus() -> list[str]:
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"--gpus all: nvidia-smi could not list the GPUs ({e}): is the NVIDIA driver installed? "
                         "Or give the indices (--gpus 0,1)") from e
    return listed.split()


def wait_serving(address: str, proc: subprocess.Popen | None = None, timeout: float = START_TIMEOUT_S) -> None:
    """Until gRPC health at `address` says SERVING; raises if `proc` (the server's, if
    given) exits first."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the replica at {address} exited with {proc.returncode} while starting: see its log")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(POLL_S)
    raise TimeoutError(f"the replica at {address} did not become SERVING in {timeout:.0f} s")


def model_directory(model: str | None) -> Path:
    """A Hugging Face directory of `model` (the gateway reads its tokenizer there): the
    directory itself, or a GGUF file (the embedded model by default) converted once into
    ~/.cache/llamastream/models/."""
    if model is not None and Path(model).is_dir():
        return Path(model)
    from engine.model_loader import convert_gguf, embedded_model_path

    gguf = Path(model) if model is not None else embedded_model_path()
    out = Path.home() / ".cache" / "llamastream" / "models" / gguf.stem.split(".")[0]
    if not (out / "config.json").exists():
        log.info("converting %s to %s for the gateway", gguf, out)
        convert_gguf(gguf, out)
    return out


def smg_command() -> str:
    """The gateway's command, beside this Python's or on the PATH."""
    beside = Path(sys.executable).with_name("smg")
    found = str(beside) if beside.exists() else shutil.which("smg")
    if found is None:
        raise FileNotFoundError("the Shepherd Model Gateway (smg) is not installed: pip install 'llamastream[gateway]'")
    return found


class ReplicaSet:
    def __init__(self, replicas: int, grpc_port: int, host: str, port: int, model_dir: Path, serve_args: list[str],
                 policy: str, metrics_port: int, gpus: list[str] | None = None, replica_metrics_port: int | None = None):
        self.replicas = []
        cores = replica_cores(replicas) if replicas > 1 else None
        for i in range(replicas):
            gpu = gpus[i] if gpus else None
            own = (["--metrics-port", str(replica_metrics_port + i)] if replica_metrics_port is not None else []) \
                + (["--metrics-label", f"gpu={gpu}"] if gpu is not None else [])
            self.replicas.append(Replica(i, grpc_port + i, ["--host", "127.0.0.1", "--model", str(model_dir), *own,
                                                            *serve_args], gpu, cores[i] if cores else None))
        self.gateway_args = ["launch", "--host", host, "--port", str(port), "--model-path", str(model_dir),
                             "--policy", policy, "--prometheus-host", host, "--prometheus-port", str(metrics_port),
                             "--health-check-interval-secs", "2", "--health-failure-threshold", "1",
                             "--worker-urls", *[f"grpc://127.0.0.1:{r.port}" for r in self.replicas]]
        self._stop = threading.Event()

    def run(self) -> int:
        """Start everything, keep the replicas up until SIGTERM or SIGINT, then drain; the exit code."""
        smg = smg_command()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        try:
            for replica in self.replicas:
                replica.start()
            for replica in self.replicas:
                wait_serving(f"127.0.0.1:{replica.port}", replica.proc)
            gateway = subprocess.Popen([smg, *self.gateway_args])
            log.info("gateway started (pid %d): %s", gateway.pid, " ".join(self.gateway_args))
            code = self._watch(gateway)
        finally:
            self._drain()
        return code

    def _watch(self, gateway: subprocess.Popen) -> int:
        while not self._stop.wait(POLL_S):
            if gateway.poll() is not None:
                log.error("the gateway exited with %d", gateway.returncode)
                return 1
            for replica in self.replicas:
                if replica.proc.poll() is not None:
                    log.warning("replica %d exited with %d: starting it again", replica.index, replica.proc.returncode)
                    replica.start()
        gateway.terminate()
        gateway.wait(timeout=30)
        return 0

    def _drain(self) -> None:
        """SIGTERM to every replica (each drains its streams, as `llamastream serve` does), then wait."""
        running = [r.proc for r in self.replicas if r.proc is not None and r.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()

"""Build and run the server: start the engine, serve, drain.

The engine (model, backend, KV cache) is built and stepped in a process of its own
(EngineProcess), or with --engine-in-process on a thread of this one. Here, the
asyncio loop's thread runs every RPC, however many streams; the caller's thread
starts, waits for a signal and drains.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tqdm import tqdm

from engine.backends import create_backend
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import load_model
from engine.sampling_params import SamplingParams
from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server.engine_client import EngineClient, EngineProcess, InProcessEngine
from server.log_format import logging_settings
from server.interceptors import OPEN_SERVICES, BearerTokenAuth, RejectMalformed
from server.observability import Observer
from server.servicer import GenerationServicer
from server.streams import OutputHub

log = logging.getLogger("llamastream.server")
SWITCH_INTERVAL_S = 0.0001  # see start(); measured with bench/server_overhead.py --host-ms 1 --gil-releases 6
ENGINE_CHECK_S = 1.0  # how often the streams' hub checks that the engine still runs
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class ServerConfig:
    model: str | None = None
    host: str = "0.0.0.0"
    port: int = 50051
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0  # numpy backend
    gpu_memory_utilization: float = 0.9  # cuda backend
    enforce_eager: bool = False  # cuda backend: no CUDA graphs
    batch_invariant: bool = False  # cuda backend: a token's result independent of its batch
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    engine_process: bool = True  # False: the engine on a thread of the server's process
    max_waiting: int = 256
    grace: float = 30.0
    max_stream_backlog: int = 4096  # tokens a stream may fall behind before it is ended
    max_message_bytes: int = 4 * 2**20
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: client certificates must chain to it
    auth_token_file: str | None = None
    auth_health_and_reflection: bool = False  # the token is needed for those too
    log_prompts: bool = False
    metrics_port: int | None = None  # Prometheus /metrics over HTTP (0: any free port)


def _read(path: str, flag: str) -> bytes:
    try:
        return open(path, "rb").read()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from e


def _server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS from --tls-cert/--tls-key, mutual when --tls-client-ca is given; None: plaintext."""
    if not (cfg.tls_cert or cfg.tls_key or cfg.tls_client_ca):
        return None
    if not (cfg.tls_cert and cfg.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key (PEM files)")
    pair = (_read(cfg.tls_key, "--tls-key"), _read(cfg.tls_cert, "--tls-cert"))
    client_ca = _read(cfg.tls_client_ca, "--tls-client-ca") if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def _read_token(path: str) -> str:
    token = _read(path, "--auth-token-file").decode().strip()
    if not token:
        raise ValueError(f"--auth-token-file: {path} is empty: put the bearer token in it")
    return token


class LoadingProgress:
    """A progress bar while weights load or a GGUF converts, where stderr is a terminal
    and the logs are text; elsewhere a record when done (a bar's lines are no records)."""

    def __init__(self, what: str = "loading weights") -> None:
        self.what = what
        self.bar: tqdm | None = None
        self.as_bar = logging_settings()[1] == "text" and sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.as_bar:
            if done == total:
                log.info("%s: %d of %d done", self.what, done, total)
            return
        if self.bar is None:
            self.bar = tqdm(total=total, desc=self.what, unit="tensor", file=sys.stderr, leave=True)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.bar.close()


def build_engine(cfg: ServerConfig) -> LLMEngine:
    """The model on its backend with a KV cache as large as the settings allow (run
    where the engine will run: in its process, or in the server's)."""
    model = load_model(cfg.model, LoadingProgress())
    backend = create_backend(cfg.device, model.config, model.weights, cuda_graphs=not cfg.enforce_eager,
                             batch_invariant=cfg.batch_invariant)
    if cfg.num_kv_blocks:
        num_blocks = cfg.num_kv_blocks
    elif backend.name == "cuda":
        num_blocks = backend.blocks_for_memory_fraction(cfg.gpu_memory_utilization, cfg.block_size)
    else:
        num_blocks = int(cfg.kv_cache_memory_gb * 2**30 // backend.kv_cache_bytes_per_block(cfg.block_size))
    engine = LLMEngine(model, backend, EngineConfig(
        block_size=cfg.block_size,
        num_kv_blocks=num_blocks,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
    ))
    log.info("model %s on %s: %d KV blocks of %d tokens (%d tokens), context %d",
             model.name, backend.name, num_blocks, cfg.block_size, num_blocks * cfg.block_size, engine.info.max_model_len)
    return engine


class Server:
    def __init__(self, cfg: ServerConfig, build: Callable[[ServerConfig], LLMEngine] = build_engine):
        """`build` makes the engine from the settings: a module-level function (or a
        partial of one), so that it can be sent to the engine's process."""
        self.cfg = cfg
        # (settings that can be wrong are read before the model, which takes a while)
        self._credentials = _server_credentials(cfg)
        self._interceptors = [RejectMalformed()]
        if cfg.auth_token_file:
            self._interceptors.insert(0, BearerTokenAuth(_read_token(cfg.auth_token_file),
                                                         () if cfg.auth_health_and_reflection else OPEN_SERVICES))
        make_engine = functools.partial(build, cfg)
        self.engine: EngineClient = (EngineProcess(make_engine, self._on_fatal) if cfg.engine_process
                                     else InProcessEngine(make_engine(), self._on_fatal))
        info = self.engine.info
        self._engine_watch = None  # started with the engine
        self.exit_code = 0
        self._stop = threading.Event()
        self.aio = asyncio.new_event_loop()
        self._aio_thread = threading.Thread(target=self.aio.run_forever, name="grpc", daemon=True)
        self._aio_thread.start()
        self.observer = Observer(self.engine.stats, info.num_kv_blocks)
        self.servicer = GenerationServicer(self.engine, OutputHub(self.aio, cfg.max_stream_backlog), self.observer,
                                           cfg.max_num_seqs + cfg.max_waiting, log_prompts=cfg.log_prompts)
        self.health = health.aio.HealthServicer()
        self.port = self._on_aio(self._listen())
        if cfg.metrics_port is not None:
            self.metrics_port = self.observer.serve_metrics(cfg.host, cfg.metrics_port)
            log.info("Prometheus metrics on http://%s:%d/metrics", cfg.host, self.metrics_port)

    def _on_aio(self, coroutine):
        """Run a coroutine on the server's loop from another thread; wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.aio).result()

    async def _listen(self) -> int:
        limits = [("grpc.max_receive_message_length", self.cfg.max_message_bytes),
                  ("grpc.max_send_message_length", self.cfg.max_message_bytes)]
        self.grpc_server = grpc.aio.server(interceptors=self._interceptors, options=limits)
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.grpc_server,
        )
        address = f"{self.cfg.host}:{self.cfg.port}"
        if self._credentials is None:
            port = self.grpc_server.add_insecure_port(address)
        else:
            port = self.grpc_server.add_secure_port(address, self._credentials)
        if port == 0:
            raise OSError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: is the port in use?")
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        return port

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    def start(self) -> None:
        # A thread that drops the GIL (the engine's at every wait for the GPU and every
        # short ctypes or PyCUDA call, or the one that reads its process's outputs) must
        # get it back from the RPC loop at once, not after Python's default 5 ms.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.engine.start()
        self._engine_watch = asyncio.run_coroutine_threadsafe(self.servicer.hub.watch(self.engine, ENGINE_CHECK_S), self.aio)
        self._on_aio(self.grpc_server.start())
        self._warm_up()
        self.servicer.accepting.set()
        self._on_aio(self._set_health(health_pb2.HealthCheckResponse.SERVING))
        security = ("mutual TLS" if self.cfg.tls_client_ca else "TLS") if self.cfg.tls_cert else "plaintext"
        log.info("serving llamastream.v1.Generation on %s:%d (%s%s)", self.cfg.host, self.port, security,
                 ", bearer token" if self.cfg.auth_token_file else "")

    def _warm_up(self) -> None:
        """One short generation through the whole engine before health says SERVING."""
        info = self.engine.info
        prompt = info.tokenizer.encode("Hello", add_special_tokens=True) or [0]
        seq = info.make_sequence("warm-up", prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        outputs = self.engine.submit(seq)
        while not outputs.get(timeout=600).finished:
            pass

    def drain(self) -> None:
        """Refuse new calls (UNAVAILABLE, health NOT_SERVING), let in-flight streams
        finish within the grace period, then stop.

        grpc's own stop() would answer new calls CANCELLED, so it comes last.
        """
        log.info("draining: up to %.0f s for %d in-flight requests", self.cfg.grace, self.engine.num_in_flight())
        self.servicer.accepting.clear()
        self._on_aio(self.health.enter_graceful_shutdown())
        deadline = time.monotonic() + self.cfg.grace
        while self.engine.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._on_aio(self.grpc_server.stop(grace=1.0))  # time to send the streams' last messages
        if self._engine_watch is not None:
            self._engine_watch.cancel()
        self.engine.stop()
        self.observer.close()
        self.aio.call_soon_threadsafe(self.aio.stop)
        self._aio_thread.join(timeout=10)
        log.info("stopped")

    def _on_fatal(self, error: str) -> None:
        """The engine stopped on a device error: stop serving, exit non-zero for a supervisor to restart us."""
        log.critical("%s: the server stops", error)
        self._on_aio(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self.exit_code = 1
        self._stop.set()

    def run_until_signal(self) -> int:
        """Serve until SIGTERM or SIGINT (then drain) or a fatal engine error; return the exit code."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        self.start()
        self._stop.wait()
        self.drain()
        return self.exit_code

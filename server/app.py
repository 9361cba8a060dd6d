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
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from tqdm import tqdm

from engine.backends import DEFAULT_TOKEN_BUDGETS, create_backend
from engine.engine_loop import GIL_SWITCH_INTERVAL_S
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import load_model
from engine.structured import DEFAULT_MAX_GRAMMAR_BYTES
from engine.sampling_params import SamplingParams
from engine.scheduler import DEFAULT_OUTPUT_RESERVE
from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server.engine_client import EngineClient, EngineProcess, InProcessEngine
from server.interceptors import OPEN_SERVICES, BearerTokenAuth, RejectMalformed
from server.kv_events import KvEventPublisher
from server.log_format import logging_settings
from server.observability import Observer
from server.preflight import SettingsError, check_listen_address, read_token, server_credentials
from server.requests import Requests
from server.servicer import GenerationServicer
from server.vllm_servicer import SERVICE_NAME as VLLM_SERVICE_NAME
from server.vllm_servicer import VllmEngineServicer
from server.streams import OutputHub

log = logging.getLogger("llamastream.server")
CUT_WAIT_S = 5.0  # for the streams cut at the end of a drain to be told
ENGINE_CHECK_S = 1.0  # how often the streams' hub checks that the engine still runs
MIN_MESSAGE_BYTES = 64 * 2**10  # a response with 20 top logprobs a token, and prompts of thousands of tokens
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class ServerConfig:
    model: str | None = None
    host: str = "0.0.0.0"
    port: int = 50051
    device: str = "auto"
    threads: int | None = None  # CPU backend: default, the cores the process may use
    cpu_activations: str = "int16"  # CPU backend: what its integer products quantize activations to
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0  # CPU backends
    kv_cache_dtype: str = "auto"  # the backend's own, or fp8 (e4m3)
    gpu_memory_utilization: float = 0.9  # cuda backend
    enforce_eager: bool = False  # cuda backend: no CUDA graphs
    batch_invariant: bool = False  # cuda backend: a token's result independent of its batch
    prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes already computed
    output_reserve: float = DEFAULT_OUTPUT_RESERVE  # admission's room for outputs to come (engine/scheduler.py)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # default: the backend's (DEFAULT_TOKEN_BUDGETS)
    max_model_len: int | None = None
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES  # the largest structured-output constraint a request may send
    quantization: str | None = None  # quantize a bfloat16 checkpoint's layers at load (fp8)
    quantize_lm_head: bool = False  # and its head (the tied embedding)
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
    vllm_metric_names: bool = False  # also the gauges gateways read, under vLLM's names
    metrics_labels: list[tuple[str, str]] = field(default_factory=list)  # (name, value) every metric carries


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


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
    model = load_model(cfg.model, LoadingProgress(), cfg.quantization, cfg.quantize_lm_head)
    backend = create_backend(cfg.device, model.config, model.model_weights(), cuda_graphs=not cfg.enforce_eager,
                             batch_invariant=cfg.batch_invariant, kv_cache_dtype=cfg.kv_cache_dtype,
                             threads=cfg.threads, cpu_activations=cfg.cpu_activations)
    engine = LLMEngine(model, backend, EngineConfig(
        block_size=cfg.block_size,
        num_kv_blocks=cfg.num_kv_blocks or _kv_cache_blocks(cfg, backend),
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens or max(DEFAULT_TOKEN_BUDGETS[backend.name], cfg.max_num_seqs),
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=cfg.prefix_caching,
        output_reserve=cfg.output_reserve,
        record_kv_events=cfg.prefix_caching,  # (for VllmEngine's SubscribeKvEvents)
        max_grammar_bytes=cfg.max_grammar_bytes,
    ))
    return engine


def _kv_cache_blocks(cfg: ServerConfig, backend) -> int:
    """The KV-cache blocks the memory settings hold (at least one, or SettingsError)."""
    per_block = backend.kv_cache_bytes_per_block(cfg.block_size)
    if backend.name == "cuda":
        blocks = backend.blocks_for_memory_fraction(cfg.gpu_memory_utilization, cfg.block_size)
        if blocks < 1:
            raise SettingsError(f"--gpu-memory-utilization {cfg.gpu_memory_utilization} leaves no memory for the KV "
                                "cache once the weights and activations have theirs: raise it (the default is 0.9)")
        return blocks
    blocks = int(cfg.kv_cache_memory_gb * 2**30 // per_block)
    if blocks < 1:
        smallest = math.ceil(per_block / 2**30 * 1e4) / 1e4
        raise SettingsError(f"--kv-cache-memory-gb {cfg.kv_cache_memory_gb} holds no KV-cache block: one block of "
                            f"{cfg.block_size} tokens takes {per_block / 2**20:.2f} MiB, so use at least {smallest} "
                            f"(the default, {ServerConfig.kv_cache_memory_gb}, holds "
                            f"{int(ServerConfig.kv_cache_memory_gb * 2**30 // per_block) * cfg.block_size} tokens)")
    return blocks


class Server:
    def __init__(self, cfg: ServerConfig, build: Callable[[ServerConfig], LLMEngine] = build_engine):
        """`build` makes the engine from the settings: a module-level function (or a
        partial of one), so that it can be sent to the engine's process."""
        self.cfg = cfg
        # Settings that can be wrong are checked, and the metrics port taken, before the
        # model loads, which takes a while.
        self._credentials = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
        self._interceptors = [RejectMalformed()]
        if cfg.auth_token_file:
            self._interceptors.insert(0, BearerTokenAuth(read_token(cfg.auth_token_file),
                                                         () if cfg.auth_health_and_reflection else OPEN_SERVICES))
        check_listen_address(cfg.host, cfg.port, "--port")
        self.engine: EngineClient | None = None
        self.requests: Requests | None = None
        self.exit_code = 0  # 1 once the engine has failed
        self.observer = Observer(cfg.vllm_metric_names, dict(cfg.metrics_labels))
        if cfg.metrics_port is not None:
            self.metrics_port = self.observer.serve_http(
                cfg.host, cfg.metrics_port, live=lambda: self.exit_code == 0,
                ready=lambda: self.requests is not None and self.requests.accepting.is_set() and self.engine.alive)
        try:
            make_engine = functools.partial(build, cfg)
            self.engine = (EngineProcess(make_engine, self._on_fatal) if cfg.engine_process
                           else InProcessEngine(make_engine(), self._on_fatal))
        except BaseException:
            self.observer.close()
            raise
        info = self.engine.info
        self.observer.watch_engine(self.engine.stats, info.num_kv_blocks)
        self._engine_watch = None  # started with the engine
        self._stop = threading.Event()
        self.aio = asyncio.new_event_loop()
        self._aio_thread = threading.Thread(target=self.aio.run_forever, name="grpc", daemon=True)
        self._aio_thread.start()
        self.requests = Requests(self.engine, OutputHub(self.aio, cfg.max_stream_backlog), self.observer,
                                 cfg.max_num_seqs + cfg.max_waiting, log_prompts=cfg.log_prompts)
        self.kv_events = KvEventPublisher(self.aio, info.block_size)
        self.engine.on_kv_events = self.kv_events.publish
        self.health = health.aio.HealthServicer()
        self.port = self._on_aio(self._listen())

    def _on_aio(self, coroutine):
        """Run a coroutine on the server's loop from another thread; wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.aio).result()

    async def _listen(self) -> int:
        options = [("grpc.max_receive_message_length", self.cfg.max_message_bytes),
                   ("grpc.max_send_message_length", self.cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # (with it, a second server on the port would quietly share it)
        self.grpc_server = grpc.aio.server(interceptors=self._interceptors, options=options)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self.requests), self.grpc_server)
        vpb_grpc.add_VllmEngineServicer_to_server(
            VllmEngineServicer(self.requests, self.kv_events, self.cfg.model or "(embedded)"), self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, VLLM_SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            self.grpc_server,
        )
        address = f"{self.cfg.host}:{self.cfg.port}"
        try:
            if self._credentials is None:
                port = self.grpc_server.add_insecure_port(address)
            else:
                port = self.grpc_server.add_secure_port(address, self._credentials)
        except RuntimeError as e:  # (taken while the model loaded: check_listen_address passed)
            raise SettingsError(f"--port {self.cfg.port}: cannot listen on {address} (in use?): choose another --port") from e
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        return port

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME, VLLM_SERVICE_NAME):
            await self.health.set(name, status)

    def start(self) -> None:
        # A thread that drops the GIL (the engine's at every wait for the GPU and every
        # short ctypes or PyCUDA call, or the one that reads its process's outputs) must
        # get it back from the RPC loop at once, not after Python's default 5 ms.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.engine.start()
        self._engine_watch = asyncio.run_coroutine_threadsafe(self.requests.hub.watch(self.engine, ENGINE_CHECK_S), self.aio)
        self._on_aio(self.grpc_server.start())
        self._warm_up()
        self.requests.accepting.set()
        self._on_aio(self._set_health(health_pb2.HealthCheckResponse.SERVING))
        log.info("serving on %s:%d: %s", self.cfg.host, self.port, self._settings_summary())

    def _settings_summary(self) -> str:
        """The effective settings, for the start-up line."""
        cfg, info = self.cfg, self.engine.info
        security = ("mutual TLS" if cfg.tls_client_ca else "TLS") if cfg.tls_cert else "plaintext"
        parts = [
            f"model {info.model_name} on {info.backend_name}",
            f"{info.weight_format} weights computed in {info.weight_dtype} ({_size(info.weight_bytes)})",
            f"{info.kv_cache_dtype} KV cache",
            f"max-num-seqs {info.max_num_seqs}",
            f"max-num-batched-tokens {info.max_num_batched_tokens}",
            f"{info.num_kv_blocks} KV blocks of {info.block_size} tokens",
            f"context {info.max_model_len}",
            "prefix caching" if info.prefix_caching else "no prefix caching",
            security,
            "bearer token" if cfg.auth_token_file else "no bearer token",
        ]
        if cfg.metrics_port is not None:
            parts.append(f"metrics on http://{cfg.host}:{self.metrics_port}/metrics")
        return ", ".join(parts)

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
        finish within the grace period, end those that did not (UNAVAILABLE, through
        the engine, so each gets its status and log line), then stop.

        grpc's own stop() would answer new calls CANCELLED, so it comes last.
        """
        log.info("draining: up to %.0f s for %d in-flight requests", self.cfg.grace, self.engine.num_in_flight())
        self.requests.draining.set()
        self.requests.accepting.clear()
        self._on_aio(self.health.enter_graceful_shutdown())
        if not self._wait_until_idle(self.cfg.grace):
            cut = self.requests.cut_all()
            log.warning("the %.0f s grace ran out with %d streams in flight: they end with UNAVAILABLE", self.cfg.grace, cut)
            self._wait_until_idle(CUT_WAIT_S)
        self._on_aio(self.grpc_server.stop(grace=1.0))  # time to send the streams' last messages
        self.requests.close()
        if self._engine_watch is not None:
            self._engine_watch.cancel()
        self.engine.stop()
        self.observer.close()
        self.aio.call_soon_threadsafe(self.aio.stop)
        self._aio_thread.join(timeout=10)
        log.info("stopped")

    def _wait_until_idle(self, seconds: float) -> bool:
        """Wait up to `seconds` for no request to be in flight; whether none is."""
        deadline = time.monotonic() + seconds
        while self.engine.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.engine.num_in_flight()

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

"""What an operator sees: Prometheus metrics (names in the style of vLLM's), HTTP
liveness and readiness for load balancers that do not speak gRPC health, and one
structured log line per finished request."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.llm_engine import EngineStats
from engine.output import Usage
from server.preflight import SettingsError

log = logging.getLogger("llamastream.requests")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


@dataclass
class RequestRecord:
    """What one Generate call came to; filled in as it goes, so that a call cut short
    (cancelled, expired, refused mid-stream) still counts what it was sent."""

    request_id: str
    status: str = "OK"  # the gRPC status code's name
    finish_reason: str = ""
    prompt_tokens: int = 0  # once started
    completion_tokens: int = 0  # sent so far
    usage: Usage | None = None  # once finished
    ended: bool = False  # its last message (or status) is decided


class _EngineCollector:
    """Engine state, read at scrape time: running and waiting sequences, KV blocks,
    preemptions (nothing until the engine is there). With `vllm_names`, the gauges that
    gateways read (the Gateway API Inference Extension's model-server protocol) are
    also given under vLLM's names."""

    VLLM_NAMES = {"llamastream:num_requests_running": "vllm:num_requests_running",
                  "llamastream:num_requests_waiting": "vllm:num_requests_waiting",
                  "llamastream:kv_cache_usage_perc": "vllm:kv_cache_usage_perc"}

    def __init__(self, vllm_names: bool) -> None:
        self.stats: Callable[[], EngineStats] | None = None
        self.num_blocks = 0
        self.vllm_names = vllm_names

    def collect(self):
        if self.stats is None:
            return
        stats = self.stats()
        gauges = [
            ("llamastream:num_requests_running", "Sequences in the running batch.", stats.running),
            ("llamastream:num_requests_waiting", "Sequences waiting to be scheduled.", stats.waiting),
            ("llamastream:kv_cache_blocks_used", "KV-cache blocks held by sequences.", self.num_blocks - stats.kv_blocks_free),
            ("llamastream:kv_cache_blocks_free", "KV-cache blocks free.", stats.kv_blocks_free),
            ("llamastream:kv_cache_usage_perc", "Fraction of the KV cache's blocks held by sequences (1 = all).",
             (self.num_blocks - stats.kv_blocks_free) / max(1, self.num_blocks)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
            if self.vllm_names and name in self.VLLM_NAMES:
                yield GaugeMetricFamily(self.VLLM_NAMES[name], doc, value=value)
        yield GaugeMetricFamily("llamastream:kv_cache_blocks_evictable",
                                "KV-cache blocks that hold a cached prefix and no sequence (counted as free).",
                                value=stats.kv_blocks_evictable)
        yield CounterMetricFamily("llamastream:num_preemptions", "Sequences preempted to free KV blocks.",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("llamastream:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("llamastream:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=stats.prefix_cache_hits)


class _Endpoints(BaseHTTPRequestHandler):
    """Answers GET for each path of `routes` with what its function returns: (status, body, content type)."""

    routes: dict[str, Callable[[], tuple[int, bytes, str]]] = {}

    def do_GET(self) -> None:
        route = self.routes.get(urlsplit(self.path).path)
        status, body, content_type = route() if route else (
            404, f"no such path: try {', '.join(self.routes)}\n".encode(), "text/plain; charset=utf-8")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # (scrapes and probes are not news)
        pass


class _Labelled:
    """A registry's metrics with constant labels added to every sample (a replica's GPU)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels

    def collect(self):
        for metric in self.registry.collect():
            metric.samples = [s._replace(labels={**self.labels, **s.labels}) for s in metric.samples]
            yield metric


class Observer:
    def __init__(self, vllm_names: bool = False, labels: dict[str, str] | None = None) -> None:
        self._http: ThreadingHTTPServer | None = None
        self.labels = labels or {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("llamastream:requests", "Generate calls by final gRPC status.", ["status"], registry=r)
        self.prompt_tokens = Counter("llamastream:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("llamastream:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("llamastream:time_to_first_token_seconds", "Time to the first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llamastream:time_per_output_token_seconds", "Time per output token after the first.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("llamastream:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._engine = _EngineCollector(vllm_names)
        r.register(self._engine)

    def watch_engine(self, stats: Callable[[], EngineStats], num_blocks: int) -> None:
        """Report the engine's state from now on."""
        self._engine.num_blocks, self._engine.stats = num_blocks, stats

    def serve_http(self, host: str, port: int, live: Callable[[], bool], ready: Callable[[], bool]) -> int:
        """Serve GET /metrics (Prometheus), /healthz (200 while the engine runs) and
        /readyz (200 while health is SERVING) on a thread; returns the port (useful with 0)."""
        text = "text/plain; charset=utf-8"
        routes = {
            "/metrics": lambda: (200, generate_latest(_Labelled(self.registry, self.labels)), CONTENT_TYPE_LATEST),
            "/healthz": lambda: (200, b"ok\n", text) if live() else (503, b"the engine has stopped\n", text),
            "/readyz": lambda: (200, b"ok\n", text) if ready() else (503, b"not serving: loading or draining\n", text),
        }
        handler = type("Endpoints", (_Endpoints,), {"routes": routes})
        try:
            self._http = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise SettingsError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror}): choose another "
                                "--metrics-port") from e
        self._http.daemon_threads = True
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()
        return self._http.server_address[1]

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def finished(self, record: RequestRecord) -> None:
        self.requests.labels(status=record.status).inc()
        self.prompt_tokens.inc(record.prompt_tokens)
        self.generation_tokens.inc(record.completion_tokens)
        usage = record.usage
        if usage is not None:
            if usage.completion_tokens:
                self.ttft.observe(usage.time_to_first_token_ms / 1e3)
                self.e2e.observe(usage.total_ms / 1e3)
            if usage.completion_tokens > 1:
                self.tpot.observe((usage.total_ms - usage.time_to_first_token_ms) / 1e3 / (usage.completion_tokens - 1))
        fields = {"request_id": record.request_id, "status": record.status, "finish_reason": record.finish_reason or "-"}
        if record.prompt_tokens:
            fields.update(prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens)
        if usage is not None:
            fields.update(ttft_ms=f"{usage.time_to_first_token_ms:.1f}", total_ms=f"{usage.total_ms:.1f}")
        log.info("", extra={"fields": fields})

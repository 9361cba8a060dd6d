"""What an operator sees: Prometheus metrics (names in the style of vLLM's) and one
structured log line per finished request."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.llm_engine import EngineStats
from engine.output import Usage

log = logging.getLogger("llamastream.requests")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)


@dataclass
class RequestRecord:
    """What one Generate call came to; filled in as it goes."""

    request_id: str
    status: str = "OK"  # the gRPC status code's name
    finish_reason: str = ""
    usage: Usage | None = None


class _EngineCollector:
    """Engine state, read at scrape time: running and waiting sequences, KV blocks, preemptions."""

    def __init__(self, stats: Callable[[], EngineStats], num_blocks: int):
        self.stats, self.num_blocks = stats, num_blocks

    def collect(self):
        stats = self.stats()
        gauges = [
            ("llamastream:num_requests_running", "Sequences in the running batch.", stats.running),
            ("llamastream:num_requests_waiting", "Sequences waiting to be scheduled.", stats.waiting),
            ("llamastream:kv_cache_blocks_used", "KV-cache blocks held by sequences.", self.num_blocks - stats.kv_blocks_free),
            ("llamastream:kv_cache_blocks_free", "KV-cache blocks free.", stats.kv_blocks_free),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("llamastream:num_preemptions", "Sequences preempted to free KV blocks.",
                                  value=stats.num_preemptions)


class Observer:
    def __init__(self, stats: Callable[[], EngineStats], num_blocks: int):
        self._http = None
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
        r.register(_EngineCollector(stats, num_blocks))

    def serve_metrics(self, host: str, port: int) -> int:
        """Expose /metrics over HTTP; returns the port (useful with 0)."""
        try:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port} ({e.strerror}): choose another --metrics-port") from e
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None

    def finished(self, record: RequestRecord) -> None:
        self.requests.labels(status=record.status).inc()
        usage = record.usage
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.generation_tokens.inc(usage.completion_tokens)
            if usage.completion_tokens:
                self.ttft.observe(usage.time_to_first_token_ms / 1e3)
                self.e2e.observe(usage.total_ms / 1e3)
            if usage.completion_tokens > 1:
                self.tpot.observe((usage.total_ms - usage.time_to_first_token_ms) / 1e3 / (usage.completion_tokens - 1))
        fields = {"request_id": record.request_id, "status": record.status, "finish_reason": record.finish_reason or "-"}
        if usage is not None:
            fields.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                          ttft_ms=f"{usage.time_to_first_token_ms:.1f}", total_ms=f"{usage.total_ms:.1f}")
        log.info("", extra={"fields": fields})

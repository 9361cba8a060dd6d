"""The Prometheus endpoint agrees with what was sent, and every finished request logs
one structured line."""

from __future__ import annotations

import logging
import re
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llamastream.v1 import generation_pb2 as pb
from server.log_format import format_fields
from server.preflight import SettingsError
from tests.serving import collect, local_server, stub


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.parametrize("engine_process", [False, True])
def test_metrics_and_request_log_agree_with_what_was_sent(caplog, engine_process):
    server = local_server(start=False, metrics_port=0, engine_process=engine_process)
    with caplog.at_level(logging.INFO, logger="llamastream.requests"):
        server.start()
        try:
            client = stub(f"127.0.0.1:{server.port}")
            sent = [(5, 3), (2, 7)]  # (prompt tokens, max_tokens)
            for i, (n_prompt, n_out) in enumerate(sent):
                request = pb.GenerateRequest(request_id=f"ok{i}", token_ids=pb.TokenIds(ids=list(range(10, 10 + n_prompt))),
                                             stop=pb.StopCriteria(max_tokens=n_out, ignore_eos=True))
                collect(client.Generate(request, timeout=10))
            with pytest.raises(grpc.RpcError):
                collect(client.Generate(pb.GenerateRequest(request_id="bad", prompt="x",
                                                           sampling=pb.SamplingParams(top_p=5.0)), timeout=10))
            # (grpc sends a refusal's status before the handler has counted it)
            deadline = time.monotonic() + 10
            while len([r for r in caplog.records if r.name == "llamastream.requests"]) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            m = scrape(server.metrics_port)
        finally:
            server.drain()
    assert m[("llamastream:requests_total", (("status", "OK"),))] == 2
    assert m[("llamastream:requests_total", (("status", "INVALID_ARGUMENT"),))] == 1
    assert m[("llamastream:prompt_tokens_total", ())] == sum(p for p, _ in sent)
    assert m[("llamastream:generation_tokens_total", ())] == sum(n for _, n in sent)
    assert m[("llamastream:time_to_first_token_seconds_count", ())] == 2
    assert m[("llamastream:time_per_output_token_seconds_count", ())] == 2
    assert m[("llamastream:e2e_request_latency_seconds_count", ())] == 2
    assert m[("llamastream:num_requests_running", ())] == m[("llamastream:num_requests_waiting", ())] == 0
    assert m[("llamastream:kv_cache_blocks_used", ())] == 0 and m[("llamastream:kv_cache_blocks_free", ())] == 64
    assert m[("llamastream:num_preemptions_total", ())] == 0
    lines = [format_fields(r.fields) for r in caplog.records if r.name == "llamastream.requests"]
    assert len(lines) == 3
    assert re.fullmatch(r"request_id=ok0 status=OK finish_reason=length prompt_tokens=5 completion_tokens=3 "
                        r"ttft_ms=[\d.]+ total_ms=[\d.]+", lines[0])
    assert lines[2] == "request_id=bad status=INVALID_ARGUMENT finish_reason=-"


def never_built(cfg):
    raise AssertionError("the engine was built before the settings were checked")


def test_a_taken_metrics_port_is_a_clear_error_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SettingsError, match=f"--metrics-port {taken.getsockname()[1]}: .*choose another --metrics-port"):
            local_server(start=False, build=never_built, metrics_port=taken.getsockname()[1])


def test_the_http_port_serves_metrics_liveness_and_readiness():
    server = local_server(start=False, metrics_port=0)
    base = f"http://127.0.0.1:{server.metrics_port}"

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(base + path, timeout=5) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    try:
        before = get("/healthz")[0], get("/readyz")[0]  # loaded, not warmed up: live, not ready
        server.start()
        serving = get("/healthz"), get("/readyz"), get("/metrics"), get("/")[0], get("/anything/else")[0]
        server.requests.accepting.clear()  # (as the drain does first)
        draining = get("/healthz")[0], get("/readyz")[0]
    finally:
        server.drain()
    assert before == (200, 503)
    assert serving[:2] == ((200, "ok\n"), (200, "ok\n"))
    assert serving[2][0] == 200 and "llamastream:num_requests_running" in serving[2][1]
    assert serving[3:] == (404, 404)
    assert draining == (200, 503)


def test_cancelled_and_expired_streams_are_logged_and_counted_as_such(caplog):
    server = local_server(start=False, metrics_port=0, engine_process=True, num_kv_blocks=256)
    with caplog.at_level(logging.INFO, logger="llamastream.requests"):
        server.start()
        try:
            client = stub(f"127.0.0.1:{server.port}")
            long = pb.GenerateRequest(request_id="cancelled", prompt="x", sampling=pb.SamplingParams(temperature=0.0),
                                      stop=pb.StopCriteria(max_tokens=4000, ignore_eos=True))
            call = client.Generate(long, timeout=60)
            received = 0
            for message in call:
                received += len(message.delta.token_ids)
                if received >= 5:
                    call.cancel()
                    break
            long.request_id = "expired"
            with pytest.raises(grpc.RpcError) as e:
                collect(client.Generate(long, timeout=0.1))  # (4,000 tokens take longer on any machine)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deadline = time.monotonic() + 10
            while len([r for r in caplog.records if r.name == "llamastream.requests"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            m = scrape(server.metrics_port)
        finally:
            server.drain()
    records = {r.fields["request_id"]: r.fields for r in caplog.records if r.name == "llamastream.requests"}
    assert records["cancelled"]["status"] == "CANCELLED" and records["expired"]["status"] == "DEADLINE_EXCEEDED"
    assert records["cancelled"]["completion_tokens"] >= received  # (more may have been sent, not yet read)
    assert m[("llamastream:requests_total", (("status", "CANCELLED"),))] == 1
    assert m[("llamastream:requests_total", (("status", "DEADLINE_EXCEEDED"),))] == 1
    # (a request that expires before its prompt is tokenized logs no token counts)
    assert m[("llamastream:generation_tokens_total", ())] == sum(r.get("completion_tokens", 0) for r in records.values()) > 5
    assert m[("llamastream:prompt_tokens_total", ())] == sum(r.get("prompt_tokens", 0) for r in records.values()) > 0


def test_the_gauges_gateways_read_are_also_under_vllm_names():
    server = local_server(metrics_port=0, vllm_metric_names=True)
    try:
        client = stub(f"127.0.0.1:{server.port}")
        call = client.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=0.0),
                                                  stop=pb.StopCriteria(max_tokens=900, ignore_eos=True)), timeout=60)
        next(call), next(call)  # (started, and a first token: it runs)
        m = scrape(server.metrics_port)
        call.cancel()
    finally:
        server.drain()
    assert m[("vllm:num_requests_running", ())] == m[("llamastream:num_requests_running", ())] == 1
    assert m[("vllm:num_requests_waiting", ())] == 0
    usage = m[("llamastream:kv_cache_blocks_used", ())] / 64
    assert m[("vllm:kv_cache_usage_perc", ())] == m[("llamastream:kv_cache_usage_perc", ())] == usage > 0


def test_metrics_labels_are_on_every_sample():
    """--metrics-label (what `gateway --gpus` gives each replica: gpu=ITS_GPU)."""
    server = local_server(metrics_port=0, metrics_labels=[("gpu", "3"), ("zone", "a")])
    try:
        collect(stub(f"127.0.0.1:{server.port}").Generate(pb.GenerateRequest(prompt="x", stop=pb.StopCriteria(
            max_tokens=2)), timeout=30))
        m = scrape(server.metrics_port)
    finally:
        server.drain()
    assert len(m) > 20 and all(("gpu", "3") in labels and ("zone", "a") in labels for _, labels in m)
    assert m[("llamastream:requests_total", (("gpu", "3"), ("status", "OK"), ("zone", "a")))] == 1

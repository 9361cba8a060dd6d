"""The benchmark scripts run and report what they claim (functional checks, not timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import TINY_MODEL
from tests.serving import ROOT


def test_serve_benchmark_reports_every_request(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run(
        [sys.executable, "bench/serve.py", "--model", str(TINY_MODEL), "--device", "cpu", "--num-prompts", "6",
         "--input-len", "4:20", "--output-len", "3:9", "--max-concurrency", "1,3", "--result-json", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=300,
    )
    result = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert 6 * 3 <= run["output_tokens"] <= 6 * 9
        assert run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"]
        assert run["floor_output_tokens_per_s"] is None  # (the floors are the H200's: GPU runs only)


def test_decode_floors_at_the_llama_1b_shape():
    """bench/floors.py's decode step at the Llama 3.2 1B shape: 2.47 GB of weights (the
    tied head read again), 32 KB of K/V a token; batch 1 bound by the weights' bytes."""
    from bench.floors import BANDWIDTH, decode_costs, decode_floor_tokens_per_s
    from devtools.checkpoints import LLAMA_32_1B
    from engine.models import architecture_for_hf

    hf = {**LLAMA_32_1B, "model_type": "llama"}
    config = architecture_for_hf(hf).config_from_hf(hf)
    weight_bytes, kv_bytes, flops = decode_costs(config)
    assert round(weight_bytes / 1e9, 2) == 2.47 and kv_bytes == 32 * 1024 and flops == weight_bytes
    assert decode_floor_tokens_per_s(config, 1, 0) == pytest.approx(BANDWIDTH / weight_bytes)
    assert decode_floor_tokens_per_s(config, 256, 843) < 256 * BANDWIDTH / weight_bytes  # (the K/V's bytes count)


def test_serve_benchmark_goes_through_the_gateway_too(tmp_path):
    out = tmp_path / "serve.json"
    subprocess.run(
        [sys.executable, "bench/serve.py", "--device", "cpu", "--num-prompts", "4", "--input-len", "4:20",
         "--output-len", "3:9", "--max-concurrency", "2", "--gateway", "--result-json", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=300,
    )
    runs = json.loads(out.read_text())["runs"]
    assert [r["path"] for r in runs] == ["gRPC", "gateway"]
    for run in runs:
        assert run["completed"] == 4 and run["failed"] == 0
        assert 4 * 3 <= run["output_tokens"] <= 4 * 9
    assert runs[0]["output_tokens"] == runs[1]["output_tokens"]  # the same requests, whichever the path


def test_paged_vs_contiguous_runs_both_schemes():
    out = subprocess.run(
        [sys.executable, "bench/paged_vs_contiguous.py", "--device", "cpu", "--model", str(TINY_MODEL), "--requests", "24",
         "--input-len", "10:60", "--output-len", "5:30", "--max-model-len", "128", "--kv-cache-gb", "0.0003",
         "--output-reserve", "0,1"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]] for line in out.splitlines() if "|" in line}
    paged, contiguous = rows["paged, 16-token blocks, reserve 0"], rows["contiguous, one 128-token slab"]
    reserving = rows["paged, 16-token blocks, reserve 1"]
    assert paged[0] == contiguous[0] == reserving[0]  # the same memory holds as many full-length sequences
    assert float(paged[1]) > float(contiguous[1])  # but paging runs more of them at once
    assert int(reserving[3]) == 0  # (preemptions) and, keeping room for the outputs, never recomputes one


def test_server_overhead_compares_in_process_with_grpc():
    out = subprocess.run(
        [sys.executable, "bench/server_overhead.py", "--requests", "8", "--max-concurrency", "4", "--step-ms", "0.5"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in out.splitlines() if "|" in line}
    assert float(rows["in process"][0]) > 0 and float(rows["gRPC"][0]) > 0


def test_profile_server_profiles_both_threads_under_load():
    out = subprocess.run(
        [sys.executable, "bench/profile_server.py", "--num-prompts", "6", "--max-concurrency", "3",
         "--model", str(TINY_MODEL), "--device", "cpu"],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    load = next(line for line in out.splitlines() if line.strip().startswith("gRPC |"))
    assert [c.strip() for c in load.split("|")[1:4]] == ["3", "6", "0"]  # all six completed, none failed
    engine, loop = out.split("=== engine thread ===")[1].split("=== RPC loop thread ===")
    assert "numpy_backend.py" in engine and "servicer.py" not in engine  # each thread's own work
    assert "servicer.py" in loop and "numpy_backend.py" not in loop


def test_replicas_benchmark_scales_out_and_survives_a_killed_replica(tmp_path):
    """bench/replicas.py with a fake list of two GPUs (the replicas on the CPU): one
    replica and two behind the gateway, every request served on both paths; then one of
    two killed mid-load, the others served, and it is back and answering."""
    out = tmp_path / "replicas.json"
    printed = subprocess.run(
        [sys.executable, "bench/replicas.py", "--gpus", "0,1", "--device", "cpu", "--num-prompts", "24",
         "--input-len", "8:32", "--output-len", "16:32", "--max-concurrency", "4", "--kill-after", "1",
         "--result-json", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True, timeout=600,
    ).stdout
    result = json.loads(out.read_text())
    for replicas in ("1", "2"):
        for path in ("gateway", "gRPC"):
            assert result[replicas][path]["completed"] == 24 and result[replicas][path]["failed"] == 0
    killed = result["kill"]
    assert killed["completed"] + killed["failed"] == 24 and killed["completed"] >= 12
    assert killed["restarted_answer"]["output_tokens"] == 8 and not killed["restarted_answer"]["error"]
    assert "gateway: 2 replicas" in printed and "gRPC: 2 replicas" in printed


def test_replicas_benchmark_runs_one_replica_then_the_largest_placement():
    """One replica per GPU of --gpus, or --replicas sharing the GPU(s): the launcher's
    flags for the one-replica run and for the largest."""
    from argparse import Namespace

    from bench.replicas import placements

    assert placements(Namespace(replicas=None, gpus="0, 1,2")) == {1: ["--gpus", "0"], 3: ["--gpus", "0,1,2"]}
    assert placements(Namespace(replicas=None, gpus="3")) == {1: ["--gpus", "3"]}
    assert placements(Namespace(replicas=2, gpus="0,1")) == {1: ["--replicas", "1"], 2: ["--replicas", "2"]}


def test_host_step_splits_a_steps_host_time_into_its_phases():
    out = subprocess.run([sys.executable, "bench/host_step.py", "--batch", "1,8", "--steps", "20"],
                         cwd=ROOT, check=True, capture_output=True, text=True, timeout=300).stdout
    rows = {int(line.split("|")[0]): [float(c) for c in line.split("|")[1:]] for line in out.splitlines()
            if "|" in line and line.split("|")[0].strip().isdigit()}
    assert set(rows) == {1, 8}
    for host_ms, *phases in rows.values():
        assert host_ms > 0 and all(p > 0 for p in phases)
        assert sum(phases) < 1.2 * host_ms  # (shares of the step: they never add up to more)

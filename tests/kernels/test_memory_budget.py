"""--gpu-memory-utilization is a share of the GPU per process (as vLLM's is per
instance): replicas that share a GPU each get their fraction, whichever starts first."""

from __future__ import annotations

import importlib

from devtools.recording_pycuda import recording_pycuda

GB = 2**30


def budget(fraction: float, total: int, free: int, ours: int) -> float:
    with recording_pycuda():
        return importlib.import_module("engine.backends.cuda.backend").kv_cache_budget(fraction, total, free, ours)


def reserve() -> int:
    with recording_pycuda():
        return importlib.import_module("engine.backends.cuda.backend").ACTIVATION_RESERVE_BYTES


def test_a_process_alone_takes_its_fraction_less_what_it_holds():
    assert budget(0.9, 140 * GB, 137 * GB, 3 * GB) == 0.9 * 140 * GB - 3 * GB - reserve()


def test_two_replicas_sharing_a_gpu_each_take_their_fraction():
    first = budget(0.45, 140 * GB, 137 * GB, 3 * GB)  # alone so far: 3 GB of weights loaded
    taken = 3 * GB + first + reserve()  # its weights, KV cache and activations
    second = budget(0.45, 140 * GB, 140 * GB - taken - 3 * GB, 3 * GB)
    assert first == second > 50 * GB


def test_no_more_than_is_free():
    """Another process holds most of the GPU: the budget is what is left."""
    assert budget(0.9, 140 * GB, 20 * GB, 3 * GB) == 20 * GB - reserve()

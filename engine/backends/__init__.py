"""Compute backends, each a `Backend` (base.py): `numpy` is the float32 reference
that runs anywhere; `cpu` runs our compiled CPU kernels on the weights as stored;
`cuda` runs on NVIDIA GPUs."""

from __future__ import annotations

import logging

from engine.backends.base import Backend
from engine.config import ModelConfig
from engine.weights import ModelWeights

DEVICES = ("auto", "cpu", "numpy", "cuda")
log = logging.getLogger("llamastream.engine")
# Tokens one step may compute, by default. A step's time grows with its tokens, and
# every running stream waits a step for its next token. On the GPU 2,048 prompt tokens
# take a few milliseconds. On two CPU cores both CPU backends compute about 300 prompt
# tokens a second of the embedded model whatever the chunk (the cpu backend's attention
# at 1,024 tokens of context included): 128 keeps a step near 0.4 s, where 2,048 held
# every stream up for about 7 s.
DEFAULT_TOKEN_BUDGETS = {"cuda": 2048, "cpu": 128, "numpy": 128}


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None if it can."""
    try:
        import pycuda.driver as cuda
    except ImportError:
        return "pycuda is not installed (pip install '.[cuda]')"
    try:
        cuda.init()
        if cuda.Device.count() == 0:
            return "no CUDA device is visible"
    except cuda.Error as e:
        return f"the CUDA driver failed to start: {e}"
    try:
        import engine.backends.cuda.backend  # noqa: F401
    except ImportError as e:
        return f"the CUDA backend failed to import: {e}"
    return None


def create_backend(device: str, config: ModelConfig, weights: ModelWeights, cuda_graphs: bool = True,
                   batch_invariant: bool = False, kv_cache_dtype: str = "auto", threads: int | None = None,
                   cpu_activations: str = "int16") -> Backend:
    """The backend for --device auto|cpu|numpy|cuda. auto takes cuda when it can run,
    else cpu, else (no C compiler) numpy, saying why. The CPU backends are
    batch-invariant whatever `batch_invariant` says; `threads` and `cpu_activations` (what
    its integer products quantize activations to) are the CPU backend's."""
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}, not {device!r}")
    if device in ("auto", "cuda"):
        reason = cuda_unavailable_reason()
        if reason is None:
            from engine.backends.cuda.backend import CudaBackend

            log.info("device %s: using the CUDA backend", device)
            return CudaBackend(config, weights, cuda_graphs=cuda_graphs, batch_invariant=batch_invariant,
                               kv_cache_dtype=kv_cache_dtype)
        if device == "cuda":
            raise RuntimeError(f"--device cuda, but {reason}; use --device cpu or auto")
        from engine.backends.cpu.kernels import CompilerMissing

        try:
            return _cpu_backend(config, weights, threads, kv_cache_dtype, cpu_activations, f"device auto: {reason}, so")
        except CompilerMissing as e:
            log.warning("device auto: using the numpy backend (%s; and %s)", reason, e)
    if device == "cpu":
        return _cpu_backend(config, weights, threads, kv_cache_dtype, cpu_activations, "device cpu:")
    from engine.backends.numpy_backend import NumpyBackend

    log.info("device %s: using the numpy backend (float32, the reference)", device)
    return NumpyBackend(config, weights, kv_cache_dtype)


def _cpu_backend(config: ModelConfig, weights: ModelWeights, threads: int | None, kv_cache_dtype: str,
                 activations: str, why: str) -> Backend:
    from engine.backends.cpu.backend import CpuBackend, available_cores

    threads = threads or available_cores()
    backend = CpuBackend(config, weights, threads=threads, kv_cache_dtype=kv_cache_dtype, activations=activations)
    log.info("%s using the CPU backend on %d threads (integer products with %s activations%s)", why, threads,
             activations, ", of many rows on the AMX tile unit" if backend.kernels.amx else "")
    return backend

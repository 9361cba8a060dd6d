"""GPU tests: collected everywhere, run only where the CUDA backend can (`make gpu-test`);
elsewhere each module skips itself with the reason (require_gpu)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends import cuda_unavailable_reason
from engine.sampler import log_softmax
from engine.weights import bf16_bits_to_f32, f32_to_bf16_bits

REASON = cuda_unavailable_reason()


def require_gpu() -> None:
    """Skip the calling test module, with the reason, where the CUDA backend cannot run."""
    if REASON:
        pytest.skip(f"needs an NVIDIA GPU and pycuda (make gpu-test): {REASON}", allow_module_level=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def cuda_context():
    import pycuda.driver as cuda

    cuda.init()
    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    yield ctx
    cuda.Context.pop()


def log_probs(logits: np.ndarray) -> np.ndarray:
    """Log-softmax in float64 (the comparisons' log-probability errors are ~1e-3)."""
    return log_softmax(np.asarray(logits, np.float64))


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert np.isfinite(got).all(), "non-finite output: an element was not written"
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 values (float32)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


BF16_NAN = np.uint16(0x7FC0)

"""Fused projections (Q/K/V, gate/up) of FP8 and INT4 weights stay in their format, and
dequantize to what their parts dequantize to, stacked: the CUDA and CPU backends'
products read them so."""

from __future__ import annotations

import numpy as np
import pytest

from devtools.quantized import quantize_fp8_blocks, quantize_int4
from engine.quantization.fp8 import Fp8Weight, f32_to_e4m3
from engine.quantization.int4 import Int4Weight
from engine.weights import Tensor

RNG = np.random.default_rng(0)


def per_tensor(w: np.ndarray) -> Fp8Weight:
    scale = np.float32(np.abs(w).max() / 448)
    return Fp8Weight(f32_to_e4m3(w / scale), np.full((1, 1), scale, np.float32))


@pytest.mark.parametrize("quantize", [Fp8Weight.quantize, per_tensor, quantize_fp8_blocks],
                         ids=["per-row", "per-tensor", "blocks"])
def test_fused_fp8_is_fp8_and_dequantizes_as_its_parts(quantize):
    parts = [quantize(RNG.standard_normal((rows, 256)).astype(np.float32)) for rows in (256, 128, 100)]
    fused = Tensor.stack(parts)
    assert isinstance(fused, Fp8Weight) and fused.shape == (484, 256)
    assert np.array_equal(fused.float32(), np.concatenate([p.float32() for p in parts]))


def test_fused_int4_is_int4_and_dequantizes_as_its_parts():
    parts = [quantize_int4(RNG.standard_normal((rows, 256)).astype(np.float32), 64) for rows in (256, 128, 100)]
    fused = Tensor.stack(parts)
    assert isinstance(fused, Int4Weight) and fused.shape == (484, 256)
    assert np.array_equal(fused.float32(), np.concatenate([p.float32() for p in parts]))


def test_int4_parts_grouped_differently_are_fused_dequantized():
    """(act-order checkpoints give each projection its own column order of groups)"""
    a, b = (quantize_int4(RNG.standard_normal((64, 256)).astype(np.float32), 64) for _ in range(2))
    b = Int4Weight(b.codes, b.scale, b.zero, RNG.permutation(b.group))
    fused = Tensor.stack([a, b])
    assert not isinstance(fused, Int4Weight)
    assert np.array_equal(fused.float32(), np.concatenate([a.float32(), b.float32()]))


def test_block_scales_that_do_not_fill_their_rows_are_fused_dequantized():
    parts = [quantize_fp8_blocks(RNG.standard_normal((rows, 256)).astype(np.float32)) for rows in (100, 128)]
    fused = Tensor.stack(parts)
    assert not isinstance(fused, Fp8Weight)
    assert np.array_equal(fused.float32(), np.concatenate([p.float32() for p in parts]))


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fast_fp8_quantizer_rounds_as_ours_but_for_ties(block):
    """devtools' fp8_fast (the GPU runs' quantizer) has our scales, and our codes except
    where a value lies halfway between two (ties to even, not down)."""
    from devtools.quantized import fp8_fast

    w = RNG.standard_normal((300, 520)).astype(np.float32)
    fast, ours = fp8_fast(w, block), (quantize_fp8_blocks(w, block) if block else Fp8Weight.quantize(w))
    assert np.array_equal(fast.scale, ours.scale)
    differ = fast.codes != ours.codes
    assert differ.mean() < 1e-3
    assert np.allclose(np.abs(fast.float32() - w)[differ], np.abs(ours.float32() - w)[differ], rtol=1e-6)

"""Quantized weights on the GPU against the numpy backend's dequantized computation.

Kernels: the FP8 GEMV (per-row, per-tensor and 128 x 128 block scales) and the INT4
one (groups of 128 and of 32 columns, a zero point each) against numpy's x @ w.T of the
dequantized weight at the bfloat16 kernels' tolerance (relative L2 under 1e-2: the
activations and outputs are bfloat16); their fused variants bit for bit against the
GEMV followed by the kernels they replace, as the bfloat16 ones are tested; the
dequantizing kernels exactly; the FP8 skinny GEMM for every split; a Linear over GEMM
tiles (cuBLAS on the dequantized weight, in chunks of rows where the scratch buffer is
smaller than the weight); the two ends of W8A8 products (activations quantized a row at a
time, sums scaled by row and column) bit for bit against numpy, and a Linear of W8A8
tiles against numpy's product of the quantized activations.

The whole model at the Llama 3.2 1B shape (random weights from a fixed seed), with its
layers in FP8 (per-row or block scales, the head too or not), over 40 prompts of 1 to
2,047 tokens against its exact (float32, dequantized) model: last-position logits, first
tokens and log-probabilities as close as transformers' bfloat16 of the same weights is,
and as our bfloat16 path is to its own exact model in the same run; the change the
format makes to the bfloat16 model's logits is printed (run with -s) and recorded in
bench/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest

from tests.gpu.conftest import require_gpu  # noqa: E402

require_gpu()

import pycuda.gpuarray as gpuarray  # noqa: E402

from devtools.quantized import fp8_fast, quantize_int4  # noqa: E402
from engine.backends.cuda.linear import LinearWeight  # noqa: E402
from engine.backends.cuda.weights import fp8_linear, int4_linear  # noqa: E402
from engine.quantization.base import QuantizedWeight  # noqa: E402
from engine.quantization.fp8 import Fp8Weight  # noqa: E402
from engine.weights import bf16_bits_to_f32  # noqa: E402
from tests.gpu.conftest import bf16, log_probs, rel_l2  # noqa: E402
from engine.backends.cuda.kernels import SumScales, skinny_splits  # noqa: E402
from tests.gpu.test_kernels import (BLOCK_SHIFT, TOL, assert_skinny_gemm_is_exact_and_row_invariant, cache_shape,  # noqa: E402
                                    cos_sin_table, i32, kernels_for, llama3_inv_freq, poisoned_bf16, separate_add,
                                    separate_rmsnorm, up_bf16)

RNG = np.random.default_rng()


def per_tensor(w: np.ndarray) -> Fp8Weight:
    """One scale for the tensor (compressed-tensors' tensor strategy), rounded as fp8_fast rounds."""
    import ml_dtypes

    scale = np.float32(np.abs(w).max() / 448)
    return Fp8Weight((w / scale).astype(ml_dtypes.float8_e4m3fn).view(np.uint8), np.full((1, 1), scale, np.float32))


# (devtools' fast quantizer: ours takes a minute over the head's shape)
SCALES = {"per-row": fp8_fast, "per-tensor": per_tensor, "blocks": lambda w: fp8_fast(w, (128, 128))}


INT4_GROUPS = {"int4 g128": 128, "int4 g32": 32}
QUANTIZERS = {**SCALES, **{name: functools.partial(quantize_int4, group=g) for name, g in INT4_GROUPS.items()}}


def quantized_weight(d_out: int, d_in: int, kind: str, spread: float = 1.0) -> QuantizedWeight:
    """Random weights with rows of different magnitudes, so that each row's scale matters,
    quantized by QUANTIZERS[kind] (an INT4 kind skips a d_in its groups do not divide)."""
    if d_in % INT4_GROUPS.get(kind, 1):
        pytest.skip(f"{d_in} columns are not whole groups of {INT4_GROUPS[kind]}")
    w = RNG.standard_normal((d_out, d_in)).astype(np.float32) * spread / np.sqrt(d_in)
    return QUANTIZERS[kind](w * RNG.uniform(0.2, 2.0, (d_out, 1)).astype(np.float32))


def on_gpu(q: QuantizedWeight) -> LinearWeight:
    return fp8_linear(q) if isinstance(q, Fp8Weight) else int4_linear(q)


@pytest.fixture(scope="module")
def kernels(cuda_context):
    return kernels_for(4)


@pytest.mark.parametrize("scales", QUANTIZERS)
@pytest.mark.parametrize("d_in, d_out, out_f32", [(2048, 3072, False), (8192, 2048, False), (2048, 16384, False),
                                                  (2048, 128256, True), (576, 1002, False), (16384, 24, True),
                                                  (4112, 40, False), (4096, 40, False)])  # (rows over 16 or 32 lanes, 1 to 4 warps; ragged)
def test_gemv_quantized_matches_numpy_on_any_grid(kernels, scales, d_in, d_out, out_f32):
    x = RNG.standard_normal(d_in).astype(np.float32)
    q = quantized_weight(d_out, d_in, scales)
    w, xg = on_gpu(q), up_bf16(x)

    def gemv(blocks: int | None = None) -> np.ndarray:
        y = gpuarray.to_gpu(np.full(d_out, np.nan, np.float32)) if out_f32 else poisoned_bf16((d_out,))
        kernels.gemv(None, y, xg, w, d_in, d_out, out_f32, blocks)
        return y.get() if out_f32 else bf16_bits_to_f32(y.get())

    got = gemv()
    assert rel_l2(got, q.float32() @ bf16(x)) < TOL
    assert np.array_equal(gemv(blocks=3), got)  # the sums do not depend on the grid


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("d_in, d_out, out_f32", [(2048, 3072, False), (8192, 2048, False), (2048, 128256, True),
                                                  (576, 1002, False)])
@pytest.mark.parametrize("rows", [2, 33, 64])
def test_skinny_gemm_fp8_matches_numpy_for_every_split(kernels, scales, d_in, d_out, out_f32, rows):
    x = RNG.standard_normal((rows, d_in)).astype(np.float32)
    q = quantized_weight(d_out, d_in, scales)
    assert_skinny_gemm_is_exact_and_row_invariant(kernels, x, fp8_linear(q), bf16(x) @ q.float32().T, out_f32,
                                                  skinny_splits(rows, d_in, "fp8"))


@pytest.mark.parametrize("scales", QUANTIZERS)
def test_dequantize_is_exact(kernels, scales):
    """bf16 of each weight's value (code * scale, or (code - zero) * scale), here in two
    chunks of rows."""
    q = quantized_weight(300, 2048, scales)
    w = on_gpu(q)
    out = poisoned_bf16((300, 2048))
    kernels.dequantize(None, out, w, 0, 200)
    kernels.dequantize(None, int(out.gpudata) + 200 * 2048 * 2, w, 200, 100)
    assert np.array_equal(bf16_bits_to_f32(out.get()), bf16(q.float32()))


@pytest.mark.parametrize("scales", QUANTIZERS)
@pytest.mark.parametrize("heads, kv_heads, D, hidden", [(32, 8, 64, 2048), (24, 8, 128, 3072)])
def test_gemv_rmsnorm_rope_quantized_equals_gemv_then_rope_and_cache(cuda_context, scales, heads, kv_heads, D, hidden):
    kernels = kernels_for(heads // kv_heads, D)
    residual = gpuarray.to_gpu(bf16(RNG.standard_normal((1, hidden)).astype(np.float32)))
    norm_weight = up_bf16(RNG.standard_normal(hidden).astype(np.float32))
    width, slots_total = (heads + 2 * kv_heads) * D, 64
    w = on_gpu(quantized_weight(width, hidden, scales))
    positions, slots = i32(RNG.integers(0, 5000, 1)), i32(RNG.integers(0, slots_total, 1))
    cos_sin = cos_sin_table(kernels, llama3_inv_freq(D), 5000)

    def caches() -> tuple[gpuarray.GPUArray, gpuarray.GPUArray]:
        return poisoned_bf16(cache_shape(slots_total, kv_heads, D)), poisoned_bf16(cache_shape(slots_total, kv_heads, D))
    expected_qkv = poisoned_bf16((1, width))
    kernels.gemv(None, expected_qkv, separate_rmsnorm(kernels, residual, norm_weight, hidden), w, hidden, width)
    expected_k, expected_v = caches()
    kernels.rope_and_cache(None, expected_qkv, expected_k, expected_v, positions, slots, cos_sin, 1, heads, kv_heads, BLOCK_SHIFT)
    qkv = poisoned_bf16((1, width))
    k_cache, v_cache = caches()
    kernels.gemv_rmsnorm_rope(None, qkv, residual, norm_weight, 1e-5, w, k_cache, v_cache, positions, slots, cos_sin, heads,
                              kv_heads, BLOCK_SHIFT, hidden)
    q = heads * D
    assert np.array_equal(qkv.get()[:, :q], expected_qkv.get()[:, :q])
    assert np.array_equal(k_cache.get(), expected_k.get())
    assert np.array_equal(v_cache.get(), expected_v.get())


@pytest.mark.parametrize("scales", QUANTIZERS)
@pytest.mark.parametrize("hidden, inter", [(2048, 8192), (576, 1536)])
def test_gemv_rmsnorm_silu_quantized_equals_gemv_then_silu(kernels, scales, hidden, inter):
    residual = gpuarray.to_gpu(bf16(RNG.standard_normal((1, hidden)).astype(np.float32)))
    norm_weight = up_bf16(RNG.standard_normal(hidden).astype(np.float32))
    w = on_gpu(quantized_weight(2 * inter, hidden, scales, spread=3.0))
    gate_up = poisoned_bf16((1, 2 * inter))
    kernels.gemv(None, gate_up, separate_rmsnorm(kernels, residual, norm_weight, hidden), w, hidden, 2 * inter)
    expected = poisoned_bf16((1, inter))
    kernels.silu_and_mul(None, expected, gate_up, 1, inter)
    act = poisoned_bf16((1, inter))
    kernels.gemv_rmsnorm_silu(None, act, residual, norm_weight, 1e-5, w, hidden, inter)
    assert np.array_equal(act.get(), expected.get())


@pytest.mark.parametrize("scales", QUANTIZERS)
@pytest.mark.parametrize("d_in, hidden", [(2048, 2048), (8192, 2048), (576, 576)])
def test_gemv_add_quantized_equals_gemv_then_residual_add(kernels, scales, d_in, hidden):
    residual = bf16(RNG.standard_normal((1, hidden)).astype(np.float32))
    x = up_bf16(RNG.standard_normal((1, d_in)).astype(np.float32))
    w = on_gpu(quantized_weight(hidden, d_in, scales))
    y = poisoned_bf16((1, hidden))
    kernels.gemv(None, y, x, w, d_in, hidden)
    expected = gpuarray.to_gpu(residual)
    separate_add(kernels, expected, y, hidden)
    got = gpuarray.to_gpu(residual)
    kernels.gemv_add(None, got, x, w, d_in, hidden)
    assert np.array_equal(got.get(), expected.get())


@pytest.mark.parametrize("scales", QUANTIZERS)
@pytest.mark.parametrize("d_in, d_out, out_f32, scratch_rows", [(2048, 8192, False, 8192), (8192, 2048, False, 2048),
                                                                (2048, 50000, True, 16384)])  # (the head in 4 chunks)
def test_quantized_linear_over_gemm_tiles(cuda_context, kernels, scales, d_in, d_out, out_f32, scratch_rows):
    """Tiles of 1 row (the GEMV), of up to 32 (FP8: the skinny GEMM) and of more (cuBLAS
    on the dequantized weight)."""
    import pycuda.driver as cuda

    from engine.backends.cuda.cublas import Cublas
    from engine.backends.cuda.linear import Linear

    stream, workspace = cuda.Stream(), cuda.mem_alloc(32 * 2**20)
    linear = Linear(Cublas(stream.handle, int(workspace), 32 * 2**20), stream,
                    gpuarray.empty(scratch_rows * d_in, np.uint16))
    tiles, rows = [(0, 1), (1, 7), (8, 64), (72, 1), (73, 100)], 173
    q = quantized_weight(d_out, d_in, scales)
    x = RNG.standard_normal((rows, d_in)).astype(np.float32)
    y = gpuarray.to_gpu(np.full((rows, d_out), np.nan, np.float32)) if out_f32 else poisoned_bf16((rows, d_out))
    linear(kernels, y, up_bf16(x), on_gpu(q), tiles)
    stream.synchronize()
    got = y.get() if out_f32 else bf16_bits_to_f32(y.get())
    expected = bf16(x) @ q.float32().T
    for r, n in tiles:
        assert rel_l2(got[r : r + n], expected[r : r + n]) < TOL, (r, n)
    linear.blas.close()


def w8a8_rows(x: np.ndarray) -> np.ndarray:
    """x's rows as a W8A8 product sees them: each quantized to e4m3 with its largest
    magnitude over 448 as its scale (quantize_rows_e4m3), and dequantized."""
    from engine.quantization.fp8 import e4m3_to_f32, f32_to_e4m3

    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    return e4m3_to_f32(f32_to_e4m3(x / scale)) * scale


def test_quantize_rows_e4m3_matches_numpy(kernels):
    """Each row's scale is its largest magnitude over 448 (1 for a row of zeros), and
    its codes numpy's f32_to_e4m3 of x / scale, bit for bit."""
    from engine.quantization.fp8 import f32_to_e4m3

    rows, d_in = 37, 2048 + 16
    x = bf16(RNG.standard_normal((rows, d_in)).astype(np.float32) * RNG.uniform(1e-3, 30, (rows, 1)).astype(np.float32))
    x[5] = 0
    codes, scales = gpuarray.empty((rows, d_in), np.uint8), gpuarray.empty(rows, np.float32)
    kernels.quantize_rows_e4m3(None, codes, scales, up_bf16(x), rows, d_in)
    amax = np.abs(x).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
    np.testing.assert_array_equal(scales.get(), scale)
    np.testing.assert_array_equal(codes.get(), f32_to_e4m3(x / scale[:, None]))


@pytest.mark.parametrize("y_f32", [False, True])
def test_scale_rows_and_cols_matches_numpy(kernels, y_f32):
    rows, cols = 9, 2048 + 8
    y = RNG.standard_normal((rows, cols)).astype(np.float32) * 1e4
    r, c = (RNG.uniform(1e-4, 1, n).astype(np.float32) for n in (rows, cols))
    y_gpu = gpuarray.to_gpu(y) if y_f32 else up_bf16(y)
    kernels.scale_rows_and_cols(None, y_gpu, gpuarray.to_gpu(r), gpuarray.to_gpu(c), rows, cols, y_f32)
    if y_f32:
        np.testing.assert_array_equal(y_gpu.get(), y * (r[:, None] * c[None, :]))
    else:
        np.testing.assert_array_equal(bf16_bits_to_f32(y_gpu.get()), bf16(bf16(y) * (r[:, None] * c[None, :])))


def w8a8_sums(rows: int, cols: int) -> tuple[gpuarray.GPUArray, SumScales]:
    """A W8A8 product's sums as cuBLASLt leaves them (bfloat16, at the magnitude of
    products of e4m3 codes), and the token and weight-row scales that take them back."""
    sums = up_bf16(RNG.standard_normal((rows, cols)).astype(np.float32) * 3e3)
    return sums, SumScales(*(gpuarray.to_gpu(RNG.uniform(1e-4, 1e-3, n).astype(np.float32)) for n in (rows, cols)))


def scaled_back(kernels, sums: gpuarray.GPUArray, scales: SumScales) -> gpuarray.GPUArray:
    """A copy of the sums scaled back by scale_rows_and_cols (tested above)."""
    out = sums.copy()
    kernels.scale_rows_and_cols(None, out, scales.rows, scales.cols, *sums.shape)
    return out


def assert_same_codes(got: tuple, expected: tuple) -> None:
    """(codes, scales) pairs equal bit for bit."""
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a.get(), b.get())


def empty_codes(rows: int, cols: int) -> tuple[gpuarray.GPUArray, gpuarray.GPUArray]:
    return gpuarray.zeros((rows, cols), np.uint8), gpuarray.to_gpu(np.full(rows, np.nan, np.float32))


@pytest.mark.parametrize("codes", [False, True], ids=["bf16 out", "codes out"])
def test_add_rmsnorm_takes_w8a8_sums_and_writes_codes(kernels, codes):
    """add_rmsnorm over a W8A8 product's sums as its delta (scaled back as it adds
    them), writing bfloat16 or e4m3 codes a row: bit for bit scale_rows_and_cols,
    add_rmsnorm and quantize_rows_e4m3 in turn, over a subset of rows in any order."""
    tokens, hidden = 37, 2048
    residual = bf16(RNG.standard_normal((tokens, hidden)).astype(np.float32))
    weight = up_bf16(RNG.standard_normal(hidden).astype(np.float32))
    rows = i32(RNG.permutation(tokens)[:30])
    delta, scales = w8a8_sums(tokens, hidden)
    fused_residual, separate_residual = gpuarray.to_gpu(residual), gpuarray.to_gpu(residual)
    h = poisoned_bf16((30, hidden))
    kernels.add_rmsnorm(None, separate_residual, scaled_back(kernels, delta, scales), weight, h, rows, 30, hidden, 1e-5)
    if codes:
        fused, separate = empty_codes(30, hidden), empty_codes(30, hidden)
        kernels.add_rmsnorm(None, fused_residual, delta, weight, fused[0], rows, 30, hidden, 1e-5, scales, fused[1])
        kernels.quantize_rows_e4m3(None, *separate, h, 30, hidden)
        assert_same_codes(fused, separate)
    else:
        fused_h = poisoned_bf16((30, hidden))
        kernels.add_rmsnorm(None, fused_residual, delta, weight, fused_h, rows, 30, hidden, 1e-5, scales)
        np.testing.assert_array_equal(fused_h.get(), h.get())
    np.testing.assert_array_equal(fused_residual.get(), separate_residual.get())


def test_rope_and_cache_scales_w8a8_sums_back(cuda_context):
    """rope_and_cache over a W8A8 QKV product's sums: bit for bit scale_rows_and_cols,
    then rope_and_cache (q in place, k and v in the cache)."""
    heads, kv_heads, D, tokens, slots_total = 32, 8, 64, 23, 208
    kernels = kernels_for(heads // kv_heads, D)
    positions, slots = i32(RNG.integers(0, 5000, tokens)), i32(RNG.permutation(slots_total)[:tokens])
    cos_sin = cos_sin_table(kernels, llama3_inv_freq(D), 5000)
    qkv, scales = w8a8_sums(tokens, (heads + 2 * kv_heads) * D)
    runs = []
    for fused in (True, False):
        x = qkv.copy() if fused else scaled_back(kernels, qkv, scales)
        caches = [poisoned_bf16(cache_shape(slots_total, kv_heads, D)) for _ in range(2)]
        kernels.rope_and_cache(None, x, *caches, positions, slots, cos_sin, tokens, heads, kv_heads, BLOCK_SHIFT,
                               qkv_scales=scales if fused else None)
        runs.append([x.get()[:, : heads * D], *(cache.get() for cache in caches)])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("w8a8_gate_up", [False, True], ids=["bf16 gate_up", "W8A8 gate_up"])
def test_silu_and_mul_e4m3_is_silu_and_mul_then_quantize_rows(kernels, w8a8_gate_up):
    """silu_and_mul_e4m3: bit for bit silu_and_mul and quantize_rows_e4m3 in turn, over
    bfloat16 gate/up values or a W8A8 product's sums (scale_rows_and_cols first); a row
    of zeros takes scale 1."""
    tokens, inter = 29, 8192
    if w8a8_gate_up:
        gate_up, scales = w8a8_sums(tokens, 2 * inter)
        plain = scaled_back(kernels, gate_up, scales)
    else:
        values = RNG.standard_normal((tokens, 2 * inter)).astype(np.float32) * 3
        values[4] = 0
        gate_up, scales = up_bf16(values), None
        plain = gate_up
    fused, separate = empty_codes(tokens, inter), empty_codes(tokens, inter)
    kernels.silu_and_mul_e4m3(None, *fused, gate_up, tokens, inter, scales)
    act = poisoned_bf16((tokens, inter))
    kernels.silu_and_mul(None, act, plain, tokens, inter)
    kernels.quantize_rows_e4m3(None, *separate, act, tokens, inter)
    assert_same_codes(fused, separate)


@pytest.mark.parametrize("scales", ["per-row", "per-tensor"])
@pytest.mark.parametrize("d_in, d_out, out_f32, scratch_rows", [(2048, 8192, False, 8192), (8192, 2048, False, 24),
                                                                (2048, 50000, True, 16384)])
def test_w8a8_linear_over_gemm_tiles(cuda_context, kernels, scales, d_in, d_out, out_f32, scratch_rows):
    """With a cuBLASLt handle, tiles of an FP8-dynamic weight (LinearWeight.w8a8) of more
    rows than the skinny GEMM takes are W8A8 products: numpy's product of the
    row-quantized activations (w8a8_rows) and the dequantized weight, at the bfloat16
    kernels' tolerance, and nearer it than the product of the bfloat16 activations. A
    scratch of 24 rows of 8,192 columns holds 47 rows' codes: tiles of 64 and 100 rows go
    in chunks."""
    import pycuda.driver as cuda

    from engine.backends.cuda.cublas import Cublas
    from engine.backends.cuda.cublaslt import CublasLt
    from engine.backends.cuda.linear import Linear

    stream, workspace = cuda.Stream(), cuda.mem_alloc(32 * 2**20)
    linear = Linear(Cublas(stream.handle, int(workspace), 32 * 2**20), stream,
                    gpuarray.empty(scratch_rows * d_in, np.uint16), lt=CublasLt(stream.handle, int(workspace), 32 * 2**20))
    tiles, rows = [(0, 1), (1, 7), (8, 64), (72, 1), (73, 100)], 173
    q = quantized_weight(d_out, d_in, scales)
    x = bf16(RNG.standard_normal((rows, d_in)).astype(np.float32))
    y = gpuarray.to_gpu(np.full((rows, d_out), np.nan, np.float32)) if out_f32 else poisoned_bf16((rows, d_out))
    linear(kernels, y, up_bf16(x), dataclasses.replace(on_gpu(q), w8a8=True), tiles)
    stream.synchronize()
    got = y.get() if out_f32 else bf16_bits_to_f32(y.get())
    w = q.float32()
    for r, n in tiles:
        plain = x[r : r + n] @ w.T
        if n <= 32:
            assert rel_l2(got[r : r + n], plain) < TOL, (r, n)
            continue
        w8a8 = w8a8_rows(x[r : r + n]) @ w.T
        assert rel_l2(got[r : r + n], w8a8) < TOL / 2, (r, n)
        assert rel_l2(got[r : r + n], w8a8) < rel_l2(got[r : r + n], plain) / 2, (r, n)
    linear.blas.close()
    linear.lt.close()


# -- the whole model -----------------------------------------------------------------
LENGTHS = np.unique(np.geomspace(1, 2047, 46).round().astype(int)).tolist()  # 40 prompt lengths, 1 to 2,047 tokens


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from devtools.checkpoints import LLAMA_32_1B, make_model

    path = tmp_path_factory.mktemp("llama-3.2-1b-shape")
    make_model(path, LLAMA_32_1B, seed=0)
    return path


def references(model, source: Path, tmp: Path) -> dict:
    """transformers' float32 (the exact model: what the numpy backend computes, which its
    golden tests hold within 1e-6 of it) and bfloat16 (eager attention) on `model`'s
    weights dequantized, written as a float32 checkpoint with `source`'s config."""
    import shutil

    import torch
    import transformers
    from safetensors.numpy import save_file

    tmp.mkdir()
    shutil.copy(source / "config.json", tmp / "config.json")
    save_file({name: t.float32() for name, t in model.weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    load = transformers.LlamaForCausalLM.from_pretrained
    return {"bf16": load(tmp, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval(),
            "fp32": load(tmp, dtype=torch.float32).cuda().eval()}


def hf_last_logits(hf, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu().numpy()


def measure(engine, hf: dict, prompts: list[list[int]]) -> dict:
    """Against the exact model over the prompts: the mean relative L2 error of the last
    position's logits, the share of first tokens (argmax) it agrees on, and the mean
    error of the log-probability of the exact model's choice; ours and transformers'
    bfloat16, and our logits."""
    from devtools.probes import our_logits

    out = {"ours": [], "bf16": [], "logits": []}
    for ids in prompts:
        exact = hf_last_logits(hf["fp32"], ids)
        top = int(exact.argmax())
        for who, got in (("ours", our_logits(engine, ids)), ("bf16", hf_last_logits(hf["bf16"], ids))):
            out[who].append((rel_l2(got, exact), int(got.argmax()) == top,
                             abs(log_probs(got)[top] - log_probs(exact)[top])))
            if who == "ours":
                out["logits"].append(got)
    return {who: np.mean(out[who], axis=0) for who in ("ours", "bf16")} | {"logits": out["logits"]}


@pytest.fixture(scope="module")
def bf16_run(llama_dir, tmp_path_factory):
    """Our bfloat16 path against its exact model, on the same prompts: the bar."""
    from engine.backends.cuda.backend import CudaBackend
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_loader import load_model

    model = load_model(llama_dir)
    engine = LLMEngine(model, CudaBackend(model.config, model.model_weights()),
                       EngineConfig(num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096))
    prompts = [prompt_of(engine, n) for n in LENGTHS]
    return prompts, measure(engine, references(model, llama_dir, tmp_path_factory.mktemp("bf16") / "ref"), prompts)


def prompt_of(engine, n: int) -> list[int]:
    from devtools.checkpoints import TEXT

    ids = [128000] + engine.tokenizer.encode(TEXT * 60, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


@pytest.mark.parametrize("fmt", ["fp8-rows", "fp8-blocks", "fp8-rows-and-head", "int4-g128"])
def test_quantized_model_matches_its_exact_model_as_bf16_does(llama_dir, tmp_path, bf16_run, fmt):
    """The layers in FP8 with per-row scales (as --quantization fp8 and compressed-tensors
    checkpoints) or 128 x 128 blocks (Hugging Face's fp8), and the tied head too
    (--quantize-lm-head), quantized by devtools' fast quantizer (our reference one takes
    minutes at this shape); or in INT4, groups of 128 with zero points (as AWQ and GPTQ):
    over 40 prompts of 1 to 2,047 tokens, ours against the exact dequantized model as
    close as transformers' bfloat16 of it, and as our bfloat16 path against its own
    exact model."""
    from devtools.quantized import fp8_model, int4_model
    from engine.backends.cuda.backend import CudaBackend
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_loader import load_model

    if fmt == "int4-g128":
        model = int4_model(load_model(llama_dir), 128)
    else:
        model = fp8_model(load_model(llama_dir), (128, 128) if fmt == "fp8-blocks" else None, head=fmt.endswith("head"))
    engine = LLMEngine(model, CudaBackend(model.config, model.model_weights(), int4_weights=True),
                       EngineConfig(num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096))
    assert engine.backend.weights.lm_head.format == ("fp8" if fmt.endswith("head") else "bf16")
    assert {w.format for w in engine.backend.weights.layers[0].values() if hasattr(w, "format")} == {fmt[:4].rstrip("-")}
    prompts, base = bf16_run
    got = measure(engine, references(model, llama_dir, tmp_path / "ref"), prompts)
    added = np.mean([rel_l2(a, b) for a, b in zip(got["logits"], base["logits"])])
    names = ("logits rel L2", "first-token agreement", "log-prob error")
    print(f"\n{fmt} over {len(prompts)} prompts of 1-2047 tokens, against the exact dequantized model:")
    for label, values in ((f"ours, {fmt}", got["ours"]), ("transformers bf16 of it", got["bf16"]),
                          ("ours, bf16 model, against its exact model", base["ours"])):
        print("  " + label + ": " + ", ".join(f"{n} {v:.3g}" for n, v in zip(names, values)))
    print(f"  the format's change to our bf16 model's logits: rel L2 {added:.3g}")
    # The bars: the larger of transformers' bfloat16 error on these weights and our
    # bfloat16 path's on its own model (random weights differ in how much bfloat16
    # rounding moves their logits: the FP8 model's more than the bfloat16 one's).
    err, agree, logprob = got["ours"]
    assert err < 1.1 * max(got["bf16"][0], base["ours"][0]) + 1e-3
    assert agree >= min(got["bf16"][1], base["ours"][1]) - 0.15  # (two standard deviations of a 40-prompt rate)
    assert logprob < 1.5 * max(got["bf16"][2], base["ours"][2]) + 1e-3


@pytest.mark.parametrize("row", ["fits", "too_wide"])
def test_w8a8_ends_in_the_kernels_around_each_product_equal_kernels_of_their_own(llama_dir, monkeypatch, row):
    """An FP8-dynamic model's prompt steps, whose norms and SiLU quantize each W8A8
    product's input and whose RoPE, SiLU and residual adds scale its sums back
    (forward.LayerLaunches), give the logits bit for bit that the products computed
    alone give (Linear: quantize_rows_e4m3 and scale_rows_and_cols around each); so do
    they where the rows are too wide for the fused kernels' shared memory (here, as if
    it held less), which then leave the quantizing to quantize_rows_e4m3."""
    from devtools.probes import our_logits
    from devtools.quantized import fp8_model
    from engine.backends.cuda import forward
    from engine.backends.cuda.backend import CudaBackend
    from engine.backends.cuda.linear import Linear
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.model_loader import load_model

    model = fp8_model(load_model(llama_dir), dynamic_activations=True)
    backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=False)
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096))
    assert backend.linear.w8a8_plan(backend.kernels, backend.weights.layers[0]["qkv"], [(0, 300)]) is not None
    prompts = [prompt_of(engine, n) for n in (33, 300, 1500)]
    if row == "too_wide":
        monkeypatch.setattr(forward, "ROW_STASH_BYTES", 2 * model.config.hidden_size - 2)
    fused = [our_logits(engine, ids) for ids in prompts]
    monkeypatch.setattr(Linear, "w8a8_plan", lambda self, kernels, w, tiles: None)
    for ids, logits in zip(prompts, fused):
        np.testing.assert_array_equal(our_logits(engine, ids), logits)

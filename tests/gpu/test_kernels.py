"""Each CUDA kernel against the numpy backend's version of the same op.

Fresh random inputs every run, outputs poisoned with NaN first so that an element a
kernel fails to write shows up; relative L2 error under 1e-2 (bfloat16 storage).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.gpu.conftest import require_gpu  # noqa: E402

require_gpu()

import pycuda.gpuarray as gpuarray  # noqa: E402

from engine.backends import numpy_backend as ref  # noqa: E402
from engine.backends.cuda.cublas import Cublas, DataType  # noqa: E402
from engine.backends.cuda.kernels import Kernels, PagedAttention, block_shift, prefill_query_rows, skinny_splits  # noqa: E402
from engine.backends.cuda.step_metadata import LARGE_PARTITION, PARTITION, SHORT_PARTITION  # noqa: E402
from engine.quantization.fp8 import E4M3, e4m3_to_f32  # noqa: E402
from engine.quantization.kv_cache import KvScale, load_e4m3, store_e4m3  # noqa: E402
from engine.sampler import apply_penalties  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.weights import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: E402
from tests.gpu.conftest import BF16_NAN, bf16, rel_l2  # noqa: E402

RNG = np.random.default_rng()
TOL = 1e-2
# the caches the attention kernels read: (FP8, the layer's scales)
KV_CACHES = {"bf16 cache": (False, KvScale()), "fp8 cache": (True, KvScale()),
             "fp8 cache, calibrated scales": (True, KvScale(0.37, 2.5))}


@functools.cache
def kernels_for(group: int, head_dim: int = 64, kv_fp8: bool = False) -> Kernels:
    """The kernels compiled for `head_dim` and `group` query heads per KV head (and a
    cache of e4m3 codes where `kv_fp8`)."""
    import pycuda.driver as cuda

    device = cuda.Context.get_device()
    major, minor = device.compute_capability()
    return Kernels(head_dim, group, f"sm_{major}{minor}", device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT),
                   kv_fp8)


@pytest.fixture(scope="module")
def kernels(cuda_context):
    return kernels_for(4)


def up_bf16(x: np.ndarray) -> gpuarray.GPUArray:
    return gpuarray.to_gpu(f32_to_bf16_bits(x))


def down_bf16(a: gpuarray.GPUArray) -> np.ndarray:
    return bf16_bits_to_f32(a.get())


def poisoned_bf16(shape) -> gpuarray.GPUArray:
    return gpuarray.to_gpu(np.full(shape, BF16_NAN, np.uint16))


def i32(values) -> gpuarray.GPUArray:
    return gpuarray.to_gpu(np.asarray(values, dtype=np.int32))


E4M3_NAN = np.uint8(0x7F)


BLOCK = 16  # KV-cache block size, where a test's is not a parameter
BLOCK_SHIFT = block_shift(BLOCK)


def cache_shape(slots: int, kv_heads: int, D: int, block_size: int = BLOCK) -> tuple[int, ...]:
    """KvCache's layout of a layer's K (or V): [blocks, kv_heads, block_size, D]."""
    return slots // block_size, kv_heads, block_size, D


def in_cache_layout(by_slot: np.ndarray, block_size: int) -> np.ndarray:
    """A [slots, kv_heads, D] array in KvCache's layout."""
    slots, kv_heads, D = by_slot.shape
    return np.ascontiguousarray(by_slot.reshape(slots // block_size, block_size, kv_heads, D).swapaxes(1, 2))


def by_slot(cache: np.ndarray) -> np.ndarray:
    """A KvCache-layout array as [slots, kv_heads, D]."""
    blocks, kv_heads, block_size, D = cache.shape
    return cache.swapaxes(1, 2).reshape(blocks * block_size, kv_heads, D)


def poisoned_cache(shape, kv_fp8: bool) -> gpuarray.GPUArray:
    """A KV cache of NaNs in its element: bfloat16, or e4m3 codes."""
    return gpuarray.to_gpu(np.full(shape, E4M3_NAN, np.uint8) if kv_fp8 else np.full(shape, BF16_NAN, np.uint16))


def cache_values(cache: gpuarray.GPUArray, scale: float = 1.0) -> np.ndarray:
    """A KV cache's values in float32, from bfloat16 or e4m3 codes (over `scale`), by slot."""
    host = by_slot(cache.get())
    return load_e4m3(host, scale) if host.dtype == np.uint8 else bf16_bits_to_f32(host)


@pytest.mark.parametrize("tokens, hidden", [(1, 64), (37, 2048), (5, 576)])
def test_embedding_gather(kernels, tokens, hidden):
    """Ids from the host, and (negative) ones that name a token sampled on the device."""
    table = RNG.standard_normal((300, hidden)).astype(np.float32)
    ids = RNG.integers(0, 300, tokens)
    sampled = RNG.integers(0, 300, 7)
    on_device = RNG.random(tokens) < 0.5
    source = RNG.integers(0, 7, tokens)
    encoded = np.where(on_device, -(source + 1), ids)
    out = gpuarray.to_gpu(np.full((tokens, hidden), np.nan, np.float32))
    kernels.embedding_gather(None, out, up_bf16(table), i32(encoded), i32(sampled), tokens, hidden)
    assert np.array_equal(out.get(), bf16(table)[np.where(on_device, sampled[source], ids)])


@pytest.mark.parametrize("tokens, hidden, with_delta", [(7, 2048, True), (3, 576, False), (64, 64, True)])
def test_add_rmsnorm(kernels, tokens, hidden, with_delta):
    residual = bf16(RNG.standard_normal((tokens, hidden)).astype(np.float32))
    delta = RNG.standard_normal((tokens, hidden)).astype(np.float32)
    weight = RNG.standard_normal(hidden).astype(np.float32)
    rows = RNG.permutation(tokens)[: max(1, tokens // 2)]  # a subset, in any order
    res_gpu = gpuarray.to_gpu(residual)
    out = poisoned_bf16((len(rows), hidden))
    kernels.add_rmsnorm(None, res_gpu, up_bf16(delta) if with_delta else None, up_bf16(weight), out, i32(rows), len(rows),
                        hidden, 1e-5)
    expected_res = residual + bf16(delta) if with_delta else residual
    expected = ref.rms_norm(expected_res[rows], bf16(weight), 1e-5)
    assert rel_l2(down_bf16(out), expected) < TOL
    updated = res_gpu.get()
    assert rel_l2(updated[rows], expected_res[rows]) < TOL


def llama3_inv_freq(head_dim: int) -> np.ndarray:
    """RoPE inverse frequencies with Llama 3's scaling (rope_theta 500000, factor 32)."""
    from engine.config import ModelConfig, RopeScaling

    cfg = ModelConfig(hidden_size=head_dim, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=head_dim,
                      intermediate_size=1, vocab_size=1, max_position_embeddings=131072, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192))
    return cfg.rope_inv_freq()


def cos_sin_table(kernels, inv_freq: np.ndarray, positions: int) -> gpuarray.GPUArray:
    """rope_cos_sin's table for positions 0..positions-1."""
    table = gpuarray.empty((positions, len(inv_freq), 2), np.float32)
    kernels.rope_cos_sin(None, table, gpuarray.to_gpu(inv_freq), positions)
    return table


def test_rope_cos_sin_table(kernels):
    """Every position the model takes, the last ones past sincosf's fast range included."""
    inv_freq = llama3_inv_freq(64)
    table = cos_sin_table(kernels, inv_freq, 131072).get()
    positions = np.array([0, 1, 4999, 105616, 131071])
    angles = (positions[:, None].astype(np.float32) * inv_freq[None, :]).astype(np.float64)  # float32 products, as transformers
    expected = np.stack([np.cos(angles), np.sin(angles)], axis=-1)
    assert np.abs(table[positions] - expected).max() < 2.0 ** -8  # (bfloat16 rounding of values up to 1)
    assert np.array_equal(bf16(table), table)  # rounded to bfloat16, as transformers' cos and sin


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (9, 3)])
def test_rope_and_cache(cuda_context, heads, kv_heads):
    D, tokens, slots_total = 64, 23, 208
    kernels = kernels_for(heads // kv_heads, D)
    inv_freq = llama3_inv_freq(D)
    qkv = RNG.standard_normal((tokens, (heads + 2 * kv_heads) * D)).astype(np.float32)
    positions = RNG.integers(0, 5000, tokens)
    slots = RNG.permutation(slots_total)[:tokens]
    qkv_gpu = up_bf16(qkv)
    k_cache, v_cache = (poisoned_bf16(cache_shape(slots_total, kv_heads, D)) for _ in range(2))
    kernels.rope_and_cache(None, qkv_gpu, k_cache, v_cache, i32(positions), i32(slots), cos_sin_table(kernels, inv_freq, 5000),
                           tokens, heads, kv_heads, BLOCK_SHIFT)
    cos, sin = ref.rope_cos_sin(positions, inv_freq)
    q_in = bf16(qkv)[:, : heads * D].reshape(tokens, heads, D)
    k_in = bf16(qkv)[:, heads * D : (heads + kv_heads) * D].reshape(tokens, kv_heads, D)
    q_out = down_bf16(qkv_gpu)[:, : heads * D].reshape(tokens, heads, D)
    assert rel_l2(q_out, ref.apply_rope(q_in, cos, sin)) < TOL
    k_got, v_got = cache_values(k_cache), cache_values(v_cache)
    assert rel_l2(k_got[slots], ref.apply_rope(k_in, cos, sin)) < TOL
    assert np.array_equal(v_got[slots], bf16(qkv)[:, (heads + kv_heads) * D :].reshape(tokens, kv_heads, D))
    untouched = np.setdiff1d(np.arange(slots_total), slots)
    assert np.isnan(k_got[untouched]).all(), "wrote outside the slot mapping"


@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (9, 3)])
@pytest.mark.parametrize("kv_scale", [KvScale(), KvScale(0.37, 2.5)], ids=["scale 1", "calibrated scales"])
def test_fp8_cache_holds_the_bfloat16_cache_rounded_as_the_numpy_backend_rounds(cuda_context, heads, kv_heads, kv_scale):
    """rope_and_cache built for an e4m3 cache writes, bit for bit, the codes the numpy
    backend rounds the bfloat16 build's K and V to over the layer's scales (which the
    bfloat16 build ignores): V (stored as it is) is every e4m3 value, every midpoint
    between two (a tie goes to the smaller magnitude), both signs, and past 448
    (saturating); K is rotated, over a wide range."""
    D, slots_total = 64, 304
    magnitudes = np.unique(np.abs(E4M3[np.isfinite(E4M3)]))
    special = np.concatenate([magnitudes, (magnitudes[:-1] + magnitudes[1:]) / 2, [460.0, 464.0, 500.0, 1e4]])
    special = np.concatenate([special, -special]).astype(np.float32)
    width = kv_heads * D
    tokens = -(-len(special) // width) + 3
    qkv = (RNG.standard_normal((tokens, (heads + 2 * kv_heads) * D)) * 40).astype(np.float32)
    qkv[:, (heads + kv_heads) * D :] = np.resize(RNG.permutation(special), (tokens, width))
    positions, slots = i32(RNG.integers(0, 5000, tokens)), RNG.permutation(slots_total)[:tokens]
    caches = {}
    for kv_fp8 in (False, True):
        kernels = kernels_for(heads // kv_heads, D, kv_fp8)
        k_cache, v_cache = (poisoned_cache(cache_shape(slots_total, kv_heads, D), kv_fp8) for _ in range(2))
        kernels.rope_and_cache(None, up_bf16(qkv), k_cache, v_cache, positions, i32(slots),
                               cos_sin_table(kernels, llama3_inv_freq(D), 5000), tokens, heads, kv_heads, BLOCK_SHIFT,
                               kv_scale)
        caches[kv_fp8] = by_slot(k_cache.get()), by_slot(v_cache.get())
    for bf16_bits, codes, scale in zip(caches[False], caches[True], (kv_scale.k, kv_scale.v)):
        assert np.array_equal(codes[slots], store_e4m3(bf16_bits_to_f32(bf16_bits[slots]), scale))
        assert (np.delete(codes, slots, axis=0) == E4M3_NAN).all(), "wrote outside the slot mapping"


@pytest.mark.parametrize("widening", ["e4m3x2_to_bf16x2", "e4m3x2_to_f16x2"])
def test_e4m3_pairs_widen_exactly(cuda_context, widening):
    """e4m3x2_to_bf16x2 (common.cuh), which prompt attention on an FP8 cache and the FP8
    GEMMs widen with, and e4m3x2_to_f16x2, decode attention's, give every finite code's
    value bit for bit, subnormals and both zeros included, in either half of the word
    and whatever the other half holds."""
    import pycuda.driver as cuda
    from pycuda.compiler import SourceModule

    from engine.backends.cuda.kernels import CUDA_SRC, nvcc_target

    major, minor = cuda.Context.get_device().compute_capability()
    source = """
        #include "common.cuh"
        extern "C" __global__ void widen(const uint32_t* codes, uint32_t* out, int n) {
            const int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) out[i] = WIDEN(codes[i]);
        }""".replace("WIDEN", widening)
    widen = SourceModule(source, include_dirs=[str(CUDA_SRC)], no_extern_c=True,
                         **nvcc_target(f"sm_{major}{minor}")).get_function("widen")
    finite = np.flatnonzero(np.isfinite(E4M3)).astype(np.uint32)
    lo, hi = (a.ravel() for a in np.meshgrid(finite, finite))
    words = lo | hi << 8 | RNG.integers(0, 1 << 16, lo.size, dtype=np.uint32) << 16  # the upper codes are ignored
    out = gpuarray.to_gpu(np.zeros(words.size, np.uint32))
    widen(gpuarray.to_gpu(words), out, np.int32(words.size), block=(256, 1, 1), grid=(-(-words.size // 256), 1))
    got = out.get()
    bits = f32_to_bf16_bits if widening == "e4m3x2_to_bf16x2" else lambda x: x.astype(np.float16).view(np.uint16)
    assert np.array_equal(got & 0xFFFF, bits(e4m3_to_f32(lo.astype(np.uint8))))
    assert np.array_equal(got >> 16, bits(e4m3_to_f32(hi.astype(np.uint8))))


def merge_partial_results(kernels, out, attention: PagedAttention, positions: np.ndarray, decode_rows: int,
                          kv_scale: KvScale = KvScale()) -> None:
    """paged_attention_merge over every token, after poisoning what pass 1 left in the
    partitions past each token's context (the merge must not read it). Of the first
    `decode_rows`, the decode kernel's, those in one partition have their output already
    and no partial results (NaN): the merge must leave them be."""
    tokens, heads, partitions = attention.part_max.shape
    unspanned = np.arange(partitions)[None, None, :] >= (positions // attention.partition + 1)[:, None, None]
    unspanned = np.broadcast_to(unspanned, (tokens, heads, partitions))
    for a in (attention.part_acc, attention.part_max, attention.part_sum):
        host = a.get()
        host[unspanned] = np.nan
        a.set(host)
    kernels.paged_attention_merge(None, out, attention, tokens, decode_rows, kv_scale)


@pytest.mark.parametrize("kernel", ["decode merging itself", "decode loading ahead", "decode", "prefill",
                                    "prefill, whole contexts"])
@pytest.mark.parametrize("heads, kv_heads, D", [(32, 8, 64), (9, 3, 64), (24, 8, 128)])  # Llama 3.2 1B, SmolLM2, 3B
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("partition", [LARGE_PARTITION, PARTITION, SHORT_PARTITION])
@pytest.mark.parametrize("kv", KV_CACHES)
def test_paged_attention(cuda_context, kernel, heads, kv_heads, D, block_size, partition, kv):
    """Decode tokens and prefill chunks of several sequences in one launch, over
    lengths that are not multiples of the block size and past one partition, through
    the decode kernel (split context, merged by the last partition's block, or by the
    merge kernel; its warps loading a chunk ahead, the same sums bit for bit) and
    through the prefill kernel (query tiles, then the merge kernel, or each tile's
    whole context at once, storing the output); over a cache of bfloat16 or of e4m3
    codes (against the codes' values, over the layer's scales)."""
    kv_fp8, kv_scale = KV_CACHES[kv]
    if kernel == "prefill, whole contexts" and partition != PARTITION:
        pytest.skip("one partition holds every context")
    # (context before this step, tokens in this step): decode, chunked prefill, full prefill, long decode
    seqs = [(37, 1), (20, 13), (0, 45), (PARTITION * 2 + 77, 1), (PARTITION - 1, 3), (0, 300), (PARTITION - 100, 250)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 4
    slots_total = num_blocks * block_size
    k_cache = RNG.standard_normal((slots_total, kv_heads, D)).astype(np.float32)
    v_cache = RNG.standard_normal((slots_total, kv_heads, D)).astype(np.float32)
    free = list(RNG.permutation(num_blocks))
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in seqs]
    max_blocks = max(map(len, tables))
    tokens = sum(n for _, n in seqs)
    qkv = RNG.standard_normal((tokens, (heads + 2 * kv_heads) * D)).astype(np.float32)
    token_seq = np.concatenate([[i] * n for i, (_, n) in enumerate(seqs)])
    positions = np.concatenate([np.arange(c, c + n) for c, n in seqs])
    out = poisoned_bf16((tokens, heads * D))
    table_arr = np.zeros((len(seqs), max_blocks), np.int32)
    for i, t in enumerate(tables):
        table_arr[i, : len(t)] = t
    k_cache, v_cache = in_cache_layout(k_cache, block_size), in_cache_layout(v_cache, block_size)
    if kv_fp8:
        kc, vc = gpuarray.to_gpu(store_e4m3(k_cache, kv_scale.k)), gpuarray.to_gpu(store_e4m3(v_cache, kv_scale.v))
    else:
        kc, vc = up_bf16(k_cache), up_bf16(v_cache)
    qkv_gpu = up_bf16(qkv)
    scale = np.float32(D ** -0.5)
    kernels = kernels_for(heads // kv_heads, D, kv_fp8)
    partitions = -(-max(c + n for c, n in seqs) // partition)
    part_acc = gpuarray.to_gpu(np.full((tokens, heads, partitions, D), np.nan, np.float32))
    part_max = gpuarray.to_gpu(np.full((tokens, heads, partitions), np.nan, np.float32))
    part_sum = gpuarray.to_gpu(np.full((tokens, heads, partitions), np.nan, np.float32))
    attention = PagedAttention(part_acc, part_max, part_sum, qkv_gpu, i32(table_arr), max_blocks, i32(token_seq),
                               i32(positions), heads, kv_heads, block_size, partition, partitions, scale)
    if kernel.startswith("decode") and kernel != "decode":  # (pass 2 in the same launch)
        arrivals = gpuarray.zeros((tokens, kv_heads), np.int32)
        for prefetch in (False, True) if kernel == "decode loading ahead" else (False, False):
            # (a second launch relies on the first leaving the arrival counts at zero)
            before, out = out, poisoned_bf16((tokens, heads * D))
            kernels.paged_attention_partial(None, out, arrivals, attention, kc, vc, tokens, prefetch, kv_scale)
        assert not arrivals.get().any()
        assert np.array_equal(before.get(), out.get())  # (the same sums, in the same order)
    elif kernel.startswith("prefill"):
        rows = prefill_query_rows(heads // kv_heads)
        starts = np.cumsum([0] + [n for _, n in seqs])
        tiles = [(r, min(rows, end - r)) for start, end in zip(starts, starts[1:]) for r in range(start, end, rows)]
        whole = kernel == "prefill, whole contexts"
        kernels.prefill_attention_partial(None, out if whole else None, attention, kc, vc, i32(np.ravel(tiles)), len(tiles),
                                          kv_scale)
        if whole:
            assert np.isnan(part_max.get()).all(), "wrote partial results"
        else:
            merge_partial_results(kernels, out, attention, positions, 0, kv_scale)
    else:
        kernels.paged_attention_partial(None, out, None, attention, kc, vc, tokens, kv_scale=kv_scale)
        merge_partial_results(kernels, out, attention, positions, tokens, kv_scale)
    got = down_bf16(out)
    q = bf16(qkv)[:, : heads * D].reshape(tokens, heads, D)
    start = 0
    for (c, n), table in zip(seqs, tables):
        slots = (np.asarray(table)[:, None] * block_size + np.arange(block_size)).ravel()[: c + n]
        expected = ref.paged_attention(q[start : start + n], cache_values(kc, kv_scale.k), cache_values(vc, kv_scale.v),
                                       slots, c, scale)
        assert rel_l2(got[start : start + n], expected) < TOL, (c, n)
        start += n


@pytest.mark.parametrize("heads, kv_heads, D", [(16, 8, 128), (9, 3, 64)])
def test_head_rmsnorm(cuda_context, heads, kv_heads, D):
    """Qwen3's q/k norm, in place: each query and key head normalised, V untouched."""
    tokens, width = 19, (heads + 2 * kv_heads) * D
    qkv = RNG.standard_normal((tokens, width)).astype(np.float32) * 2
    q_weight, k_weight = (RNG.standard_normal(D).astype(np.float32) for _ in range(2))
    got = up_bf16(qkv)
    kernels_for(heads // kv_heads, D).head_rmsnorm(None, got, up_bf16(q_weight), up_bf16(k_weight), tokens, heads, kv_heads,
                                                   1e-6)
    expected = ref.head_rms_norm(bf16(qkv), bf16(q_weight), bf16(k_weight), heads, kv_heads, D, 1e-6)
    result = down_bf16(got)
    assert rel_l2(result, expected) < TOL
    assert np.array_equal(result[:, (heads + kv_heads) * D :], bf16(qkv)[:, (heads + kv_heads) * D :])


@pytest.mark.parametrize("tokens, inter", [(1, 8192), (33, 1536), (4, 104)])  # (104: a part-filled block)
def test_silu_and_mul(kernels, tokens, inter):
    gate_up = RNG.standard_normal((tokens, 2 * inter)).astype(np.float32) * 3
    out = poisoned_bf16((tokens, inter))
    kernels.silu_and_mul(None, out, up_bf16(gate_up), tokens, inter)
    assert rel_l2(down_bf16(out), ref.silu_and_mul(bf16(gate_up))) < TOL


@pytest.mark.parametrize("tokens, d_in, d_out, out_f32", [(1, 2048, 3072, False), (300, 2048, 8192, False),
                                                          (17, 8192, 2048, False), (5, 2048, 128256, True)])
def test_cublas_linear(cuda_context, tokens, d_in, d_out, out_f32):
    import pycuda.driver as cuda

    stream, workspace = cuda.Stream(), cuda.mem_alloc(32 * 2**20)
    blas = Cublas(stream.handle, int(workspace), 32 * 2**20)
    x = RNG.standard_normal((tokens, d_in)).astype(np.float32)
    w = RNG.standard_normal((d_out, d_in)).astype(np.float32) / np.sqrt(d_in)
    y = gpuarray.to_gpu(np.full((tokens, d_out), np.nan, np.float32)) if out_f32 else poisoned_bf16((tokens, d_out))
    xg, wg = up_bf16(x), up_bf16(w)
    blas.gemm(int(y.gpudata), DataType.F32 if out_f32 else DataType.BF16, int(xg.gpudata), DataType.BF16, int(wg.gpudata),
              DataType.BF16, tokens, d_in, d_out)
    stream.synchronize()
    got = y.get() if out_f32 else bf16_bits_to_f32(y.get())
    assert rel_l2(got, bf16(x) @ bf16(w).T) < TOL
    blas.close()


@pytest.mark.parametrize("d_in, d_out, out_f32", [(2048, 3072, False), (8192, 2048, False), (2048, 16384, False),
                                                  (2048, 128256, True), (576, 1002, False), (1000, 33, False),
                                                  (4104, 40, False), (16384, 24, True)])  # (rows split over 2 and 8 warps)
def test_gemv_matches_numpy_on_any_grid(kernels, d_in, d_out, out_f32):
    x = RNG.standard_normal(d_in).astype(np.float32)
    w = RNG.standard_normal((d_out, d_in)).astype(np.float32) / np.sqrt(d_in)
    xg, wg = up_bf16(x), up_bf16(w)

    def gemv(blocks: int | None = None) -> np.ndarray:
        y = gpuarray.to_gpu(np.full(d_out, np.nan, np.float32)) if out_f32 else poisoned_bf16((d_out,))
        kernels.gemv(None, y, xg, wg, d_in, d_out, out_f32, blocks)
        return y.get() if out_f32 else bf16_bits_to_f32(y.get())

    got = gemv()
    assert rel_l2(got, bf16(w) @ bf16(x)) < TOL
    assert np.array_equal(gemv(blocks=3), got)  # the sums do not depend on the grid: here each warp takes several rows


def skinny_gemm(kernels, x: gpuarray.GPUArray, w, rows: int, d_in: int, d_out: int, out_f32: bool,
                split: int) -> np.ndarray:
    """skinny_gemm.cu's y = x @ w^T over `rows` rows of x, as float32."""
    y = gpuarray.to_gpu(np.full((rows, d_out), np.nan, np.float32)) if out_f32 else poisoned_bf16((rows, d_out))
    kernels.skinny_gemm(None, y, x, w, rows, d_in, d_out, out_f32, split)
    return y.get() if out_f32 else bf16_bits_to_f32(y.get())


def assert_skinny_gemm_is_exact_and_row_invariant(kernels, x: np.ndarray, w, expected: np.ndarray, out_f32: bool,
                                                  splits: list[int]) -> None:
    """Every split's product within TOL of `expected`, and each row's result the same
    bits whether computed among all the rows or among two."""
    rows, d_in = x.shape
    d_out = expected.shape[1]
    xg = up_bf16(x)
    for split in splits:
        got = skinny_gemm(kernels, xg, w, rows, d_in, d_out, out_f32, split)
        assert rel_l2(got, expected) < TOL, split
        pair = skinny_gemm(kernels, up_bf16(x[rows - 2:]), w, 2, d_in, d_out, out_f32, split)
        assert np.array_equal(pair, got[rows - 2:]), split


@pytest.mark.parametrize("d_in, d_out, out_f32", [(2048, 3072, False), (8192, 2048, False), (2048, 16384, False),
                                                  (2048, 128256, True), (576, 960, False), (64, 40, False)])
@pytest.mark.parametrize("rows", [2, 16, 17, 64])
def test_skinny_gemm_matches_numpy_for_every_split(kernels, d_in, d_out, out_f32, rows):
    x = RNG.standard_normal((rows, d_in)).astype(np.float32)
    w = RNG.standard_normal((d_out, d_in)).astype(np.float32) / np.sqrt(d_in)
    assert_skinny_gemm_is_exact_and_row_invariant(kernels, x, up_bf16(w), bf16(x) @ bf16(w).T, out_f32,
                                                  skinny_splits(rows, d_in))


def separate_gemv(kernels, x: gpuarray.GPUArray, w: gpuarray.GPUArray, d_in: int, d_out: int) -> gpuarray.GPUArray:
    y = poisoned_bf16((1, d_out))
    kernels.gemv(None, y, x, w, d_in, d_out)
    return y


def separate_add(kernels, residual: gpuarray.GPUArray, delta: gpuarray.GPUArray, hidden: int) -> None:
    """residual += delta by add_rmsnorm (its normalised output is dropped)."""
    kernels.add_rmsnorm(None, residual, delta, up_bf16(np.ones(hidden, np.float32)), poisoned_bf16((1, hidden)), i32([0]), 1,
                        hidden, 1e-5)


def separate_rmsnorm(kernels, residual: gpuarray.GPUArray, norm_weight: gpuarray.GPUArray, hidden: int) -> gpuarray.GPUArray:
    """RMSNorm(residual) by add_rmsnorm with no delta."""
    h = poisoned_bf16((1, hidden))
    kernels.add_rmsnorm(None, residual, None, norm_weight, h, i32([0]), 1, hidden, 1e-5)
    return h


# The fused GEMVs (gemv.cu) against the kernels they replace, bit for bit, for one token.
# (Llama 3.2 1B, SmolLM2-135M and Llama 3.2 3B's attention shapes)
@pytest.mark.parametrize("heads, kv_heads, D, hidden", [(32, 8, 64, 2048), (9, 3, 64, 576), (24, 8, 128, 3072)])
@pytest.mark.parametrize("blocks", [None, 2])
@pytest.mark.parametrize("kv", KV_CACHES)
def test_gemv_rmsnorm_rope_equals_gemv_then_rope_and_cache(cuda_context, heads, kv_heads, D, hidden, blocks, kv):
    kv_fp8, kv_scale = KV_CACHES[kv]
    kernels = kernels_for(heads // kv_heads, D, kv_fp8)
    residual = gpuarray.to_gpu(bf16(RNG.standard_normal((1, hidden)).astype(np.float32)))
    norm_weight = up_bf16(RNG.standard_normal(hidden).astype(np.float32))
    width, slots_total = (heads + 2 * kv_heads) * D, 64
    w = up_bf16(RNG.standard_normal((width, hidden)).astype(np.float32) / np.sqrt(hidden))
    positions, slots = i32(RNG.integers(0, 5000, 1)), i32(RNG.integers(0, slots_total, 1))
    cos_sin = cos_sin_table(kernels, llama3_inv_freq(D), 5000)

    def caches() -> tuple[gpuarray.GPUArray, gpuarray.GPUArray]:
        return tuple(poisoned_cache(cache_shape(slots_total, kv_heads, D), kv_fp8) for _ in range(2))
    expected_qkv = separate_gemv(kernels, separate_rmsnorm(kernels, residual, norm_weight, hidden), w, hidden, width)
    expected_k, expected_v = caches()
    kernels.rope_and_cache(None, expected_qkv, expected_k, expected_v, positions, slots, cos_sin, 1, heads, kv_heads, BLOCK_SHIFT,
                           kv_scale)
    qkv = poisoned_bf16((1, width))
    k_cache, v_cache = caches()
    kernels.gemv_rmsnorm_rope(None, qkv, residual, norm_weight, 1e-5, w, k_cache, v_cache, positions, slots, cos_sin, heads,
                              kv_heads, BLOCK_SHIFT, hidden, blocks, kv_scale)
    q = heads * D
    assert np.array_equal(qkv.get()[:, :q], expected_qkv.get()[:, :q])  # q, rotated in place
    assert np.array_equal(k_cache.get(), expected_k.get())  # k and v in their slot, and nothing else written
    assert np.array_equal(v_cache.get(), expected_v.get())


@pytest.mark.parametrize("hidden, inter", [(2048, 8192), (576, 1536), (64, 40)])
@pytest.mark.parametrize("blocks", [None, 2])
def test_gemv_rmsnorm_silu_equals_add_rmsnorm_then_gemv_then_silu(kernels, hidden, inter, blocks):
    residual_values = bf16(RNG.standard_normal((1, hidden)).astype(np.float32))
    residual = gpuarray.to_gpu(residual_values)
    norm_weight = up_bf16(RNG.standard_normal(hidden).astype(np.float32))
    # gate rows, then up rows; scaled so that the gates spread over SiLU's curve
    w = up_bf16(RNG.standard_normal((2 * inter, hidden)).astype(np.float32) * 3 / np.sqrt(hidden))
    gate_up = separate_gemv(kernels, separate_rmsnorm(kernels, residual, norm_weight, hidden), w, hidden, 2 * inter)
    expected = poisoned_bf16((1, inter))
    kernels.silu_and_mul(None, expected, gate_up, 1, inter)
    act = poisoned_bf16((1, inter))
    kernels.gemv_rmsnorm_silu(None, act, residual, norm_weight, 1e-5, w, hidden, inter, blocks)
    assert np.array_equal(act.get(), expected.get())
    assert np.array_equal(residual.get(), residual_values)  # read, not written


@pytest.mark.parametrize("d_in, hidden", [(2048, 2048), (8192, 2048), (576, 576), (24, 40)])
@pytest.mark.parametrize("blocks", [None, 2])
def test_gemv_add_equals_gemv_then_residual_add(kernels, d_in, hidden, blocks):
    residual = bf16(RNG.standard_normal((1, hidden)).astype(np.float32))
    x = up_bf16(RNG.standard_normal((1, d_in)).astype(np.float32))
    w = up_bf16(RNG.standard_normal((hidden, d_in)).astype(np.float32) / np.sqrt(d_in))
    expected = gpuarray.to_gpu(residual)
    separate_add(kernels, expected, separate_gemv(kernels, x, w, d_in, hidden), hidden)
    got = gpuarray.to_gpu(residual)
    kernels.gemv_add(None, got, x, w, d_in, hidden, blocks)
    assert np.array_equal(got.get(), expected.get())


def sample_gpu(kernels, logits: np.ndarray, params: list[SamplingParams], seeds, steps) -> np.ndarray:
    S, V = logits.shape
    out = gpuarray.to_gpu(np.full(S, -1, np.int32))
    f32 = lambda v: gpuarray.to_gpu(np.asarray(v, np.float32))  # noqa: E731
    kernels.sample_tokens(None, out, gpuarray.to_gpu(logits), S, V, f32([p.temperature for p in params]),
                          f32([p.top_p for p in params]), i32([p.top_k for p in params]), f32([p.min_p for p in params]),
                          gpuarray.to_gpu(np.asarray(seeds, np.uint32)), gpuarray.to_gpu(np.zeros(S, np.uint32)), i32(steps))
    return out.get()


def test_greedy_sampling_is_argmax(kernels):
    logits = RNG.standard_normal((50, 128256)).astype(np.float32)
    logits[3, [10, 20]] = 100.0  # a tie: the first index wins, as numpy's argmax
    tokens = sample_gpu(kernels, logits, [SamplingParams(temperature=0.0)] * 50, range(50), [0] * 50)
    assert np.array_equal(tokens, logits.argmax(axis=1))


@pytest.mark.parametrize("params, support", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),
    (SamplingParams(top_p=0.71), {0, 1, 2}),
    (SamplingParams(min_p=0.5), {0, 1}),
    (SamplingParams(), {0, 1, 2, 3, 4}),
])
@pytest.mark.parametrize("vocab, n, atol", [(5, 20000, 0.015), (128256, 3000, 0.035)])
def test_sampling_filters_and_frequencies(kernels, params, support, vocab, n, atol):
    """Five tokens with these probabilities, the rest of the vocabulary at -inf: in a
    5-token vocabulary (the kernel's one-float-at-a-time walks) and spread over a
    128K one (16-byte loads, every part of a row's walk and of a warp's range)."""
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    where = np.arange(5) if vocab == 5 else np.array([3, 40_001, 70_002, 100_003, vocab - 1])
    row = np.full(vocab, -np.inf, np.float32)
    row[where] = np.log(probs)
    tokens = sample_gpu(kernels, np.tile(row, (n, 1)), [params] * n, RNG.integers(0, 2**32, n), [0] * n)
    picked = np.searchsorted(where, tokens)
    assert np.array_equal(where[picked], tokens)  # only the five
    assert set(picked.tolist()) == support
    expected = np.where(np.isin(np.arange(5), list(support)), probs, 0)
    expected /= expected.sum()
    assert np.allclose(np.bincount(picked, minlength=5) / n, expected, atol=atol)


def test_seeded_sampling_depends_only_on_seed_and_step(kernels):
    logits = RNG.standard_normal((8, 1000)).astype(np.float32)
    p = [SamplingParams(temperature=1.0)] * 8
    a = sample_gpu(kernels, logits, p, [7] * 8, [3] * 8)
    assert np.array_equal(a, sample_gpu(kernels, logits, p, [7] * 8, [3] * 8))
    rows_same = np.tile(logits[:1], (8, 1))
    b = sample_gpu(kernels, rows_same, p, [7] * 8, [3] * 8)
    assert len(set(b.tolist())) == 1  # same logits, seed and step: same token in any row
    c = sample_gpu(kernels, rows_same, p, [7] * 8, list(range(8)))
    assert len(set(c.tolist())) > 1  # steps differ: draws differ


def test_penalties_match_the_cpu_sampler(kernels):
    V = 1000
    logits = RNG.standard_normal((2, V)).astype(np.float32) * 3
    prompt, output = [5, 6, 7, 7], [7, 8, 8, 9]
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    seen = sorted(set(prompt + output))
    counts = [output.count(t) for t in seen]
    entries = dict(row=[1] * len(seen) + [0], token=seen + [42], count=counts + [0], banned=[0] * len(seen) + [1])
    g = gpuarray.to_gpu(logits)
    f32 = lambda v: gpuarray.to_gpu(np.asarray(v, np.float32))  # noqa: E731
    kernels.apply_penalties(None, g, V, len(seen) + 1, i32(entries["row"]), i32(entries["token"]), i32(entries["count"]),
                            i32(entries["banned"]), f32([1.0, 1.3]), f32([0.0, 0.4]), f32([0.0, 0.2]))
    got = g.get()
    assert np.allclose(got[1], apply_penalties(logits[1].astype(np.float64), params, prompt, output), atol=1e-5)
    assert got[0, 42] == -np.inf and np.array_equal(np.delete(got[0], 42), np.delete(logits[0], 42))


@pytest.mark.parametrize("vocab", [1000, 128256, 49153])
def test_token_bitmask_matches_the_cpu_sampler(kernels, vocab):
    """The listed rows keep exactly the tokens their mask allows (the numpy sampler's
    unpack_bitmask is the oracle); other rows are untouched."""
    from engine.sampler import unpack_bitmask

    words = -(-vocab // 32)
    logits = RNG.standard_normal((4, vocab)).astype(np.float32)
    masks = RNG.integers(-2**31, 2**31, (2, words), dtype=np.int64).astype(np.int32)
    masks[0, : words // 2] = -1  # (words with every bit set take the short path)
    rows = [3, 1]
    g = gpuarray.to_gpu(logits)
    kernels.apply_token_bitmask(None, g, gpuarray.to_gpu(masks), i32(rows), 2, words, vocab)
    got = g.get()
    for mask, row in zip(masks, rows):
        expected = np.where(unpack_bitmask(mask, vocab), logits[row], -np.inf)
        assert np.array_equal(got[row], expected)
    assert np.array_equal(got[[0, 2]], logits[[0, 2]])

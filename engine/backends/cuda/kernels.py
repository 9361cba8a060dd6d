"""The kernels of cuda_src/ as the host sees them: compiled for the device, each with
one launcher that names its arguments and computes its own grid and block.

The launch geometry that must agree with the .cu files is kept here as constants (each
says where its twin is; tests/kernels/test_kernel_contract.py checks them, and the
argument types, against the sources). Imports without PyCUDA, for those tests.

Pointer arguments take a GPUArray, a device allocation, an address or None (a null
pointer); `stream` is a PyCUDA Stream, or None for the default stream.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.quantization.kv_cache import KvScale

CUDA_SRC = Path(__file__).resolve().parents[3] / "cuda_src"
ATTENTION_THREADS = 128  # WARPS * 32 in attention.cu
PREFILL_THREADS, PREFILL_M_TILE = 256, 128  # as in attention.cu
MAX_PART_BLOCKS = 512  # as in attention.cu
WHOLE_CONTEXT = 2**30  # a partition longer than any context
GEMV_WARPS = 8  # as in gemv.cu
GEMV_UNROLL = 8  # a lane's 16-byte loads in flight (UNROLL in gemv.cu)
GEMV_SLICE = 2048  # bfloat16 columns of one warp's loads (SPAN * UNROLL in gemv.cu)
GEMV_COLUMNS = {"bf16": 8, "fp8": 16, "int4": 32}  # weights in a lane's 16-byte load, by format (COLS in weights.cuh)
FEWEST_ROW_LANES = {"bf16": 32, "fp8": 16, "int4": 32}  # the fewest lanes a row takes (row_lanes in gemv.cu)
SAMPLE_CLUSTER, SAMPLE_THREADS = 8, 1024  # blocks a row and threads a block of sample_tokens (sampling.cu)
STAGED_INPUT_BYTES = 47 * 1024  # gemv.cu's staged input: 48 KB a block takes without opting in, less its static shared memory
ROW_STASH_BYTES = 47 * 1024  # the row add_rmsnorm and silu_and_mul_e4m3 hold in shared memory to quantize it (the same 48 KB)
ROW_THREADS = 256  # the block of the row-wise kernels (embedding, add_rmsnorm, silu_and_mul, apply_penalties)
WIDE_ROW_THREADS = 512  # silu_and_mul_e4m3's block, a row of intermediate_size (8,192 at the 1B shape) each
SKINNY_THREADS, SKINNY_ROWS, SKINNY_MAX_ROWS = 128, 64, 64  # skinny_gemm.cu's block, its rows of w, and of x at most
SKINNY_X_OFFSET = {"bf16": 64, "fp8": 16}  # bytes a staged row of x takes past a multiple of 128 (skinny_gemm.cu)
SKINNY_MAX_SHARED = 227 * 1024  # the shared memory a block may opt into (sm_90)
SKINNY_SPLITS = (1, 2, 4, 8)  # the cluster sizes skinny_gemm.cu is built for (its kernels' _sN)

SIGNATURES = {  # kernel: (source file, PyCUDA's argument types: P pointer, i int, f float)
    "embedding_gather": ("embedding.cu", "PPPPi"),
    "add_rmsnorm": ("rmsnorm.cu", "PPPPPPPPif"),
    "head_rmsnorm": ("rmsnorm.cu", "PPPiif"),
    "rope_cos_sin": ("rope_cache.cu", "PPi"),
    "rope_and_cache": ("rope_cache.cu", "PPPPPPPPiiiiff"),
    **{name: ("attention.cu", "PPPPPPPPPiPPiiiiff") for name in ("paged_attention_partial", "paged_attention_partial_prefetch")},
    "paged_attention_merge": ("attention.cu", "PPPPPiiif"),
    "prefill_attention_partial": ("attention.cu", "PPPPPPPPiPPPiiiiff"),
    "silu_and_mul": ("activation.cu", "PPi"),
    "gemv": ("gemv.cu", "PiPPii"),
    "gemv_add": ("gemv.cu", "PPPii"),
    "gemv_rmsnorm_rope": ("gemv.cu", "PPPfPPPPPPiiiiffii"),
    "gemv_rmsnorm_silu": ("gemv.cu", "PPPfPii"),
    **{f"gemv{suffix}": ("gemv.cu", "PiPPPiii") for suffix in ("_fp8", "_int4")},
    **{f"gemv_add{suffix}": ("gemv.cu", "PPPPiii") for suffix in ("_fp8", "_int4")},
    **{f"gemv_rmsnorm_rope{suffix}": ("gemv.cu", "PPPfPPiPPPPPiiiiffii") for suffix in ("_fp8", "_int4")},
    **{f"gemv_rmsnorm_silu{suffix}": ("gemv.cu", "PPPfPPiii") for suffix in ("_fp8", "_int4")},
    **{f"dequantize{suffix}": ("gemv.cu", "PPPiiii") for suffix in ("_fp8", "_int4")},
    **{f"skinny_gemm_s{n}": ("skinny_gemm.cu", "PiPiPii") for n in SKINNY_SPLITS},
    **{f"skinny_gemm_fp8_s{n}": ("skinny_gemm.cu", "PiPiPPiii") for n in SKINNY_SPLITS},
    "quantize_rows_e4m3": ("fp8_activations.cu", "PPPi"),
    "scale_rows_and_cols": ("fp8_activations.cu", "PiPPi"),
    "silu_and_mul_e4m3": ("fp8_activations.cu", "PPPPPi"),
    "apply_penalties": ("sampling.cu", "PiiPPPPPPP"),
    "apply_token_bitmask": ("sampling.cu", "PPPii"),
    "sample_tokens": ("sampling.cu", "PPiPPPPPPP"),
}
_NULL = np.uintp(0)


def ptr(a: Any) -> np.uintp:
    """A pointer argument from a GPUArray (null where it is empty: PyCUDA allocates
    nothing for it), an allocation, an address or None."""
    if a is None:
        return _NULL
    if isinstance(a, np.uintp):
        return a
    if hasattr(a, "gpudata"):
        return _NULL if a.gpudata is None else np.uintp(int(a.gpudata))
    return np.uintp(int(a))


def prefill_query_rows(group: int) -> int:
    """Query positions per prefill_attention block (Q_POS in attention.cu)."""
    return PREFILL_M_TILE // group


def nvcc_target(arch: str) -> dict[str, str]:
    """SourceModule's `arch` and `code` for a device's "sm_XY": on Hopper, sm_90a, whose
    wgmma instructions prompt attention takes (wgmma.cuh); the architecture itself elsewhere."""
    return {"arch": "compute_90a", "code": "sm_90a"} if arch == "sm_90" else {"arch": arch}


def rope_and_cache_threads(heads: int, kv_heads: int, head_dim: int) -> int:
    """rope_and_cache's block: a thread per rotated pair of q and k, at most 1024 (it loops)."""
    return min(1024, (heads + kv_heads) * head_dim // 2)


def blocks_per_sm(registers: int, threads: int) -> int:
    """Blocks of a kernel an SM holds at once as its registers allow (64K an SM,
    allocated 8 a thread at a time; 2,048 threads an SM)."""
    regs = -(-registers // 8) * 8
    return max(1, min(65536 // (regs * threads), 2048 // threads))


def gemv_split(d_in: int, format: str = "bf16") -> int:
    """Warps a gemv.cu weight row is split over (gemv_split there): a power of two,
    each slice at least GEMV_SLICE columns (times the weights a load holds over 8)."""
    split, slice_columns = 1, GEMV_SLICE * GEMV_COLUMNS[format] // 8
    while split < GEMV_WARPS and d_in >= 2 * split * slice_columns:
        split *= 2
    return split


def gemv_row_lanes(d_in: int, format: str = "bf16") -> int:
    """Lanes a gemv.cu weight row takes (row_lanes there): a warp, or for a quantized row
    that fewer lanes' UNROLL loads cover, as few as that (FEWEST_ROW_LANES at least)."""
    lanes = 32
    while lanes > FEWEST_ROW_LANES[format] and d_in <= lanes // 2 * GEMV_COLUMNS[format] * GEMV_UNROLL:
        lanes //= 2
    return lanes


@functools.cache  # (asked at every launch: a step's host time)
def gemv_rows_per_block(d_in: int, format: str = "bf16") -> int:
    """Output rows a gemv.cu block computes at once: a row per group of gemv_split warps,
    or 32 / gemv_row_lanes a warp for rows narrower than a warp."""
    lanes = gemv_row_lanes(d_in, format)
    return GEMV_WARPS * 32 // lanes if lanes < 32 else GEMV_WARPS // gemv_split(d_in, format)


@functools.cache  # (asked at every launch: a step's host time)
def skinny_shared_bytes(rows: int, width: int, format: str) -> int:
    """skinny_gemm.cu's dynamic shared memory: x's rows (16 a tile) over a slice `width`
    columns wide (x_stride there), and at least the partial sums' rows."""
    x_rows = 16 * -(-rows // 16)
    stride = width + (SKINNY_X_OFFSET[format] - 2 * width) % 128 // 2
    return max(x_rows * stride * 2, x_rows * (SKINNY_ROWS + 4) * 4)


def skinny_splits(rows: int, d_in: int, format: str = "bf16") -> list[int]:
    """The slices skinny_gemm.cu may split a product's d_in columns into: each a whole
    number of chunks (4 loads of GEMV_COLUMNS weights), with x's rows over it in a
    block's shared memory."""
    return [n for n in SKINNY_SPLITS if d_in % (n * 4 * GEMV_COLUMNS[format]) == 0
            and skinny_shared_bytes(rows, d_in // n, format) <= SKINNY_MAX_SHARED]


@functools.cache
def skinny_split(rows: int, d_in: int, d_out: int, format: str, sm_count: int) -> int | None:
    """Slices of a skinny_gemm.cu product: the fewest that give every SM two blocks,
    else the most there are (None: none). (For the 1B shape's matrices at up to 32 rows,
    bench/skinny_gemm.py's table has this the fastest split or within 11% of it, but
    for the FP8 QKV projection's 8, where 4 takes 7 to 26% less time.)"""
    groups, splits = -(-d_out // SKINNY_ROWS), skinny_splits(rows, d_in, format)
    return next((n for n in splits if groups * n >= 2 * sm_count), splits[-1] if splits else None)


def gemv_weight(w: Any) -> tuple[str, tuple]:
    """A GEMV's weight arguments: (the kernel's suffix for its format, the arguments in
    place of `w`) for a LinearWeight (engine/backends/cuda/linear.py), or a bfloat16
    weight given as an array or a pointer."""
    fmt = getattr(w, "format", "bf16")
    if fmt == "bf16":
        return "", (ptr(getattr(w, "data", w)),)
    if fmt in ("fp8", "int4"):
        return f"_{fmt}", (ptr(w.data), ptr(w.scale), np.int32(w.scale_cols))
    raise ValueError(f"no GEMV for {fmt} weights")


def block_shift(block_size: int) -> int:
    """log2 of a KV-cache block size, which the attention kernels need to be a power of two."""
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"the CUDA backend's KV-cache blocks hold a power of two of tokens, not {block_size}: "
                         f"use --block-size {1 << max(0, block_size.bit_length() - 1)} or "
                         f"{1 << block_size.bit_length()}")
    return block_size.bit_length() - 1


@dataclass(frozen=True)
class PagedAttention:
    """What the attention kernels of one step read and write besides a layer's cache
    (attention.cu): per-partition partial results, the fused projection with q rotated,
    and the step's metadata."""

    part_acc: Any  # float32 [tokens, heads, partitions, head_dim]
    part_max: Any  # float32 [tokens, heads, partitions]
    part_sum: Any
    qkv: Any
    block_tables: Any  # int32 [seqs, max_blocks]
    max_blocks: int
    token_seq: Any  # int32 [tokens]: the block-table row of each token
    positions: Any  # int32 [tokens]
    heads: int
    kv_heads: int
    block_size: int  # a power of two (the kernels take its log2)
    partition: int  # context positions per partition
    partitions: int
    scale: float

    def inputs(self, k_cache, v_cache) -> tuple:
        """The partial kernels' arguments from part_acc to positions, over a layer's cache."""
        return (*self.results, self._qkv, ptr(k_cache), ptr(v_cache), *self._table)

    @functools.cached_property
    def results(self) -> tuple:
        """Pointers to part_acc, part_max and part_sum."""
        return ptr(self.part_acc), ptr(self.part_max), ptr(self.part_sum)

    @functools.cached_property
    def _qkv(self) -> np.uintp:
        return ptr(self.qkv)

    @functools.cached_property
    def _table(self) -> tuple:
        return ptr(self.block_tables), np.int32(self.max_blocks), ptr(self.token_seq), ptr(self.positions)

    @functools.cached_property
    def sizes(self) -> tuple:
        return self._sizes(self.partition)

    @functools.cached_property
    def whole_context_sizes(self) -> tuple:
        """The sizes with one partition longer than any context."""
        return self._sizes(WHOLE_CONTEXT)

    def _sizes(self, partition: int) -> tuple:
        return np.int32(self.heads), np.int32(self.kv_heads), np.int32(block_shift(self.block_size)), np.int32(partition)

    def scales(self, kv_scale: KvScale) -> tuple:
        """The kernels' last arguments over a layer's cache: the softmax's scale times its
        keys' cache scale, and its values' (attention.cu)."""
        return np.float32(self.scale * kv_scale.k), np.float32(kv_scale.v)


@dataclass(frozen=True)
class SumScales:
    """What scales a W8A8 product's sums back (fp8_activations.cu): each token's
    activation scale (`rows`, float32 [tokens]) and each weight row's (`cols`)."""

    rows: Any
    cols: Any

    @staticmethod
    def pointers(scales: "SumScales | None") -> tuple[np.uintp, np.uintp]:
        """A kernel's (row_scales, col_scales) arguments: nulls where the sums are plain values."""
        return (_NULL, _NULL) if scales is None else (ptr(scales.rows), ptr(scales.cols))


class Kernels:
    """The kernels of cuda_src/, compiled for this device (HEAD_DIM and GROUP are
    compile-time constants, and so is the KV cache's element: bfloat16, or e4m3 codes
    where `kv_cache_fp8`), each launched by the method of its name. `programmatic`
    builds them to await their predecessor in-kernel (common.cuh), for CUDA graphs whose
    edges into them are programmatic; eager launches take the plain build. `functions`
    holds the prepared PyCUDA functions, by name (benchmarks wrap them to time launches).
    `sources` is where the .cu files are read from (benchmarks compare other versions)."""

    def __init__(self, head_dim: int, group: int, arch: str, sm_count: int, kv_cache_fp8: bool = False,
                 programmatic: bool = False, sources: Path = CUDA_SRC):
        import pycuda.driver as cuda
        from pycuda.compiler import SourceModule

        self.head_dim, self.sm_count = head_dim, sm_count
        modules, self.functions, self._resident = {}, {}, {}
        options = (["-O3", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}"] + (["-DKV_CACHE_FP8"] if kv_cache_fp8 else [])
                   + (["-DPROGRAMMATIC_LAUNCH"] if programmatic else []))
        target = nvcc_target(arch)
        for name, (file, signature) in SIGNATURES.items():
            if file not in modules:
                modules[file] = SourceModule((sources / file).read_text(), no_extern_c=True, options=options,
                                             include_dirs=[str(sources.resolve())], **target)  # (nvcc runs elsewhere)
            fn = modules[file].get_function(name)
            fn.prepare(signature)
            if file == "skinny_gemm.cu":  # (over the 48 KB a block takes without opting in)
                fn.set_attribute(cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, SKINNY_MAX_SHARED)
            self.functions[name] = fn
            # (PyCUDA asks the driver at every read of num_regs: the GEMVs' grids need it every launch)
            self._resident[name] = sm_count * blocks_per_sm(fn.num_regs, 32 * GEMV_WARPS)

    # -- embedding.cu -------------------------------------------------------------------
    def embedding_gather(self, stream, residual, table, ids, sampled, tokens: int, hidden: int) -> None:
        """residual[t] = table[ids[t]] in float32; ids[t] = -(i + 1) names sampled[i]."""
        self.functions["embedding_gather"].prepared_async_call(
            (tokens, 1), (ROW_THREADS, 1, 1), stream, ptr(residual), ptr(table), ptr(ids), ptr(sampled), np.int32(hidden))

    # -- rmsnorm.cu ---------------------------------------------------------------------
    def add_rmsnorm(self, stream, residual, delta, weight, out, rows, num_rows: int, hidden: int, eps: float,
                    delta_scales: SumScales | None = None, out_scales=None) -> None:
        """residual[r] += delta[r] (unless delta is None; a W8A8 product's sums scaled back
        by `delta_scales`), then out[i] = RMSNorm(residual[r]) for each r = rows[i] of the
        num_rows listed: bfloat16, or e4m3 codes a row with their scales in `out_scales`."""
        self.functions["add_rmsnorm"].prepared_async_call(
            (num_rows, 1), (ROW_THREADS, 1, 1), stream, ptr(residual), ptr(delta), *SumScales.pointers(delta_scales),
            ptr(weight), ptr(out), ptr(out_scales), ptr(rows), np.int32(hidden), np.float32(eps),
            shared_size=0 if out_scales is None else 2 * hidden)

    def head_rmsnorm(self, stream, qkv, q_weight, k_weight, tokens: int, heads: int, kv_heads: int, eps: float) -> None:
        """Each query and key head of the fused projection RMS-normalised in place (Qwen3)."""
        self.functions["head_rmsnorm"].prepared_async_call(
            (tokens, heads + kv_heads), (32, 1, 1), stream, ptr(qkv), ptr(q_weight), ptr(k_weight), np.int32(heads),
            np.int32(kv_heads), np.float32(eps))

    # -- rope_cache.cu ------------------------------------------------------------------
    def rope_cos_sin(self, stream, table, inv_freq, positions: int) -> None:
        """table[p, i] = (cos, sin) of p * inv_freq[i], for p < positions."""
        half = self.head_dim // 2
        self.functions["rope_cos_sin"].prepared_async_call((positions, 1), (half, 1, 1), stream, ptr(table), ptr(inv_freq),
                                                           np.int32(half))

    def rope_and_cache(self, stream, qkv, k_cache, v_cache, positions, slots, cos_sin, tokens: int, heads: int,
                       kv_heads: int, block_shift: int, kv_scale: KvScale = KvScale(),
                       qkv_scales: SumScales | None = None) -> None:
        """q rotated in place; rotated k and plain v written to cache slot slots[t] (caches
        of blocks of 2^block_shift slots: KvCache; an FP8 one over the layer's kv_scale).
        With `qkv_scales`, qkv holds a W8A8 product's sums, scaled back as they are read."""
        threads = rope_and_cache_threads(heads, kv_heads, self.head_dim)
        self.functions["rope_and_cache"].prepared_async_call(
            (tokens, 1), (threads, 1, 1), stream, ptr(qkv), *SumScales.pointers(qkv_scales), ptr(k_cache), ptr(v_cache),
            ptr(positions), ptr(slots),
            ptr(cos_sin), np.int32(heads), np.int32(kv_heads), np.int32(self.head_dim), np.int32(block_shift),
            *kv_scale.inverses)  # (the bfloat16 build leaves them unread)

    # -- attention.cu -------------------------------------------------------------------
    def paged_attention_partial(self, stream, out, arrivals, attention: PagedAttention, k_cache, v_cache,
                                rows: int, prefetch: bool = False, kv_scale: KvScale = KvScale()) -> None:
        """Decode attention of the step's first `rows` tokens over a layer's cache, a block
        per (token, KV head, partition), into the partial results; with `arrivals` (zeros,
        [rows, kv_heads]) the last block of each (token, KV head) merges them into out itself.
        With `prefetch`, each warp loads its next chunk of the context while it computes one."""
        name = "paged_attention_partial_prefetch" if prefetch else "paged_attention_partial"
        self.functions[name].prepared_async_call(
            (rows, attention.kv_heads, attention.partitions), (ATTENTION_THREADS, 1, 1), stream, ptr(out), ptr(arrivals),
            *attention.inputs(k_cache, v_cache), *attention.sizes, *attention.scales(kv_scale))

    def prefill_attention_partial(self, stream, out, attention: PagedAttention, k_cache, v_cache, tiles,
                                  num_tiles: int, kv_scale: KvScale = KvScale()) -> None:
        """Prompt attention over a layer's cache by query tiles ((first row, rows) pairs in
        `tiles`), a block per (tile, KV head, partition), into the partial results; or,
        given `out`, a block per (tile, KV head) over the tile's whole context, into out."""
        partitions, sizes = (attention.partitions, attention.sizes) if out is None else (1, attention.whole_context_sizes)
        self.functions["prefill_attention_partial"].prepared_async_call(
            (num_tiles, attention.kv_heads, partitions), (PREFILL_THREADS, 1, 1), stream, ptr(out),
            *attention.inputs(k_cache, v_cache), ptr(tiles), *sizes, *attention.scales(kv_scale))

    def paged_attention_merge(self, stream, out, attention: PagedAttention, tokens: int, decode_rows: int,
                              kv_scale: KvScale = KvScale()) -> None:
        """out[t, h] = the partial results of the partitions token t's context spans, merged
        (times the layer's V cache scale), for t < `tokens`; of the first `decode_rows`
        (paged_attention_partial's) only those that span several partitions: the decode
        kernel stored the others."""
        a = attention
        self.functions["paged_attention_merge"].prepared_async_call(
            (tokens, a.kv_heads), (self.head_dim, a.heads // a.kv_heads, 1), stream, ptr(out), *a.results, ptr(a.positions),
            np.int32(a.partition), np.int32(a.partitions), np.int32(decode_rows), np.float32(kv_scale.v))

    # -- activation.cu ------------------------------------------------------------------
    def silu_and_mul(self, stream, out, gate_up, tokens: int, inter: int) -> None:
        """out = silu(gate) * up for gate_up = [gate | up]."""
        self.functions["silu_and_mul"].prepared_async_call(
            (-(-inter // (8 * ROW_THREADS)), tokens), (ROW_THREADS, 1, 1), stream, ptr(out), ptr(gate_up), np.int32(inter))

    # -- gemv.cu: one token's products, as many blocks as are resident at once ----------
    # `w` is a LinearWeight (bfloat16 or FP8: the kernel of its format), or a bfloat16
    # weight as an array or a pointer.
    def _gemv(self, name: str, stream, w, d_in: int, d_out: int, staged_bytes: int, blocks: int | None, before: tuple,
              after: tuple = ()) -> None:
        """Each block's warps take weight rows in turn; `blocks` overrides the grid (tests)."""
        suffix, weight = gemv_weight(w)
        name += suffix
        if blocks is None:
            blocks = min(-(-d_out // gemv_rows_per_block(d_in, suffix[1:] or "bf16")), self._resident[name])
        self.functions[name].prepared_async_call((blocks, 1), (32 * GEMV_WARPS, 1, 1), stream, *before, *weight, *after,
                                                 np.int32(d_in), np.int32(d_out), shared_size=staged_bytes)

    def gemv(self, stream, y, x, w, d_in: int, d_out: int, out_f32: bool = False, blocks: int | None = None) -> None:
        """y = x @ w^T for one row x (y float32 if out_f32, else bfloat16)."""
        self._gemv("gemv", stream, w, d_in, d_out, 0, blocks, (ptr(y), np.int32(out_f32), ptr(x)))

    def gemv_add(self, stream, residual, x, w, d_in: int, d_out: int, blocks: int | None = None) -> None:
        """residual += x @ w^T for one row x."""
        self._gemv("gemv_add", stream, w, d_in, d_out, 0, blocks, (ptr(residual), ptr(x)))

    def gemv_rmsnorm_rope(self, stream, qkv, residual, norm_weight, eps: float, w, k_cache, v_cache, positions, slots,
                          cos_sin, heads: int, kv_heads: int, block_shift: int, hidden: int,
                          blocks: int | None = None, kv_scale: KvScale = KvScale()) -> None:
        """qkv = RMSNorm(residual) @ w^T, then rope_and_cache's work on it."""
        width = (heads + 2 * kv_heads) * self.head_dim
        self._gemv("gemv_rmsnorm_rope", stream, w, hidden, width // 2, 2 * hidden, blocks,
                   (ptr(qkv), ptr(residual), ptr(norm_weight), np.float32(eps)),
                   (ptr(k_cache), ptr(v_cache), ptr(positions), ptr(slots), ptr(cos_sin), np.int32(heads),
                    np.int32(kv_heads), np.int32(self.head_dim), np.int32(block_shift), *kv_scale.inverses))

    def gemv_rmsnorm_silu(self, stream, act, residual, norm_weight, eps: float, w, hidden: int, inter: int,
                          blocks: int | None = None) -> None:
        """act = silu_and_mul(RMSNorm(residual) @ w^T), w = [gate | up] of 2 * inter rows."""
        self._gemv("gemv_rmsnorm_silu", stream, w, hidden, inter, 2 * hidden, blocks,
                   (ptr(act), ptr(residual), ptr(norm_weight), np.float32(eps)))

    def dequantize(self, stream, out, w, first_row: int, rows: int) -> None:
        """out[r - first_row] = bf16(w's row r dequantized), for rows [first_row, first_row + rows)
        of the FP8 or INT4 LinearWeight w: a thread per 16-byte piece of codes, as many
        blocks as are resident."""
        threads, pieces = ROW_THREADS, rows * w.d_in // GEMV_COLUMNS[w.format]
        blocks = max(1, min(-(-pieces // threads), 8 * self.sm_count))
        self.functions[f"dequantize_{w.format}"].prepared_async_call(
            (blocks, 1), (threads, 1, 1), stream, ptr(out), ptr(w.data), ptr(w.scale), np.int32(w.scale_cols),
            np.int32(first_row), np.int32(rows), np.int32(w.d_in))

    # -- skinny_gemm.cu ------------------------------------------------------------------
    def skinny_gemm(self, stream, y, x, w, rows: int, d_in: int, d_out: int, out_f32: bool = False,
                    split: int | None = None) -> None:
        """y = x @ w^T for 2 to SKINNY_MAX_ROWS rows x on tensor cores, over `split`
        slices of d_in (skinny_split's unless given)."""
        suffix, weight = gemv_weight(w)
        format = suffix[1:] or "bf16"
        split = split or skinny_split(rows, d_in, d_out, format, self.sm_count)
        self.functions[f"skinny_gemm{suffix}_s{split}"].prepared_async_call(
            (-(-d_out // SKINNY_ROWS), split), (SKINNY_THREADS, 1, 1), stream, ptr(y), np.int32(out_f32), ptr(x),
            np.int32(rows), *weight, np.int32(d_in), np.int32(d_out),
            shared_size=skinny_shared_bytes(rows, d_in // split, format))

    # -- fp8_activations.cu: the two ends of a W8A8 product (linear.py) -----------------
    def quantize_rows_e4m3(self, stream, codes, scales, x, rows: int, d_in: int) -> None:
        """codes[t] = e4m3(x[t] / scales[t]), scales[t] = max |x[t]| / 448: a block a row."""
        self.functions["quantize_rows_e4m3"].prepared_async_call(
            (rows, 1), (ROW_THREADS, 1, 1), stream, ptr(codes), ptr(scales), ptr(x), np.int32(d_in))

    def silu_and_mul_e4m3(self, stream, codes, scales, gate_up, tokens: int, inter: int,
                          gate_up_scales: SumScales | None = None) -> None:
        """codes[t] = e4m3(silu(gate) * up / scales[t]) for gate_up = [gate | up] (a W8A8
        product's sums scaled back by `gate_up_scales`), scales[t] = max |silu(gate) * up| / 448."""
        self.functions["silu_and_mul_e4m3"].prepared_async_call(
            (tokens, 1), (WIDE_ROW_THREADS, 1, 1), stream, ptr(codes), ptr(scales), ptr(gate_up),
            *SumScales.pointers(gate_up_scales), np.int32(inter), shared_size=2 * inter)

    def scale_rows_and_cols(self, stream, y, row_scales, col_scales, rows: int, cols: int, y_f32: bool = False) -> None:
        """y[t, o] *= row_scales[t] * col_scales[o], y bfloat16 (float32 if y_f32)."""
        self.functions["scale_rows_and_cols"].prepared_async_call(
            (-(-cols // (8 * ROW_THREADS)), rows), (ROW_THREADS, 1, 1), stream, ptr(y), np.int32(y_f32), ptr(row_scales),
            ptr(col_scales), np.int32(cols))

    # -- sampling.cu --------------------------------------------------------------------
    def apply_penalties(self, stream, logits, vocab: int, entries: int, entry_row, entry_token, entry_count, entry_banned,
                        repetition, presence, frequency) -> None:
        """Repetition, presence and frequency penalties and bans, one thread per listed
        (row, token) entry; the penalties per row."""
        self.functions["apply_penalties"].prepared_async_call(
            (-(-entries // ROW_THREADS), 1), (ROW_THREADS, 1, 1), stream, ptr(logits), np.int32(vocab), np.int32(entries),
            ptr(entry_row), ptr(entry_token), ptr(entry_count), ptr(entry_banned), ptr(repetition), ptr(presence),
            ptr(frequency))

    def apply_token_bitmask(self, stream, logits, masks, rows, n: int, words: int, vocab: int) -> None:
        """logits[rows[r]] keeps only the tokens mask row r allows (n rows of `words` int32
        words), the others -inf: a thread per word."""
        self.functions["apply_token_bitmask"].prepared_async_call(
            (-(-words // ROW_THREADS), n), (ROW_THREADS, 1, 1), stream, ptr(logits), ptr(masks), ptr(rows),
            np.int32(words), np.int32(vocab))

    def sample_tokens(self, stream, out, logits, rows: int, vocab: int, temperature, top_p, top_k, min_p, seed_lo, seed_hi,
                      step) -> None:
        """out[r] = a token drawn from row r (greedy at temperature 0), a cluster of blocks a row."""
        self.functions["sample_tokens"].prepared_async_call(
            (SAMPLE_CLUSTER, rows), (SAMPLE_THREADS, 1, 1), stream, ptr(out), ptr(logits), np.int32(vocab),
            ptr(temperature), ptr(top_p), ptr(top_k), ptr(min_p), ptr(seed_lo), ptr(seed_hi), ptr(step))

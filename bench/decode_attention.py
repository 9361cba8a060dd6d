"""Decode attention alone (paged_attention_partial, then paged_attention_merge for the
tokens whose context spans several partitions, or the decode kernel merging them
itself, as in steps of decode tokens alone; each warp loading one chunk of the context
at a time, or the next one ahead while it computes, as small decodes past 4,096
positions do): the K/V bytes it reads per second against the bandwidth floor, at the
Llama 3.2 1B shape (32 query heads, 8 KV heads, head_dim 64, 16-token blocks scattered
over the cache, or others with --block-sizes), for a few batches and the engine's
1024-, 512- and 128-position partitions (and 64 and 256 for comparison: at small
batches shorter partitions give more blocks and shorter chains of loads).
`--kv-cache-dtype fp8` times the kernels built for an e4m3 cache (half the bytes; each
code widened to float16 as it is read). Each batch's first row reads the same bytes
through the block tables and does nothing else (read_kv): what the scattered blocks
allow, where its one thread block per (sequence, KV head) fills the GPU (the batches
of 64 and 256).

    python bench/decode_attention.py [--sources DIR] [--kv-cache-dtype auto|fp8]
                                     [--block-sizes 16,32] [--partitions 512,1024]   # on a machine with an NVIDIA GPU

--sources compiles another version of cuda_src/ whose kernels take the arguments the
launchers of engine/backends/cuda/kernels.py pass, e.g. an earlier commit's:
`mkdir /tmp/old && git archive COMMIT cuda_src | tar -x -C /tmp/old`, then `--sources /tmp/old/cuda_src`.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pycuda.autoprimaryctx  # noqa: F401
import pycuda.driver as cuda
import pycuda.gpuarray as gpuarray
from pycuda.compiler import SourceModule

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.floors import BANDWIDTH  # noqa: E402
from engine.backends.base import KV_CACHE_DTYPES, is_fp8_kv_cache  # noqa: E402
from engine.backends.cuda.kernels import CUDA_SRC, Kernels, PagedAttention  # noqa: E402
from engine.weights import f32_to_bf16_bits  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16
REPEATS = 30
# A kernel that holds the GPU for ~10 ms while the host queues the timed launches:
# without it a small case times PyCUDA's launch calls (~30 us each), not the kernel.
SPIN_SOURCE = """extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}"""
SPIN_CYCLES = 20_000_000
# What the cache's layout allows: a block per (token, KV head) reading each position's
# K and V rows of its context through the block table, 16 bytes a thread, 4 loads in
# flight, and nothing else (a word of their xor is stored only if it matches, so that
# the loads stay).
READ_SOURCE = """extern "C" __global__ void read_kv(const uint4* k, const uint4* v, const int* tables, int max_blocks,
                                    const int* positions, int kv_heads, int block_shift, int row_vectors, int* sink) {
    const int t = blockIdx.x, kvh = blockIdx.y, vectors = (positions[t] + 1) * row_vectors;
    const int* table = tables + (size_t)t * max_blocks;
    unsigned int x = 0;
    for (int i = threadIdx.x; i < vectors; i += 4 * blockDim.x) {
        uint4 w[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int j = min(i + u * (int)blockDim.x, vectors - 1), pos = j / row_vectors;
            const size_t row = ((size_t)(table[pos >> block_shift] * kv_heads + kvh) << block_shift)
                               + (pos & ((1 << block_shift) - 1));
            w[u] = k[row * row_vectors + j % row_vectors];
            x ^= w[u].x ^ w[u].y ^ w[u].z ^ w[u].w;
            w[u] = v[row * row_vectors + j % row_vectors];
            x ^= w[u].x ^ w[u].y ^ w[u].z ^ w[u].w;
        }
    }
    if (x == 0x9e3779b9u) *sink = x;
}"""


def inputs(contexts: list[int], rng: np.random.Generator, fp8: bool, block: int) -> dict:
    """Random bf16 Q and cache (e4m3 codes where `fp8`) in blocks of `block` positions,
    each sequence's drawn from a shuffled pool."""
    blocks = np.array([-(-c // block) for c in contexts])
    pool, ends = rng.permutation(blocks.sum()), np.cumsum(blocks)
    tables = np.zeros((len(contexts), blocks.max()), np.int32)
    for i, (n, end) in enumerate(zip(blocks, ends)):
        tables[i, :n] = pool[end - n : end]
    cache_shape = (int(blocks.sum()), KV_HEADS, block, HEAD_DIM)  # (engine/backends/cuda/buffers.py's KvCache)

    def bf16(shape: tuple[int, ...]) -> gpuarray.GPUArray:
        return gpuarray.to_gpu(f32_to_bf16_bits(rng.standard_normal(shape, np.float32)))

    def cache() -> gpuarray.GPUArray:
        if not fp8:
            return bf16(cache_shape)
        # (e4m3 codes 0x00..0x47 of either sign: magnitudes 0 to 3.75)
        sign = rng.integers(0, 2, cache_shape, np.uint8) << 7
        return gpuarray.to_gpu(rng.integers(0, 0x48, cache_shape, np.uint8) | sign)
    return {
        "qkv": bf16((len(contexts), (HEADS + 2 * KV_HEADS) * HEAD_DIM)),
        "k": cache(), "v": cache(),
        "tables": gpuarray.to_gpu(tables), "max_blocks": tables.shape[1],
        "token_seq": gpuarray.to_gpu(np.arange(len(contexts), dtype=np.int32)),
        "positions": gpuarray.to_gpu(np.array(contexts, np.int32) - 1),
        "bytes": sum(contexts) * KV_HEADS * HEAD_DIM * 2 * (1 if fp8 else 2),
        "longest": max(contexts), "tokens": len(contexts), "block": block,
    }


def time_attention(kernels: Kernels, spin, x: dict, partition: int, merge_in_kernel: bool, prefetch: bool) -> float:
    """Mean GPU time of one step's decode attention, in seconds (the launches queued
    behind `spin`)."""
    P, T = math.ceil(x["longest"] / partition), x["tokens"]
    acc, m, s = (gpuarray.empty(shape, np.float32) for shape in ((T, HEADS, P, HEAD_DIM), (T, HEADS, P), (T, HEADS, P)))
    out, arrivals = gpuarray.empty((T, HEADS * HEAD_DIM), np.uint16), gpuarray.zeros((T, KV_HEADS), np.int32)
    attention = PagedAttention(acc, m, s, x["qkv"], x["tables"], x["max_blocks"], x["token_seq"], x["positions"], HEADS,
                               KV_HEADS, x["block"], partition, P, HEAD_DIM ** -0.5)

    def launch() -> None:
        kernels.paged_attention_partial(None, out, arrivals if merge_in_kernel else None, attention, x["k"], x["v"], T,
                                        prefetch=prefetch)
        if not merge_in_kernel:
            kernels.paged_attention_merge(None, out, attention, T, T)
    return time_launches(spin, launch)


def time_read(read, spin, x: dict, fp8: bool) -> float:
    """Mean GPU time of read_kv over the step's contexts, in seconds."""
    row_vectors, sink = HEAD_DIM * (1 if fp8 else 2) // 16, gpuarray.zeros(1, np.int32)
    args = (x["k"], x["v"], x["tables"], np.int32(x["max_blocks"]), x["positions"], np.int32(KV_HEADS),
            np.int32(x["block"].bit_length() - 1), np.int32(row_vectors), sink)
    return time_launches(spin, lambda: read(*args, block=(128, 1, 1), grid=(x["tokens"], KV_HEADS)))


def time_launches(spin, launch: Callable[[], None]) -> float:
    """Mean GPU time of `launch`, in seconds: after 3 warm-up calls, REPEATS of them
    queued behind `spin`."""
    for _ in range(3):
        launch()
    start, end = cuda.Event(), cuda.Event()
    spin(np.int64(SPIN_CYCLES), block=(1, 1, 1), grid=(1, 1))
    start.record()
    for _ in range(REPEATS):
        launch()
    end.record()
    end.synchronize()
    return end.time_since(start) / REPEATS / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=Path, default=CUDA_SRC, help="a cuda_src/ folder (default: this checkout's)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="bfloat16 (auto) or e4m3 K/V")
    ap.add_argument("--block-sizes", type=_sizes, default=[BLOCK], help="KV block sizes, comma-separated (powers of two)")
    ap.add_argument("--partitions", type=_sizes, default=[64, 128, 256, 512, 1024], help="partition sizes, comma-separated")
    args = ap.parse_args()
    fp8 = is_fp8_kv_cache(args.kv_cache_dtype)
    device = cuda.Context.get_device()
    major, minor = device.compute_capability()
    kernels = Kernels(HEAD_DIM, HEADS // KV_HEADS, f"sm_{major}{minor}",
                      device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT), kv_cache_fp8=fp8,
                      sources=args.sources)
    spin = SourceModule(SPIN_SOURCE, no_extern_c=True).get_function("spin")
    read = SourceModule(READ_SOURCE, no_extern_c=True).get_function("read_kv")
    loads = {False: "one chunk", True: "a chunk ahead"}
    for name in ("paged_attention_partial", "paged_attention_partial_prefetch"):
        f = kernels.functions[name]
        print(f"{name}: {f.num_regs} registers a thread, {f.local_size_bytes} bytes of local memory")
    rng = np.random.default_rng(0)
    cases = {"256 x context 850": [850] * 256, "256 x context U(100, 2000)": rng.integers(100, 2001, 256).tolist(),
             "64 x context 300": [300] * 64, "1 x context 300": [300], "1 x context 8192": [8192],
             "1 x context 32768": [32768], "16 x context 32768": [32768] * 16}
    print(f"{'batch':>26} | {'block':>5} | {'partition':>9} | {'pass 2':>12} | {'loads':>13} | {'us':>7} | "
          f"{'K/V TB/s':>8} | {'floor us':>8}")
    for (name, contexts), block in itertools.product(cases.items(), args.block_sizes):
        x = inputs(contexts, rng, fp8, block)

        def row(partition: str, pass2: str, how: str, seconds: float) -> None:
            print(f"{name:>26} | {block:>5} | {partition:>9} | {pass2:>12} | {how:>13} | {seconds * 1e6:7.1f} | "
                  f"{x['bytes'] / seconds / 1e12:8.2f} | {x['bytes'] / BANDWIDTH * 1e6:8.1f}")
        row("-", "-", "read only", time_read(read, spin, x, fp8))
        for partition in args.partitions:
            for merge_in_kernel, prefetch in itertools.product((False, True), loads):
                seconds = time_attention(kernels, spin, x, partition, merge_in_kernel, prefetch)
                row(str(partition), "in kernel" if merge_in_kernel else "merge kernel", loads[prefetch], seconds)


def _sizes(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


if __name__ == "__main__":
    main()

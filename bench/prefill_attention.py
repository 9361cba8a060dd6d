"""Prompt attention alone (prefill_attention_partial, then paged_attention_merge where
the step splits contexts into partitions), at the Llama 3.2 1B shape (32 query heads,
8 KV heads, head_dim 64, 16-token blocks scattered over the cache): one sequence's
prompt step of `tokens` new tokens after `cached` positions already in the cache, as
the engine runs it (whole contexts from 4,096 prompt tokens on or where one partition
holds the context, else 512-position partitions, 128 for a tail of up to 64 tokens:
step_metadata.attention_partition), and shorter prompts with whole contexts too, for
comparison. It prints the causal FLOPs (QK^T and PV over the positions each token
sees) per second against the H200's bfloat16 matmul rate, a layer's launch at a time;
with --torch, the same shapes through PyTorch's scaled_dot_product_attention (its
choice of kernel) on contiguous K and V beside it, where the machine has PyTorch.
--kv-cache-dtype fp8 reads a cache of e4m3 codes.

    python bench/prefill_attention.py [--sources DIR] [--torch] [--kv-cache-dtype fp8] [--partitions 64,256]
    (on a machine with an NVIDIA GPU)

--sources compiles another version of cuda_src/ (as in bench/decode_attention.py) whose
prefill kernel has the block geometry of this checkout's launcher (PREFILL_THREADS, M_TILE).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pycuda.autoprimaryctx  # noqa: F401
import pycuda.driver as cuda
import pycuda.gpuarray as gpuarray
from pycuda.compiler import SourceModule

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.decode_attention import (  # noqa: E402
    BLOCK, HEAD_DIM, HEADS, KV_HEADS, REPEATS, SPIN_CYCLES, SPIN_SOURCE, time_launches)
from bench.floors import PEAK  # noqa: E402
from engine.backends.cuda.kernels import CUDA_SRC, Kernels, PagedAttention, prefill_query_rows  # noqa: E402
from engine.backends.cuda.step_metadata import prompt_shape  # noqa: E402
from engine.quantization.fp8 import f32_to_e4m3  # noqa: E402
from engine.weights import f32_to_bf16_bits  # noqa: E402

# (new tokens, positions cached before them): prompts of 1,024 and 2,048 tokens, a prefix
# cache hit's 64-token tail, and the four 8,192-token chunks of a 32,768-token prompt.
CASES = [(1024, 0), (2048, 0), (64, 1024), (256, 1024), (512, 2048), (8192, 0), (8192, 8192), (8192, 16384), (8192, 24576)]


def causal_flops(tokens: int, cached: int) -> float:
    """QK^T and PV, 2 FLOPs a multiply-add, over the positions each new token sees."""
    seen = np.arange(cached + 1, cached + tokens + 1, dtype=np.float64).sum()
    return 2 * 2 * seen * HEADS * HEAD_DIM


def case_inputs(tokens: int, cached: int, kv_fp8: bool, rng: np.random.Generator) -> dict:
    """Random bf16 Q and cache (bf16, or e4m3 codes) for one sequence, its blocks
    scattered over the cache."""
    context = cached + tokens
    blocks = -(-context // BLOCK)
    table = rng.permutation(blocks).astype(np.int32)[None, :]
    rows = prefill_query_rows(HEADS // KV_HEADS)
    tiles = np.array([(r, min(rows, tokens - r)) for r in range(0, tokens, rows)], np.int32)

    def bf16(shape: tuple[int, ...]) -> gpuarray.GPUArray:
        return gpuarray.to_gpu(f32_to_bf16_bits(rng.standard_normal(shape, np.float32)))

    def cache() -> gpuarray.GPUArray:
        shape = (blocks, KV_HEADS, BLOCK, HEAD_DIM)  # (engine/backends/cuda/buffers.py's KvCache)
        return gpuarray.to_gpu(f32_to_e4m3(rng.standard_normal(shape, np.float32))) if kv_fp8 else bf16(shape)
    return {
        "qkv": bf16((tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)), "k": cache(), "v": cache(),
        "table": gpuarray.to_gpu(table), "token_seq": gpuarray.to_gpu(np.zeros(tokens, np.int32)),
        "positions": gpuarray.to_gpu(np.arange(cached, context, dtype=np.int32)),
        "tiles": gpuarray.to_gpu(tiles), "num_tiles": len(tiles), "context": context,
    }


def time_prefill(kernels: Kernels, spin, tokens: int, x: dict, whole: bool, partition: int) -> tuple[float, str]:
    """Mean GPU time of one layer's prompt attention, in seconds, and how it ran: each
    query tile's whole context in one block, or partitions of `partition` positions
    merged after."""
    P = 1 if whole else math.ceil(x["context"] / partition)
    acc, m, s = (gpuarray.empty(shape, np.float32) for shape in ((tokens, HEADS, P, HEAD_DIM), (tokens, HEADS, P),
                                                                  (tokens, HEADS, P)))
    out = gpuarray.empty((tokens, HEADS * HEAD_DIM), np.uint16)
    attention = PagedAttention(acc, m, s, x["qkv"], x["table"], x["table"].shape[1], x["token_seq"], x["positions"],
                               HEADS, KV_HEADS, BLOCK, partition, P, HEAD_DIM ** -0.5)

    def launch() -> None:
        kernels.prefill_attention_partial(None, out if whole else None, attention, x["k"], x["v"], x["tiles"],
                                          x["num_tiles"])
        if not whole:
            kernels.paged_attention_merge(None, out, attention, tokens, 0)
    return time_launches(spin, launch), "whole contexts" if whole else f"{P} x {partition} + merge"


def time_torch(tokens: int, cached: int) -> float:
    """PyTorch's causal attention of the same shape (K and V contiguous, grouped heads), in seconds."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(1, KV_HEADS, cached + tokens, HEAD_DIM, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    # The new tokens are the last rows: token i sees positions 0..cached + i.
    mask = None if cached == 0 else torch.ones(tokens, cached + tokens, dtype=torch.bool, device="cuda").tril(cached)

    def launch() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    for _ in range(3):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)
    start.record()
    for _ in range(REPEATS):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPEATS / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", type=Path, default=CUDA_SRC, help="a cuda_src/ folder (default: this checkout's)")
    ap.add_argument("--torch", action="store_true", help="time PyTorch's scaled_dot_product_attention beside it")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="auto: bfloat16; fp8: e4m3 codes")
    ap.add_argument("--partitions", default="", help="comma-separated partition lengths (multiples of 64) to time "
                    "beside the engine's, in the cases that split their contexts")
    args = ap.parse_args()
    other_partitions = [int(p) for p in args.partitions.split(",") if p]
    kv_fp8 = args.kv_cache_dtype == "fp8"
    device = cuda.Context.get_device()
    major, minor = device.compute_capability()
    kernels = Kernels(HEAD_DIM, HEADS // KV_HEADS, f"sm_{major}{minor}",
                      device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT), kv_cache_fp8=kv_fp8,
                      sources=args.sources)
    spin = SourceModule(SPIN_SOURCE, no_extern_c=True).get_function("spin")
    f = kernels.functions["prefill_attention_partial"]
    print(f"prefill_attention_partial: {f.num_regs} registers a thread, {f.local_size_bytes} bytes of local memory")
    print(f"{'new tokens':>10} | {'cached':>6} | {'launch':>16} | {'us':>8} | {'TFLOP/s':>7} | {'floor us':>8}"
          + (f" | {'torch us':>8} | {'TFLOP/s':>7}" if args.torch else ""))
    rng = np.random.default_rng(0)
    for tokens, cached in CASES:
        flops, x = causal_flops(tokens, cached), case_inputs(tokens, cached, kv_fp8, rng)
        # (the engine's way first; a short prompt's whole contexts too, for comparison)
        shape = prompt_shape(tokens, x["table"].shape[1], x["context"], prefill_query_rows(HEADS // KV_HEADS),
                             invariant=False)
        engine_partition, engine_whole = shape.partition, shape.whole_context_prompt
        others = [(False, p) for p in other_partitions if p != engine_partition]
        engine_way = (engine_whole, engine_partition)
        ways = [engine_way] if engine_whole else [engine_way, *others, (True, engine_partition)]
        for whole, partition in ways:
            seconds, how = time_prefill(kernels, spin, tokens, x, whole, partition)
            line = (f"{tokens:>10} | {cached:>6} | {how:>16} | {seconds * 1e6:8.1f} | {flops / seconds / 1e12:7.1f} | "
                    f"{flops / PEAK * 1e6:8.1f}")
            if args.torch and (whole, partition) == engine_way:
                t = time_torch(tokens, cached)
                line += f" | {t * 1e6:8.1f} | {flops / t / 1e12:7.1f}"
            print(line)


if __name__ == "__main__":
    main()

"""The CPU backend's decode attention alone (cpu_src/layer.c's `attention`): one decode
step's tokens, each sequence's context in 16-token blocks scattered over the cache, at
SmolLM2-135M's shape (9 query heads over 3 KV heads) and the Llama 3.2 1B shape (32 over
8), head_dim 64, for a few batches and context lengths; µs a layer's call (median of 15
rounds), beside its floors: the K/V bytes over this machine's read bandwidth and the
multiply-adds over numpy's float32 matmul peak.

    python bench/cpu_attention.py [--kv-cache-dtype fp8] [--threads N] [--sources DIR]

--sources compiles another version of cpu_src/ (its `attention` taking the same
arguments), e.g. an earlier commit's: `mkdir /tmp/old && git archive COMMIT cpu_src | tar
-x -C /tmp/old`, then `--sources /tmp/old/cpu_src`; the two take turns, round by round,
so that the machine's swings fall on both.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.cpu_decode import matmul_flops, read_bandwidth  # noqa: E402
from engine.backends.cpu.backend import available_cores  # noqa: E402
from engine.backends.cpu.kernels import COMPILER, CPU_SRC, FLAGS, SIGNATURES, SOURCES  # noqa: E402
from engine.quantization.fp8 import f32_to_e4m3  # noqa: E402

SHAPES = {"SmolLM2-135M": (9, 3), "Llama-3.2-1B": (32, 8)}  # query heads, KV heads
HEAD_DIM, BLOCK = 64, 16
CASES = [("SmolLM2-135M", 8, 150), ("SmolLM2-135M", 8, 1000), ("Llama-3.2-1B", 1, 1000), ("Llama-3.2-1B", 8, 300),
         ("Llama-3.2-1B", 8, 1000), ("Llama-3.2-1B", 8, 4000)]  # (shape, batch, context)
ROUNDS, CALLS = 15, 20


def compiled(sources: Path, target: Path, threads: int) -> ctypes.CDLL:
    """cpu_src/'s kernels from `sources`, built into `target` as the backend builds them."""
    subprocess.run([COMPILER, *FLAGS, "-o", str(target), *(str(sources / s) for s in SOURCES)], check=True)
    library = ctypes.CDLL(str(target))
    library.attention.argtypes, library.attention.restype = SIGNATURES["attention"], None
    library.set_threads(threads)
    return library


def step(heads: int, kv_heads: int, batch: int, context: int, fp8: bool, rng) -> tuple[list, np.ndarray, list, int]:
    """One decode step's attention: its call's arguments, its output, the arrays the
    arguments point into (to be kept alive with them) and the K/V bytes it reads."""
    blocks = batch * -(-context // BLOCK)
    slots = (rng.permutation(blocks)[:, None] * BLOCK + np.arange(BLOCK)).reshape(batch, -1)[:, :context]
    shape = (blocks * BLOCK, kv_heads, HEAD_DIM)
    k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    if fp8:
        k, v = f32_to_e4m3(k), f32_to_e4m3(v)
    qkv = rng.standard_normal((batch, (heads + 2 * kv_heads) * HEAD_DIM)).astype(np.float32)
    out = np.empty((batch, heads * HEAD_DIM), np.float32)
    arrays = [np.arange(batch, dtype=np.int32), np.ones(batch, np.int32), np.full(batch, context - 1, np.int32),
              np.ascontiguousarray(slots, np.int64), np.arange(batch, dtype=np.int64) * context]
    args = [out.ctypes.data, qkv.ctypes.data, heads, kv_heads, HEAD_DIM, batch, *(a.ctypes.data for a in arrays),
            k.ctypes.data, v.ctypes.data, HEAD_DIM ** -0.5, int(fp8)]
    return args, out, [qkv, *arrays, k, v], batch * context * kv_heads * HEAD_DIM * 2 * k.itemsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    ap.add_argument("--threads", type=int, default=available_cores())
    ap.add_argument("--sources", type=Path, help="another cpu_src/ to time beside this tree's")
    args = ap.parse_args()
    fp8 = args.kv_cache_dtype == "fp8"
    bandwidth, flops = read_bandwidth(args.threads), matmul_flops()  # (numpy's BLAS takes every core)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"this tree": compiled(CPU_SRC, Path(tmp) / "this.so", args.threads)}
        if args.sources:
            builds[str(args.sources)] = compiled(args.sources.resolve(), Path(tmp) / "other.so", args.threads)
        print(f"machine: {args.threads} threads; memory read {bandwidth / 1e9:.1f} GB/s, float32 matmul "
              f"{flops / 1e9:.0f} GFLOP/s; date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
        print(f"command: python bench/cpu_attention.py {' '.join(sys.argv[1:])}")
        print(f"K/V cache: {'e4m3' if fp8 else 'float32'}; µs a layer's call, median of {ROUNDS} rounds of {CALLS}")
        names = list(builds)
        print(f"{'shape':14} | batch | context | K/V MB | floor µs (bytes, MACs) | "
              + " | ".join(f"{n:>14}" for n in names))
        rng = np.random.default_rng(0)
        for shape, batch, context in CASES:
            heads, kv_heads = SHAPES[shape]
            call_args, out, _arrays, kv_bytes = step(heads, kv_heads, batch, context, fp8, rng)
            outputs, times = {}, {n: [] for n in names}
            for name in names:
                builds[name].attention(*call_args)
                outputs[name] = out.copy()
            for _ in range(ROUNDS):
                for name in names:
                    start = time.perf_counter()
                    for _ in range(CALLS):
                        builds[name].attention(*call_args)
                    times[name].append((time.perf_counter() - start) / CALLS * 1e6)
            for name in names[1:]:  # (the same arithmetic, summed in another order at most)
                np.testing.assert_allclose(outputs[name], outputs[names[0]], rtol=1e-4, atol=1e-5)
            macs = 2 * batch * context * heads * HEAD_DIM
            floors = f"{kv_bytes / bandwidth * 1e6:.1f}, {2 * macs / flops * 1e6:.1f}"
            print(f"{shape:14} | {batch:5} | {context:7} | {kv_bytes / 1e6:6.1f} | {floors:>22} | "
                  + " | ".join(f"{statistics.median(times[n]):14.1f}" for n in names))


if __name__ == "__main__":
    main()

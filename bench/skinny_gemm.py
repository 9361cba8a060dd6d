"""The skinny GEMM (cuda_src/skinny_gemm.cu) against what steps of 2 to 64 rows took
before it, at the Llama 3.2 1B shape (random weights), in one run:

1. Each layer matrix times 2 to 64 rows, one product (replayed over the 16 layers'
   copies in a CUDA graph, bench/quantized.py's replay_us): cuBLAS in bfloat16 (an FP8
   weight dequantized first, as before), ours at the split skinny_split picks and at
   every split, each in µs and the TB/s of the weight's bytes, beside the floor (the
   bytes over 4.27 TB/s).
2. The engine with cuBLAS for those tiles (Linear.skinny_tiles empty), with the skinny
   GEMM up to 64 rows, and as shipped (linear.SKINNY_TILES): the time to first token of
   64 new tokens after a cached 1,024-token prefix (bench/prefix_cache.py's (c)), and
   output tokens/s of decode batches of 8, 32 and 64 sequences (128-token prompts, 128
   greedy tokens each).

    python3 bench/skinny_gemm.py [--formats bf16,fp8,fp8-blocks] [--no-engine]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prefix_cache import GPU, cached_first_token, run_requests  # noqa: E402
from bench.quantized import BANDWIDTH, FORMATS, bf16_rows, layer_matrices, replay_us  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, make_model  # noqa: E402
from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.backends.cuda.kernels import skinny_split, skinny_splits  # noqa: E402
from engine.backends.cuda.linear import SKINNY_TILES  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402

ROWS = (2, 4, 8, 16, 32, 64)
BATCHES = (8, 32, 64)


def kernel_table(backend: CudaBackend, name: str) -> None:
    import pycuda.gpuarray as gpuarray

    k, st = backend.kernels, backend.stream
    print(f"\n{name}: µs a product (TB/s); ours at skinny_split's split, then at each split")
    print(f"{'matrix':<9} | {'rows':>4} | {'floor':>6} | {'cuBLAS':>14} | {'ours':>14} | by split")
    with backend._context():
        for matrix, ws in layer_matrices(backend).items():
            w0 = ws[0]
            x, y = bf16_rows(max(ROWS), w0.d_in), gpuarray.empty((max(ROWS), w0.d_out), np.uint16)
            floor = w0.nbytes / BANDWIDTH * 1e6

            def cell(us: float) -> str:
                return f"{us:6.1f} ({w0.nbytes / us / 1e6:4.2f})"

            for rows in ROWS:
                def cublas() -> None:
                    for w in ws:
                        backend.linear(k, y[:rows], x[:rows], w, [(0, rows)])

                def ours(split: int):
                    def one_pass() -> None:
                        for w in ws:
                            k.skinny_gemm(st, y, x, w, rows, w.d_in, w.d_out, False, split)
                    return one_pass

                backend.linear.skinny_tiles = {}
                before = replay_us(backend, cublas, len(ws))
                splits = {s: replay_us(backend, ours(s), len(ws)) for s in skinny_splits(rows, w0.d_in, w0.format)}
                chosen = skinny_split(rows, w0.d_in, w0.d_out, w0.format, k.sm_count)
                by_split = "  ".join(f"{s}: {us:.1f}" for s, us in splits.items())
                print(f"{matrix:<9} | {rows:>4} | {floor:6.1f} | {cell(before)} | {cell(splits[chosen])} | {by_split}",
                      flush=True)


ENGINES = {"cuBLAS": {}, "skinny GEMM up to 64 rows": {"bf16": 64, "fp8": 64}, "as shipped": SKINNY_TILES}


def engine_figures(model, skinny_tiles: dict[str, int]) -> str:
    backend = CudaBackend(model.config, model.model_weights())
    backend.linear.skinny_tiles = skinny_tiles  # (before the graphs are captured, with the KV cache)
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=8192, max_num_seqs=max(BATCHES),
                                                    max_num_batched_tokens=2048, enable_prefix_caching=True))
    vocab, rng = model.config.vocab_size, np.random.default_rng(0)
    run_requests(engine, [rng.integers(0, vocab, 32).tolist()], 4)  # warm-up
    figures = [f"(c) {cached_first_token(engine, GPU, vocab, rng)}"]
    for batch in BATCHES:
        run, _ = run_requests(engine, [rng.integers(0, vocab, 128).tolist() for _ in range(batch)], 128)
        figures.append(f"batch {batch}: {run.output_tokens / run.seconds:,.0f} tok/s")
    del engine, backend
    return "; ".join(figures)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,fp8,fp8-blocks")
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="only the per-matrix table")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), LLAMA_32_1B, seed=0)
        base = load_model(tmp)
        for name in args.formats.split(","):
            model = FORMATS[name](base)
            backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=False)
            kernel_table(backend, name)
            del backend
            if args.engine:
                for engine, settings in ENGINES.items():
                    print(f"{name}, {engine}: {engine_figures(model, settings)}", flush=True)


if __name__ == "__main__":
    main()

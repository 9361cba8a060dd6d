"""Quantized weights on the CUDA engine at the Llama 3.2 1B shape (random weights): per
weight format, batch-1 time per output token (128-token prompt, 256 greedy tokens, CUDA
graphs) beside its floor (the bytes a token reads over the H200's 4.27 TB/s copy
bandwidth), and time to first token of a 1024-token prompt; then each layer matrix's
product by itself, per format and rows (our GEMV at 1 row; cuBLAS, after dequantizing a
quantized weight, above), with the bandwidth it reaches.

    python bench/quantized.py [--formats bf16,fp8,fp8-dynamic,fp8-head,int4] [--no-kernels | --kernels-only]

Formats: bf16 (the checkpoint as it is: also what the CUDA backend served FP8
checkpoints as before it read FP8), fp8 (the layers' matrices in FP8 with per-row
scales, as --quantization fp8), fp8-dynamic (the same as an FP8-dynamic checkpoint's:
its steps of many rows W8A8), fp8-blocks (128 x 128 block scales, as Hugging Face's
fp8 checkpoints), fp8-head (fp8 and the tied head, as --quantize-lm-head), int4 (the
layers' matrices in INT4, groups of 128 with zero points, as AWQ and GPTQ checkpoints).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_throughput import StepTimeline, weight_bytes_read  # noqa: E402
from bench.floors import BANDWIDTH  # noqa: E402
from bench.latency import ours  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, make_model  # noqa: E402
from devtools.quantized import MODEL_FORMATS  # noqa: E402
from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.backends.cuda.linear import LinearWeight  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.weights import f32_to_bf16_bits  # noqa: E402

KERNEL_ROWS = (1, 2, 4, 8, 16, 64, 256)


def end_to_end(model, name: str) -> tuple[dict, CudaBackend]:
    backend = CudaBackend(model.config, model.model_weights(), int4_weights=True)
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=4096))
    prompt = list(range(1000, 1128))
    ours(engine, prompt, 16)  # warm-up: kernels loaded, pool filled, graphs captured
    # (each prompt its own, so that the prefix cache holds none of it)
    ttft = statistics.median(ours(engine, list(range(2000 + 1100 * i, 3024 + 1100 * i)), 1)[0] for i in range(9))
    timeline = StepTimeline(backend)
    tpot = ours(engine, prompt, 256)[1]
    gpu = statistics.median(timeline.gpu_ms(prefill=False))
    weight_bytes = weight_bytes_read(backend)
    return dict(format=name, gb=weight_bytes / 1e9, floor=weight_bytes / BANDWIDTH * 1e3, tpot=tpot, gpu=gpu,
                ttft=ttft), backend


def replay_us(backend: CudaBackend, one_pass, products: int) -> float:
    """Microseconds a product: `one_pass` (which queues `products` of them on the
    backend's stream) captured as one CUDA graph, the median of 20 replays' events. (Timed
    launch by launch, the host's launch rate would be what is measured.)"""
    import pycuda.driver as cuda

    from engine.backends.cuda.graph import CudaGraph

    graph, times = CudaGraph(backend.stream.handle, one_pass), []
    for _ in range(21):
        start, end = cuda.Event(), cuda.Event()
        start.record(backend.stream)
        graph.launch()
        end.record(backend.stream)
        end.synchronize()
        times.append(end.time_since(start) * 1e3 / products)
    graph.close()
    return statistics.median(times[1:])


def layer_matrices(backend: CudaBackend) -> dict[str, list[LinearWeight]]:
    """Each layer matrix's name, with its 16 layers' copies (timed in turn, so that the
    weights come from memory, not the L2)."""
    layers = backend.weights.layers
    return {name: [layer[name] for layer in layers] for name, w in layers[0].items() if isinstance(w, LinearWeight)}


def bf16_rows(rows: int, d_in: int):
    """Random activations on the GPU, bfloat16 [rows, d_in]."""
    import pycuda.gpuarray as gpuarray

    return gpuarray.to_gpu(f32_to_bf16_bits(np.random.default_rng(0).standard_normal((rows, d_in)).astype(np.float32)))


def kernel_times(backend: CudaBackend, name: str) -> list[dict]:
    """Each layer matrix times `rows` rows through the backend's Linear (what a step's
    GEMM tile does), replay_us over the layers' copies."""
    import pycuda.gpuarray as gpuarray

    rows_max, results = max(KERNEL_ROWS), []
    with backend._context():
        for matrix, ws in layer_matrices(backend).items():
            d_out, d_in = ws[0].d_out, ws[0].d_in
            x, y = bf16_rows(rows_max, d_in), gpuarray.empty((rows_max, d_out), np.uint16)
            for rows in KERNEL_ROWS:
                def one_pass() -> None:
                    for w in ws:
                        backend.linear(backend.kernels, y[:rows], x[:rows], w, [(0, rows)])
                us = replay_us(backend, one_pass, len(ws))
                results.append(dict(format=name, matrix=matrix, shape=f"{d_out}x{d_in}", rows=rows, us=us,
                                    tbs=ws[0].nbytes / us / 1e6))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="bf16,fp8,fp8-blocks,fp8-head,int4")
    ap.add_argument("--no-kernels", dest="kernels", action="store_false", help="skip the per-matrix table")
    ap.add_argument("--kernels-only", action="store_true", help="only the per-matrix table")
    args = ap.parse_args()
    rows = []
    if args.kernels:
        print(f"{'format':<10} | {'matrix':<23} | {'shape':<11} | " + " | ".join(f"{r:>4} rows" for r in KERNEL_ROWS)
              + "   (microseconds; TB/s of its weight at 1 row)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), LLAMA_32_1B, seed=0)
        base = load_model(tmp)
        for name in args.formats.split(","):
            model = MODEL_FORMATS[name](base)
            if args.kernels_only:
                backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=False, int4_weights=True)
            else:
                result, backend = end_to_end(model, name)
                rows.append(result)
                print(result, flush=True)
            if args.kernels:
                kernels = kernel_times(backend, name)
                for key in dict.fromkeys(r["matrix"] for r in kernels):
                    got = [r for r in kernels if r["matrix"] == key]
                    cells = " | ".join(f"{r['us']:9.1f}" for r in got)
                    print(f"{name:<10} | {key:<23} | {got[0]['shape']:<11} | {cells}   ({got[0]['tbs']:.2f} TB/s)",
                          flush=True)
            del backend
    if not rows:
        return
    print(f"\n{'format':<10} | {'weights read/token GB':>21} | {'floor ms':>8} | {'ms/token':>8} | {'GPU step ms':>11} | "
          f"{'of floor':>8} | {'TTFT 1024 ms':>12}")
    for r in rows:
        print(f"{r['format']:<10} | {r['gb']:21.3f} | {r['floor']:8.3f} | {r['tpot']:8.3f} | {r['gpu']:11.3f} | "
              f"{r['floor'] / r['tpot']:8.0%} | {r['ttft']:12.2f}")


if __name__ == "__main__":
    main()

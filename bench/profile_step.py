"""Where the time of one CUDA engine step goes, kernel by kernel (CUDA events around
every launch and GEMM of an eager step): a 1024-token prefill, a decode step at batch 1
with a 200-token context and one at batch 256 with ~850-token contexts; then, with CUDA
graphs, the wall time of a batch-1 engine step beside the GPU time of its graph replay,
and the kernels and GEMMs of that step, of 64 prompt tokens after 1,024 cached, of a
1,024-token prompt and of that batch-256 decode step, timed as a graph runs them (each
one's launches replayed alone in a graph with programmatic launches); and the
bandwidth cuBLAS reaches on each weight matrix at 1 to 256 rows, and our GEMV at one row, launched one by one and as a
decode graph runs it, back to back with programmatic launches (`graph`). Llama 3.2 1B
shape, random weights: bfloat16, or the layers in a quantized format with --format and
the KV cache in e4m3 with --kv-cache-dtype fp8 (then without the bfloat16 GEMM table).

    python bench/profile_step.py [--format F] [--kv-cache-dtype fp8]   # on a machine with an NVIDIA GPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pycuda.driver as cuda
import pycuda.gpuarray as gpuarray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.backends.cuda.cublas import DataType  # noqa: E402
from engine.backends.cuda.graph import CudaGraph  # noqa: E402
from engine.backends.cuda.kernels import SIGNATURES, Kernels  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, make_model  # noqa: E402
from devtools.quantized import MODEL_FORMATS  # noqa: E402
from engine.backends.base import KV_CACHE_DTYPES  # noqa: E402


SMALL_BATCH = EngineConfig(num_kv_blocks=4096)
LARGE_BATCH = EngineConfig(num_kv_blocks=16384, max_num_seqs=256, max_num_batched_tokens=8192)


def gpu_ms(stream: cuda.Stream, run) -> float:
    """GPU milliseconds of the work `run` queues on `stream` (events on either side)."""
    start, end = cuda.Event(), cuda.Event()
    start.record(stream)
    run()
    end.record(stream)
    end.synchronize()
    return end.time_since(start)


def graph_ms(stream: cuda.Stream, queue) -> float:
    """GPU milliseconds of one launch of a graph captured from `queue` (our kernels'
    launches programmatic, as in the engine's graphs), after a first launch."""
    graph = CudaGraph(stream.handle, queue, awaiting_kernels=SIGNATURES)
    graph.launch()
    try:
        return gpu_ms(stream, graph.launch)
    finally:
        graph.close()


class Timer:
    """Wraps each kernel and the GEMM calls with start/end events on the backend's stream."""

    def __init__(self, backend: CudaBackend):
        self.backend, self.events, self.on = backend, [], False
        for name, fn in backend.kernels.functions.items():
            fn.prepared_async_call = self._wrap(name, fn.prepared_async_call)
        backend.blas.gemm = self._wrap("gemm (cuBLAS)", backend.blas.gemm)
        if backend.linear.lt:
            backend.linear.lt.matmul = self._wrap("FP8 matmul (cuBLASLt)", backend.linear.lt.matmul)

    def _wrap(self, name, call):
        def timed(*args, **kwargs):
            if not self.on:
                return call(*args, **kwargs)
            start, end = cuda.Event(), cuda.Event()
            start.record(self.backend.stream)
            result = call(*args, **kwargs)
            end.record(self.backend.stream)
            self.events.append((name, start, end))
            return result
        return timed

    def measure(self, engine: LLMEngine) -> tuple[dict[str, float], float]:
        self.events, self.on = [], True
        with self.backend._context():
            start = cuda.Event()
            start.record(self.backend.stream)
        engine.step()
        self.on = False
        with self.backend._context():
            end = cuda.Event()
            end.record(self.backend.stream)
            end.synchronize()
            times = defaultdict(float)
            for name, a, b in self.events:
                times[name] += b.time_since(a)
            return times, end.time_since(start)


def report(title: str, times: dict[str, float], total: float) -> None:
    print(f"\n{title}: {total:.2f} ms from first launch to end of step (GPU time of the listed work: {sum(times.values()):.2f} ms)")
    for name, ms in sorted(times.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<26} {ms:8.3f} ms")


def graph_step_times(model, options: dict) -> None:
    """Batch 1 with CUDA graphs: where a step's wall time goes, host against GPU."""
    backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=True, **options)
    engine = LLMEngine(model, backend, SMALL_BATCH)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine.add(engine.make_sequence("b1", list(range(1000, 1128)), params))
    for _ in range(20):
        engine.step()
    walls, gpus = [], []
    replay = backend.graphs.graphs["decode", 1][2]
    for _ in range(50):
        start = time.perf_counter()
        engine.step()
        walls.append((time.perf_counter() - start) * 1e3)
        with backend._context():
            gpus.append(gpu_ms(backend.stream, replay.launch))
    print(f"\nbatch-1 engine step with CUDA graphs: {np.median(walls):.3f} ms wall, "
          f"of which the forward replay is {np.median(gpus):.3f} ms of GPU time")


def decode_at_129(engine: LLMEngine) -> None:
    """Up to the second decode step of a 128-token prompt (context 129)."""
    engine.add(engine.make_sequence("b1", list(range(1000, 1128)), SamplingParams(temperature=0.0, max_tokens=64,
                                                                                   ignore_eos=True)))
    engine.step()  # the prompt


def tail_after_cached_prefix(engine: LLMEngine) -> None:
    """Up to a prompt whose first 1,024 tokens are cached: its step computes the 64 others."""
    prefix = list(range(1000, 2024))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    engine.add(engine.make_sequence("first", prefix, params))
    while engine.has_work():
        engine.step()
    engine.add(engine.make_sequence("tail", prefix + list(range(3000, 3064)), params))


def prompt_of_1024(engine: LLMEngine) -> None:
    """Up to a 1,024-token prompt on an idle engine: its step computes all of it."""
    engine.add(engine.make_sequence("prompt", list(range(2000, 3024)), SamplingParams(temperature=0.0, max_tokens=1)))


def decode_of_256(engine: LLMEngine) -> None:
    """Up to a decode step of 256 sequences of ~850 tokens of context (the offline
    workload's large steps)."""
    rng = np.random.default_rng(256)  # (not the earlier prompts: no prefix-cache hits)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i in range(256):
        engine.add(engine.make_sequence(f"r{i}", rng.integers(0, 128000, 850).tolist(), params))
    while any(s.num_uncomputed_tokens > 1 or not s.output_ids for s in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()


def graph_kernel_table(model, options: dict, title: str, prepare, config: EngineConfig = SMALL_BATCH) -> None:
    """A step's kernels as a CUDA graph runs them. Events around each launch of an eager
    step (the table further down) add a gap per launch that a graph does not have, so
    here the launches of one eager step (after `prepare`) are recorded, and each
    kernel's launches (16 or so: one a layer) are replayed alone, back to back with
    programmatic launches, in a graph of REPEATS steps' worth; cuBLAS calls by weight
    shape, cuBLASLt's FP8 products by plan. The last row replays every launch in order:
    it should come near the step graph's own GPU time."""
    backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=False, **options)
    engine = LLMEngine(model, backend, config)
    prepare(engine)
    launches = []  # (name, library call or None for our kernels, grid, block, arguments after the stream, keywords)
    for name, fn in backend.kernels.functions.items():
        def record(grid, block, stream, *args, _name=name, _call=fn.prepared_async_call, **kwargs):
            launches.append((_name, None, grid, block, args, kwargs))
            return _call(grid, block, stream, *args, **kwargs)
        fn.prepared_async_call = record
    blas_gemm = backend.blas.gemm

    def gemm(*args):
        rows, d_in, d_out = args[-3:]
        launches.append((f"cuBLAS {rows}x{d_in} by {d_out}", blas_gemm, None, None, args, {}))
        blas_gemm(*args)
    backend.blas.gemm = gemm
    lt = backend.linear.lt
    if lt:
        lt_matmul = lt.matmul

        def matmul(plan, *args, **kwargs):
            rows, d_in, d_out = plan.shape.tokens, plan.shape.d_in, plan.shape.d_out
            launches.append((f"cuBLASLt FP8 {rows}x{d_in} by {d_out}", lt_matmul, None, None, (plan, *args), kwargs))
            lt_matmul(plan, *args, **kwargs)
        lt.matmul = matmul
    engine.step()  # (its buffers go back to the memory pool, which keeps them: the replays below reuse them)
    repeats = 20
    print(f"\n{title} as a CUDA graph runs it, kernel by kernel")
    print(f"{'kernel':>34} | launches | us a step | us a launch")
    with backend._context():
        kernels = Kernels(*backend.kernel_build, programmatic=True)

        def replay_time(chosen: list) -> float:
            """Microseconds a step's worth of `chosen` launches takes in a graph."""
            def queue():
                for _ in range(repeats):
                    for name, library_call, grid, block, args, kwargs in chosen:
                        if library_call:
                            library_call(*args, **kwargs)
                        else:
                            kernels.functions[name].prepared_async_call(grid, block, backend.stream, *args, **kwargs)
            return graph_ms(backend.stream, queue) * 1e3 / repeats
        names = list(dict.fromkeys(name for name, *_ in launches))
        rows = [(name, [launch for launch in launches if launch[0] == name]) for name in names] + [("all, in order", launches)]
        for name, chosen in rows:
            us = replay_time(chosen)
            print(f"{name:>34} | {len(chosen):>8} | {us:9.1f} | {us / len(chosen):11.2f}")


def gemm_table(backend: CudaBackend) -> None:
    """Time of one product per weight matrix and row count, and the weight bytes it
    reads per second: cuBLAS, and at one row our GEMV (the backend's choice there),
    launched one by one and, as in a decode graph, back to back with programmatic launches."""
    c, layer = backend.config, backend.weights.layers[0]
    matrices = {"qkv": layer["qkv"], "o": layer["self_attn.o_proj.weight"], "gate_up": layer["gate_up"],
                "down": layer["mlp.down_proj.weight"], "lm_head": backend.weights.lm_head}
    repeats = 20
    print("\nGEMM, microseconds (weight TB/s); the backend uses gemv at one row")
    print(f"{'rows':>5} {'by':>6} | " + " | ".join(f"{name:>16}" for name in matrices))
    with backend._context():
        graph_kernels = Kernels(*backend.kernel_build, programmatic=True)
        x = gpuarray.zeros((256, c.intermediate_size), np.uint16)
        outputs = {False: gpuarray.zeros((256, c.vocab_size), np.uint16), True: gpuarray.zeros((256, c.vocab_size), np.float32)}
        for rows in (1, 2, 4, 8, 16, 64, 128, 256):
            for by in ("cuBLAS", "gemv", "graph") if rows == 1 else ("cuBLAS",):
                cells = []
                for name, w in matrices.items():
                    y, out_f32 = outputs[name == "lm_head"], name == "lm_head"

                    def product(kernels: Kernels) -> None:
                        if by == "cuBLAS":
                            backend.blas.gemm(int(y.gpudata), DataType.F32 if out_f32 else DataType.BF16, int(x.gpudata),
                                              DataType.BF16, int(w.data.gpudata), DataType.BF16, rows, w.d_in, w.d_out)
                        else:
                            kernels.gemv(backend.stream, y, x, w.data, w.d_in, w.d_out, out_f32)

                    def run(kernels: Kernels = backend.kernels) -> None:
                        for _ in range(repeats):
                            product(kernels)
                    if by == "graph":
                        ms = graph_ms(backend.stream, lambda: run(graph_kernels)) / repeats
                    else:
                        run()  # (warm-up)
                        ms = gpu_ms(backend.stream, run) / repeats
                    cells.append(f"{ms * 1e3:7.1f} ({w.nbytes / ms / 1e9:4.2f})")
                print(f"{rows:>5} {by:>6} | " + " | ".join(f"{cell:>16}" for cell in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=sorted(MODEL_FORMATS), default="bf16", help="the layers' weights (as engine_throughput.py's)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="bfloat16 (auto) or FP8 e4m3 K/V")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), LLAMA_32_1B, seed=0)
        model = MODEL_FORMATS[args.format](load_model(tmp))
    options = dict(kv_cache_dtype=args.kv_cache_dtype, int4_weights=True)
    print(f"Llama 3.2 1B shape, {args.format} weights, {args.kv_cache_dtype} KV cache")
    graph_step_times(model, options)
    graph_kernel_table(model, options, "batch-1 decode step (context 129)", decode_at_129)
    graph_kernel_table(model, options, "64 prompt tokens after 1,024 cached", tail_after_cached_prefix)
    graph_kernel_table(model, options, "a 1,024-token prompt", prompt_of_1024)
    graph_kernel_table(model, options, "decode, 256 sequences at ~850 tokens", decode_of_256, LARGE_BATCH)
    backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=False, **options)
    if args.format == "bf16":
        gemm_table(backend)
    engine = LLMEngine(model, backend, LARGE_BATCH)
    timer = Timer(backend)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    engine.add(engine.make_sequence("warm", rng.integers(0, 128000, 1024).tolist(), params))
    engine.step()  # warm-up, a 1024-token prefill
    engine.abort("warm")
    engine.add(engine.make_sequence("prefill", rng.integers(0, 128000, 1024).tolist(), params))
    report("prefill of 1024 tokens", *timer.measure(engine))
    engine.abort("prefill")
    engine.add(engine.make_sequence("b1", rng.integers(0, 128000, 200).tolist(), params))
    engine.step()
    report("decode step, batch 1, context 200", *timer.measure(engine))
    engine.abort("b1")
    decode_of_256(engine)
    report("decode step, batch 256, context ~850", *timer.measure(engine))


if __name__ == "__main__":
    main()

"""Wall and GPU time of single engine steps at the Llama 3.2 1B shape, for comparing two
commits in one device run: a 1,024-token prefill (CUDA graphs on, idle engine) and an
eager batch-1 decode step (`--enforce-eager`), each the median of 40 after 10 of warm-up.
A process's figures vary by up to ±5% from the next one's: run each commit several times,
alternating, and compare the means.

    python3 bench/step_times.py MODEL_DIR          # a model from devtools.checkpoints.make_model
    for i in 1 2 3; do for tree in OLD NEW; do (cd $tree && PYTHONPATH=$PWD python3 bench/step_times.py /tmp/llama); done; done
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pycuda.driver as cuda

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

RUNS, WARM_UP = 50, 10


def timed_step(engine: LLMEngine, backend: CudaBackend) -> tuple[float, float]:
    """(wall, GPU) milliseconds of one engine step."""
    with backend._context():
        start, end = cuda.Event(), cuda.Event()
        start.record(backend.stream)
    began = time.perf_counter()
    engine.step()
    wall = (time.perf_counter() - began) * 1e3
    with backend._context():
        end.record(backend.stream)
        end.synchronize()
    return wall, end.time_since(start)


def median_after_warm_up(samples: list[tuple[float, float]]) -> tuple[float, float]:
    kept = samples[WARM_UP:]
    return statistics.median(w for w, _ in kept), statistics.median(g for _, g in kept)


def main() -> None:
    model = load_model(sys.argv[1])
    backend = CudaBackend(model.config, model.model_weights())
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=4096))
    prefill = []
    for i in range(RUNS):
        prompt = list(range(2000 + i, 3024 + i))  # (each its own: a repeat would find the last one's prefix cached)
        engine.add(engine.make_sequence(f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1)))
        prefill.append(timed_step(engine, backend))
        while engine.has_work():
            engine.step()
    eager_backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=False)
    eager = LLMEngine(model, eager_backend, EngineConfig(num_kv_blocks=4096))
    eager.add(eager.make_sequence("d", list(range(1000, 1128)), SamplingParams(temperature=0.0, max_tokens=RUNS + 1,
                                                                               ignore_eos=True)))
    eager.step()  # the prompt
    decode = [timed_step(eager, eager_backend) for _ in range(RUNS)]
    print("step                          | wall ms | GPU ms")
    for name, samples in (("prefill, 1,024 tokens", prefill), ("eager decode, batch 1", decode)):
        wall, gpu = median_after_warm_up(samples)
        print(f"{name:<29} | {wall:7.3f} | {gpu:6.3f}")


if __name__ == "__main__":
    main()

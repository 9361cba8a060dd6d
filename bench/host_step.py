"""The engine's host time per decode step, without a GPU: the CUDA backend runs on the
recording stand-in of PyCUDA, cuBLAS and the driver (devtools/recording_pycuda.py),
which launches nothing, so a step's wall time is all the host's. Steps of --batch
sequences (greedy, eos ignored, a 39-token prompt each) are timed as the server's loop
runs them (step_overlapped), and a profile of the same steps splits that time into
scheduling, the forward pass's metadata and launch, queueing the sampling, ending a
step (the wait and recording the tokens) and emitting the deltas. On the GPU a step
whose host time exceeds its GPU time is host-bound (bench/HISTORY.md has such steps),
so this is the loop to shorten it in, on any machine. The model is the small test
fixture shaped for the kernels: the host's work depends on the batch, not the widths.

    python3 bench/host_step.py [--batch 1,64,256] [--steps 300]
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devtools.recording_pycuda import cuda_shaped, recording_pycuda  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

TINY_MODEL = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny-llama"
PHASES = {  # a phase: the function (file, name) whose cumulative time it is
    "schedule": ("scheduler.py", "schedule"),
    "forward": ("cuda/backend.py", "launch_forward"),
    "sampling": ("cuda/backend.py", "sample"),
    "end step": ("llm_engine.py", "end_step"),
    "emit": ("llm_engine.py", "emit"),
}


def timed_steps(batch: int, steps: int) -> tuple[float, dict[str, float]]:
    """Host ms a step, unprofiled; and each phase's share of a profiled step."""
    model = cuda_shaped(load_model(TINY_MODEL))
    with recording_pycuda() as launches:
        from engine.backends.cuda.backend import CudaBackend

        backend = CudaBackend(model.config, model.model_weights(), graph_max_batch=batch)
        tokens = 39 + 3 * steps  # a sequence's: its prompt, and room for the timed and the profiled steps
        engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=batch * (tokens // 16 + 2), max_num_seqs=batch,
                                                        max_num_batched_tokens=max(batch, 256)))
        for i in range(batch):
            engine.add(engine.make_sequence(f"r{i}", list(range(1 + i % 50, 40 + i % 50)),
                                            SamplingParams(temperature=0.0, max_tokens=3 * steps, ignore_eos=True)))
        while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running + list(engine.scheduler.waiting)):
            engine.step_overlapped(lambda deltas: None)  # the prompts
        launches.clear()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step_overlapped(lambda deltas: None)
        host_ms = (time.perf_counter() - start) / steps * 1e3
        profile = cProfile.Profile()
        profile.runcall(lambda: [engine.step_overlapped(lambda deltas: None) for _ in range(steps)])
    stats = pstats.Stats(profile).stats  # {(file, line, name): (calls, ..., own, cumulative, callers)}
    total = sum(entry[2] for entry in stats.values())
    shares = {phase: sum(entry[3] for (file, _, name), entry in stats.items() if file.endswith(f) and name == fn) / total
              for phase, (f, fn) in PHASES.items()}
    return host_ms, shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,64,256", help="comma-separated: a run each")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # (the small KV cache's notice)
    print(f"{'batch':>5} | {'host ms a step':>14} | " + " | ".join(f"{p:>9}" for p in PHASES) + "   (ms a step, by phase)")
    for batch in (int(b) for b in args.batch.split(",")):
        host_ms, shares = timed_steps(batch, args.steps)
        print(f"{batch:>5} | {host_ms:14.3f} | " + " | ".join(f"{shares[p] * host_ms:9.3f}" for p in PHASES), flush=True)


if __name__ == "__main__":
    main()

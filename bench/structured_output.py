"""What structured output costs: time per output token with every request held to a
small JSON schema, against the same requests free, at batch 1 and 64, in one process.
Each request has a 128-token prompt of random ids and up to 128 output tokens; a
constrained one ends when its object is complete. Reported: the mean time per output
token after a request's first (TPOT), which leaves the prompt's prefill out. The schema
is one string field (a random model rarely closes it: outputs run long either way).

    python3 bench/structured_output.py --device cuda   # Llama 3.2 1B shape, random bfloat16 weights
    python3 bench/structured_output.py --device cpu    # the embedded SmolLM2-135M, numpy, batch 1 and 8
    python3 bench/structured_output.py --device cuda --phases   # and where each step's host time goes

--phases times the engine's parts of a step on the host (each wrapped in a timer):
scheduling, queueing the forward pass and the sampling, waiting for the device,
emitting, and for structured output advancing the guides and filling the masks (on
their own thread: not the engine thread's time).

Floors: one read of the weights per decode step (the H200's 4.27 TB/s; on the CPU a
numpy copy's bandwidth).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.floors import BANDWIDTH  # noqa: E402
from engine.backends import create_backend  # noqa: E402
from engine.engine_loop import GIL_SWITCH_INTERVAL_S  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured import Constraint  # noqa: E402

SCHEMA = json.dumps({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                     "additionalProperties": False})


class Phases:
    """Host seconds spent in each part of the engine's steps (--phases)."""

    def __init__(self, engine: LLMEngine):
        import engine.llm_engine as llm_engine
        import engine.structured.guide as guide

        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.steps = 0
        for name in ("begin_step", "end_step", "emit"):
            setattr(engine, name, self._timed(name, getattr(engine, name)))
        engine.scheduler.schedule = self._timed("schedule", engine.scheduler.schedule)
        llm_engine.InFlightStep.queue_sampling = self._timed("queue sampling (waits for masks)",
                                                              llm_engine.InFlightStep.queue_sampling)
        llm_engine.start_filling_masks = self._timed("hand masks to their thread", llm_engine.start_filling_masks)
        guide.fill_masks = self._timed("masks (their thread)", guide.fill_masks)
        launch_forward = engine.backend.launch_forward

        def timed_launch(batch):
            sample = self._timed("queue forward pass", launch_forward)(batch)
            return lambda masks: self._timed("wait for the device", self._timed("queue sampling", sample)(masks))
        engine.backend.launch_forward = timed_launch

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.steps += name == "end_step"
        return timed

    def report(self) -> str:
        """ms a step by part, and reset."""
        line = ", ".join(f"{name} {s / max(self.steps, 1) * 1e3:.3f}" for name, s in
                         sorted(self.seconds.items(), key=lambda item: -item[1]))
        self.seconds.clear()
        self.steps = 0
        return "      host ms a step: " + line


def run(engine: LLMEngine, prompts: list[list[int]], constrained: bool, output: int) -> tuple[float, int]:
    """The prompts all at once, stepped as the server steps them: the mean time per
    output token after each request's first (TPOT, ms) and the output tokens made."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=not constrained,
                            constraint=Constraint("json_schema", SCHEMA) if constrained else None)
    seqs = [engine.make_sequence(f"r{i}", p, params) for i, p in enumerate(prompts)]
    first, last, made = {}, {}, {}

    def count(deltas) -> None:
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                made[d.request_id] = made.get(d.request_id, 0) + len(d.token_ids)
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step_overlapped(count)
    tpot = [(last[r] - first[r]) / (made[r] - 1) for r in made if made[r] > 1]
    return float(np.mean(tpot)) * 1e3, sum(made.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--phases", action="store_true", help="also where each step's host time goes")
    args = ap.parse_args()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # (as the engine's thread runs: EngineLoop)
    tmp = None
    if args.device == "cuda":
        from devtools.checkpoints import LLAMA_32_1B, make_model

        tmp = tempfile.TemporaryDirectory()
        make_model(Path(tmp.name), LLAMA_32_1B, seed=0)
        model, batches, bandwidth, width = load_model(tmp.name), (1, 64), BANDWIDTH, 2
    else:
        from bench.cpu_decode import memory_bandwidth

        model, batches, bandwidth, width = load_model(), (1, 8), memory_bandwidth() / 2, 4
    backend = create_backend(args.device, model.config, model.model_weights())
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=8192))
    floor_ms = sum(int(np.prod(t.shape)) for t in model.weights.values()) * width / bandwidth * 1e3
    rng = np.random.default_rng(0)
    vocab = min(model.config.vocab_size, 128000)
    run(engine, [rng.integers(0, vocab, 16).tolist()], True, 8)  # warm-up (and llguidance's tokenizer)
    phases = Phases(engine) if args.phases else None
    print(f"{model.name} on {args.device}: 128-token prompts, up to 128 output tokens, greedy; "
          f"a decode step's floor {floor_ms:.2f} ms")
    print(f"{'batch':>5} | {'requests':>8} | {'tokens':>6} | {'TPOT ms':>8} | vs free")
    for batch in batches:
        prompts = [rng.integers(0, vocab, 128).tolist() for _ in range(batch)]
        free = None
        for constrained in (False, True):
            tpot, made = run(engine, prompts, constrained, 128)
            versus = "" if free is None else f"{tpot / free - 1:+.1%}"
            free = tpot if free is None else free
            print(f"{batch:>5} | {'schema' if constrained else 'free':>8} | {made:>6} | {tpot:8.3f} | {versus}")
            if phases:
                print(phases.report())
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()

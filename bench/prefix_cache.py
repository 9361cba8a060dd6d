"""Prefix caching: time to first token and throughput with the cache on and off, on
(a) requests sharing one system prompt, each with tokens of its own, all submitted at
once, and (b) multi-turn chats, each turn resending the whole conversation so far
(every conversation's next turn submitted when all its previous ones are answered);
and (c) the time to first token of one request, alone, whose system prompt is cached.
Random token ids, greedy, eos ignored.

    python3 bench/prefix_cache.py --device cuda   # Llama 3.2 1B shape, random bfloat16 weights (torch makes them)
    python3 bench/prefix_cache.py --device numpy  # the embedded SmolLM2-135M on the numpy backend, a smaller workload

The floor of each run: its prompt tokens that are not cached at 2 FLOPs a parameter
each at the compute peak, plus one read of the weights per decode step, with every
request of a wave decoding in each step (GPU: the H200's 790 TFLOP/s and 4.27 TB/s;
CPU: a large numpy matmul's FLOP/s and a numpy copy's bandwidth, measured here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.floors import BANDWIDTH, PEAK  # noqa: E402
from engine.backends import create_backend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import LoadedModel, load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Workload:
    system: int  # shared system-prompt tokens
    requests: int  # (a): requests sharing it
    own: tuple[int, int]  # tokens of each request's (or turn's) own, uniform in this range
    output: int  # tokens generated per request or turn
    conversations: int  # (b)
    turns: int


GPU = Workload(system=1024, requests=256, own=(32, 256), output=128, conversations=64, turns=4)
CPU = Workload(system=512, requests=8, own=(32, 64), output=16, conversations=4, turns=3)


@dataclass
class Run:
    ttft_ms: list[float]
    output_tokens: int
    seconds: float
    computed_prompt_tokens: int
    waves: int  # rounds of requests submitted together


def run_requests(engine: LLMEngine, prompts: list[list[int]], output: int) -> tuple[Run, list[list[int]]]:
    """Submit `prompts` at once and step the engine as the server does until all are
    answered; returns the figures and each request's output tokens."""
    submitted, first, answers = {}, {}, {}
    generated, computed = 0, 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        seq = engine.make_sequence(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
        engine.add(seq)
        submitted[seq.request_id], answers[seq.request_id] = time.perf_counter(), []

    def on_deltas(deltas) -> None:
        nonlocal generated, computed
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids and d.request_id not in first:
                first[d.request_id] = now
            answers[d.request_id] += d.token_ids
            generated += len(d.token_ids)
            if d.finished:
                computed += d.usage.prompt_tokens - d.usage.cached_tokens
    while engine.has_work():
        engine.step_overlapped(on_deltas)
    ttft = [(first[rid] - t) * 1e3 for rid, t in submitted.items()]
    return Run(ttft, generated, time.perf_counter() - start, computed, 1), [answers[rid] for rid in submitted]


def shared_system_prompt(w: Workload, vocab: int, rng) -> list[list[int]]:
    system = rng.integers(0, vocab, w.system).tolist()
    return [system + rng.integers(0, vocab, rng.integers(*w.own)).tolist() for _ in range(w.requests)]


class Chats:
    """Multi-turn conversations: each turn is the conversation so far plus new user tokens."""

    def __init__(self, w: Workload, vocab: int, rng):
        self.w, self.vocab, self.rng = w, vocab, rng
        system = rng.integers(0, vocab, w.system).tolist()
        self.history = [system + self._user() for _ in range(w.conversations)]

    def _user(self) -> list[int]:
        return self.rng.integers(0, self.vocab, self.rng.integers(*self.w.own)).tolist()

    def run(self, engine: LLMEngine) -> Run:
        total = Run([], 0, 0.0, 0, 0)
        for _ in range(self.w.turns):
            run, answers = run_requests(engine, self.history, self.w.output)
            self.history = [h + a + self._user() for h, a in zip(self.history, answers)]
            total = Run(total.ttft_ms + run.ttft_ms, total.output_tokens + run.output_tokens,
                        total.seconds + run.seconds, total.computed_prompt_tokens + run.computed_prompt_tokens,
                        total.waves + 1)
        return total


def floor_seconds(run: Run, output: int, params: int, weight_bytes: int, flops: float, bandwidth: float) -> float:
    return run.computed_prompt_tokens * 2 * params / flops + run.waves * output * weight_bytes / bandwidth


def cached_first_token(engine: LLMEngine, w: Workload, vocab: int, rng, new_tokens: int = 64) -> str:
    """One request alone whose system prompt is cached, plus `new_tokens` of its own:
    its time to first token (median of 15, after 5), and the wall and GPU time of the
    one step that computes it (GPU time on CUDA only: from the step's start, so the
    host's work before the launch included, and of its CUDA graph's replay alone)."""
    system = rng.integers(0, vocab, w.system).tolist()
    run_requests(engine, [system + [1]], 1)  # caches it
    ttft, walls, gpus, replays = [], [], [], []
    for _ in range(20):
        ttft.append(run_requests(engine, [system + rng.integers(0, vocab, new_tokens).tolist()], 1)[0].ttft_ms[0])
        engine.add(engine.make_sequence("step", system + rng.integers(0, vocab, new_tokens).tolist(),
                                        SamplingParams(temperature=0.0, max_tokens=1)))
        if engine.backend.name == "cuda":
            from bench.step_times import timed_step

            wall, gpu = timed_step(engine, engine.backend)
            gpus.append(gpu)
            replays.append(graph_replay_ms(engine.backend, new_tokens))
        else:
            start = time.perf_counter()
            engine.step()
            wall = (time.perf_counter() - start) * 1e3
        walls.append(wall)
        while engine.has_work():
            engine.step()
    gpu = f", GPU {statistics.median(gpus[5:]):.2f} ms" if gpus else ""
    if any(r is not None for r in replays):
        gpu += f" (its graph's replay alone {statistics.median(replays[5:]):.2f} ms)"
    return (f"time to first token {statistics.median(ttft[5:]):.2f} ms; its step alone: wall "
            f"{statistics.median(walls[5:]):.2f} ms{gpu}")


def graph_replay_ms(backend, tokens: int) -> float | None:
    """GPU milliseconds of replaying the prompt graph that a step of `tokens` new tokens
    ran (its buffers still hold that step: the replay computes it again), or None where
    there is none."""
    graphs = getattr(backend, "graphs", None)
    bucket = next((b for b in graphs.prompt_buckets if b >= tokens), None) if graphs else None
    if bucket is None:
        return None
    from bench.profile_step import gpu_ms

    with backend._context():
        return gpu_ms(backend.stream, graphs.graphs["prompt", bucket][2].launch)


def new_tokens_floor_ms(tokens: int, params: int, weight_bytes: int, flops: float, bandwidth: float) -> float:
    """A step of `tokens` prompt tokens: their FLOPs at the peak plus one read of the weights."""
    return (tokens * 2 * params / flops + weight_bytes / bandwidth) * 1e3


def load(device: str) -> tuple[LoadedModel, float, float, tempfile.TemporaryDirectory | None]:
    """The model, and the compute peak and bandwidth the floors use."""
    if device == "cuda":
        from devtools.checkpoints import LLAMA_32_1B, make_model

        tmp = tempfile.TemporaryDirectory()
        make_model(Path(tmp.name), LLAMA_32_1B, seed=0)
        return load_model(tmp.name), PEAK, BANDWIDTH, tmp
    from bench.cpu_decode import matmul_flops, memory_bandwidth

    return load_model(), matmul_flops(), memory_bandwidth() / 2, None  # (a copy reads and writes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "numpy"], required=True,
                    help="numpy: the floors are numpy's float32 matmul rate and copy bandwidth, which the cpu "
                         "backend's integer products would exceed")
    ap.add_argument("--first-token-only", action="store_true", help="only (c), the time to first token after a cached prefix")
    args = ap.parse_args()
    w = GPU if args.device == "cuda" else CPU
    model, flops, bandwidth, tmp = load(args.device)
    c = model.config
    params = sum(int(np.prod(t.shape)) for t in model.weights.values())
    weight_bytes = params * (2 if args.device == "cuda" else 4)
    budget = 2048 if args.device == "cuda" else 256
    print(f"{model.name} on {args.device}: (a) {w.requests} requests, a {w.system}-token system prompt and "
          f"{w.own[0]}-{w.own[1]} of their own, {w.output} out; (b) {w.conversations} chats of {w.turns} turns")
    print(f"{'workload':>26} | {'cache':>5} | {'TTFT p50 ms':>11} | {'TTFT p99 ms':>11} | {'output tok/s':>12} | "
          f"{'prompt tokens computed':>22} | {'floor tok/s':>11}")
    for caching in (True,) if args.first_token_only else (False, True):
        backend = create_backend(args.device, c, model.model_weights())
        blocks = (w.requests * (w.system + w.own[1] + w.output)) // 16 + 64
        engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=blocks, max_num_seqs=w.requests,
                                                        max_num_batched_tokens=budget, enable_prefix_caching=caching))
        rng = np.random.default_rng(0)
        run_requests(engine, [rng.integers(0, c.vocab_size, 32).tolist()], 4)  # warm-up
        engine.reset_prefix_cache()
        runs = {} if args.first_token_only else {
            "(a) shared system prompt": run_requests(engine, shared_system_prompt(w, c.vocab_size, rng), w.output)[0],
            "(b) multi-turn chats": Chats(w, c.vocab_size, rng).run(engine)}
        for name, r in runs.items():
            floor = r.output_tokens / floor_seconds(r, w.output, params, weight_bytes, flops, bandwidth)
            p50, p99 = np.percentile(r.ttft_ms, [50, 99])
            print(f"{name:>26} | {'on' if caching else 'off':>5} | {p50:11.1f} | {p99:11.1f} | "
                  f"{r.output_tokens / r.seconds:12.0f} | {r.computed_prompt_tokens:>22} | {floor:11.0f}")
        if caching:
            floor_ms = new_tokens_floor_ms(64, params, weight_bytes, flops, bandwidth)
            print(f"(c) one request alone, its {w.system}-token system prompt cached, 64 new tokens: "
                  f"{cached_first_token(engine, w, c.vocab_size, rng)} (floor {floor_ms:.2f} ms)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()

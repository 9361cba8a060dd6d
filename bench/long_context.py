"""Long contexts on the CUDA engine (Llama 3.2 1B shape, bfloat16, random weights):
the time to first token of one 32,768-token prompt on an idle engine, and the time per
output token of batch 1 and batch 16 decoding at 32,768 tokens of context, each beside
its floor.

    python3 bench/long_context.py [--context 32768] [--batches 1,16] [--max-num-batched-tokens 8192]

Floors, at the H200's measured 4.27 TB/s and 790 TFLOP/s of bfloat16 matmul:
- the prompt: the linear layers' 2 FLOPs a weight a token (the head once), plus causal
  attention's QK^T and PV over the lower triangle, 2 x 2 x T^2 / 2 x heads x head_dim
  FLOPs a layer;
- a decode step: the weights once, plus every sequence's K and V (32 KB a token at this
  shape) once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.floors import BANDWIDTH, PEAK, decode_costs  # noqa: E402
from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, make_model  # noqa: E402


def prefill_floor_ms(c: ModelConfig, tokens: int) -> float:
    """The prompt's FLOPs (linear layers and causal attention) at the compute peak."""
    head = 2 * c.vocab_size * c.hidden_size
    linear = (decode_costs(c)[2] - head) * tokens + head  # (the head for the last token only)
    attention = c.num_layers * 2 * 2 * tokens * tokens / 2 * c.q_size
    return (linear + attention) / PEAK * 1e3


def decode_floor_ms(c: ModelConfig, batch: int, context: int) -> float:
    """A decode step's bytes (weights once, each sequence's K/V once) at the bandwidth."""
    weight_bytes, kv_bytes_per_token, _ = decode_costs(c)
    return (weight_bytes + batch * context * kv_bytes_per_token) / BANDWIDTH * 1e3


def run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """All prompts submitted at once: (time to the first token of any, ms; the gaps, ms,
    between the steps that delivered a token to every sequence, once every prompt was in)."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        engine.add(engine.make_sequence(f"r{i}", prompt, params))
    first: list[float] = []  # (when some but not all sequences had a token)
    arrivals: list[float] = []

    def on_deltas(deltas) -> None:
        if sum(bool(d.token_ids) for d in deltas) == len(prompts):
            arrivals.append(time.perf_counter())
        elif any(d.token_ids for d in deltas) and not first:
            first.append(time.perf_counter())
    start = time.perf_counter()
    while engine.has_work():
        engine.step_overlapped(on_deltas)
    ttft = ((first or arrivals)[0] - start) * 1e3
    return ttft, [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768, help="prompt tokens (and so the decode steps' context)")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens each decoding sequence generates")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prompt's chunk a step")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), LLAMA_32_1B, seed=0)
        model = load_model(tmp)
    c = model.config
    tokens = args.context + args.new_tokens
    blocks = max(batches) * (-(-tokens // 16) + 1) + 64
    backend = CudaBackend(c, model.model_weights())
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=blocks, max_num_seqs=max(batches),
                                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                                    max_model_len=tokens))

    def prompts(n: int) -> list[list[int]]:  # (random: the prefix cache holds none of them)
        return [rng.integers(0, 128000, args.context).tolist() for _ in range(n)]
    run(engine, prompts(1), 2)  # warm-up: kernels loaded, graphs captured
    ttfts = [run(engine, prompts(1), 1)[0] for _ in range(3)]
    print(f"Llama 3.2 1B shape, bfloat16, random weights; {args.context}-token prompts, chunks of "
          f"{args.max_num_batched_tokens} tokens a step; floors at {BANDWIDTH / 1e12:.2f} TB/s, {PEAK / 1e12:.0f} TFLOP/s")
    print(f"{'metric':<52} | {'ms':>8} | {'floor ms':>8} | {'x floor':>7}")
    floor = prefill_floor_ms(c, args.context)
    ttft = statistics.median(ttfts)
    print(f"{f'time to first token, {args.context}-token prompt, idle':<52} | {ttft:8.1f} | {floor:8.1f} | "
          f"{ttft / floor:7.2f}")
    for batch in batches:
        _, gaps = run(engine, prompts(batch), args.new_tokens)
        tpot, floor = statistics.median(gaps), decode_floor_ms(c, batch, args.context + args.new_tokens // 2)
        print(f"{f'time per output token, batch {batch}, {args.context} context':<52} | {tpot:8.2f} | {floor:8.2f} | "
              f"{tpot / floor:7.2f}")
    graphs = backend.graphs
    print(f"({graphs.long_decode_replays} decode steps replayed a graph of contexts up to {graphs.long_context} tokens)")


if __name__ == "__main__":
    main()

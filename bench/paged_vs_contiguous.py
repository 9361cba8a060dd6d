"""Paged KV cache against one contiguous max-length slab per sequence, under the same
KV-cache memory, on the offline workload (the question every reader of PagedAttention
asks). The engine with block size equal to the context length is exactly the older
scheme: each admitted sequence takes one slab of --max-model-len tokens.

    python bench/paged_vs_contiguous.py --device cuda --kv-cache-gb 4     # Llama 3.2 1B shape, random weights
    python bench/paged_vs_contiguous.py --device cpu --model tests/fixtures/tiny-llama \\
        --requests 64 --input-len 10:100 --output-len 10:100 --max-model-len 256 --kv-cache-gb 0.001

Paged, the scheduler's admission may keep room for outputs to come (--output-reserve,
each value a row): with none it admits while prompts fit and preempts (recomputing)
when outputs outgrow the cache.

Prints, for each scheme: the sequences the memory holds at full length, the mean and
peak number of sequences running per step, preemptions, steps, and output tokens/s;
on the GPU beside its floor: decode steps of the scheme's mean running sequences at the
workload's mean context, on an H200 (bench/floors.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.floors import decode_floor_tokens_per_s  # noqa: E402
from engine.backends import create_backend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import DEFAULT_OUTPUT_RESERVE  # noqa: E402


def run(model, backend, block_size: int, num_blocks: int, reserve: float, args, prompts, outputs) -> dict:
    engine = LLMEngine(model, backend, EngineConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                                    max_num_seqs=args.requests, max_model_len=args.max_model_len,
                                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                                    output_reserve=reserve))
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        engine.add(engine.make_sequence(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)))
    running, generated = [], 0
    start = time.perf_counter()
    while engine.has_work():
        generated += sum(len(o.token_ids) for o in engine.step())
        running.append(len(engine.scheduler.running))
    elapsed = time.perf_counter() - start
    return {"fits": num_blocks * block_size // args.max_model_len, "mean": float(np.mean(running)), "peak": max(running),
            "preemptions": engine.scheduler.num_preemptions, "tok_s": generated / elapsed, "steps": len(running)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--model", help="Hugging Face directory (default on cuda: the Llama 3.2 1B shape, random weights)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--input-len", default="100:1024")
    ap.add_argument("--output-len", default="100:1024")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gb", type=float, default=4.0, help="KV-cache memory, the same for both schemes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--output-reserve", default=f"0,{DEFAULT_OUTPUT_RESERVE},0.5,1",
                    help="paged rows: admission's reserves, comma-separated (the engine's default among them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            from devtools.checkpoints import LLAMA_32_1B, make_model

            make_model(Path(tmp), LLAMA_32_1B, seed=0)
            path = tmp
        model = load_model(path)
    backend = create_backend(args.device, model.config, model.model_weights())
    rng = np.random.default_rng(0)
    (lo_in, hi_in), (lo_out, hi_out) = (map(int, r.split(":")) for r in (args.input_len, args.output_len))
    prompts = [rng.integers(0, model.config.vocab_size, rng.integers(lo_in, hi_in + 1)).tolist() for _ in range(args.requests)]
    outputs = rng.integers(lo_out, hi_out + 1, args.requests).tolist()
    budget_tokens = int(args.kv_cache_gb * 2**30 // backend.kv_cache_bytes_per_block(1))
    print(f"{model.config.num_layers}-layer model on {backend.name}; KV cache {args.kv_cache_gb} GB = {budget_tokens} tokens; "
          f"{args.requests} requests, input {args.input_len}, output {args.output_len}, context {args.max_model_len}")
    print(f"{'scheme':<40} | {'seqs at full length':>19} | {'mean running':>12} | {'peak':>5} | {'preempt':>7} | "
          f"{'steps':>6} | {'out tok/s':>9} | {'floor':>7}")
    context = np.mean([len(p) for p in prompts]) + np.mean(outputs) / 2
    schemes = [(f"paged, 16-token blocks, reserve {r}", 16, float(r)) for r in args.output_reserve.split(",")]
    for label, bs, reserve in schemes + [(f"contiguous, one {args.max_model_len}-token slab", args.max_model_len, 0.0)]:
        r = run(model, backend, bs, budget_tokens // bs, reserve, args, prompts, outputs)
        floor = (f"{decode_floor_tokens_per_s(model.config, r['mean'], context):7.0f}" if backend.name == "cuda"
                 else "      -")
        print(f"{label:<40} | {r['fits']:>19} | {r['mean']:12.1f} | {r['peak']:>5} | {r['preemptions']:>7} | "
              f"{r['steps']:>6} | {r['tok_s']:9.1f} | {floor}", flush=True)


if __name__ == "__main__":
    main()

"""Decode throughput of SmolLM2-135M-Instruct on the CPU: llamastream's numpy backend
beside Hugging Face transformers (when torch is installed), on the same prompts.

    python bench/cpu_decode.py [--new-tokens 128]

Both run in float32 and generate exactly --new-tokens tokens per sequence (eos
ignored); tokens/s counts generated tokens over the wall time of the whole
generation, prefill included. The floor is the float32 weight bytes read per
decode step over this machine's memory bandwidth (a numpy copy, measured here), or
the matmul FLOPs per step over a large numpy matmul's FLOP/s, whichever is slower.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.numpy_backend import NumpyBackend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import embedded_model_path, load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.", "Explain photosynthesis simply.",
    "List three prime numbers.", "Why is the sky blue?", "Describe a cat in one sentence.",
    "What is 12 times 12?", "Name a famous painter.",
]


def memory_bandwidth() -> float:
    """Bytes per second of a large numpy copy (read + write)."""
    a = np.ones(2**27 // 4, dtype=np.float32)  # 128 MiB
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best


def matmul_flops() -> float:
    """FLOP/s of a large float32 numpy matmul: the compute peak this machine offers numpy."""
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    best = min(_timed(lambda: a @ a) for _ in range(5))
    return 2 * 1024**3 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours(model, prompts: list[list[int]], new_tokens: int, seeded: bool | None = None) -> float:
    """Greedy decoding, or with `seeded` set, sampling (temperature 1, top-p 0.9) with
    or without a seed per request."""
    engine = LLMEngine(model, NumpyBackend(model.config, model.model_weights()), EngineConfig(num_kv_blocks=1024, max_num_seqs=64))
    params = [SamplingParams(temperature=0.0 if seeded is None else 1.0, top_p=1.0 if seeded is None else 0.9,
                             seed=i if seeded else None, max_tokens=new_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    seqs = [engine.make_sequence(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for s in seqs:
        engine.add(s)
    generated = 0
    while engine.has_work():
        generated += sum(len(o.token_ids) for o in engine.step())
    assert generated == new_tokens * len(prompts)
    return generated / (time.perf_counter() - start)


def transformers_tps(prompts: list[list[int]], new_tokens: int) -> float | None:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape[1] - width == new_tokens
    return new_tokens * len(prompts) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    model = load_model()
    tok = model.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}])[0] for q in QUESTIONS]
    embed_bytes = model.weights["model.embed_tokens.weight"].float32().nbytes
    weight_bytes = sum(w.float32().nbytes for w in model.weights.values())  # tied head: the embedding is read again
    step_bytes = weight_bytes + (embed_bytes if model.config.tie_word_embeddings else 0)
    flops_per_token = 2 * step_bytes / 4  # a multiply-add per weight; attention is small at these lengths
    bandwidth, peak = memory_bandwidth(), matmul_flops()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"memory copy {bandwidth / 1e9:.1f} GB/s; numpy matmul {peak / 1e9:.0f} GFLOP/s; "
          f"per decode step: {step_bytes / 1e6:.0f} MB of float32 weights, {flops_per_token / 1e6:.0f} MFLOP per sequence")
    print(f"{'batch':>5} | {'llamastream tok/s':>17} | {'transformers tok/s':>18} | {'ceiling tok/s (floor)':>21}")
    for batch in (1, 8):
        ps = prompts[:batch]
        hf = transformers_tps(ps, args.new_tokens)
        step_s = max(step_bytes / bandwidth, batch * flops_per_token / peak)
        hf_text = f"{hf:18.1f}" if hf else f"{'(torch not installed)':>18}"
        print(f"{batch:>5} | {ours(model, ps, args.new_tokens):17.1f} | {hf_text} | {batch / step_s:21.1f}")
    print("sampled, temperature 1 and top-p 0.9, batch 4:")
    print(f"{'seeds':>11} | {'llamastream tok/s':>17}")
    for seeded in (False, True):
        print(f"{'per request' if seeded else 'none':>11} | {ours(model, prompts[:4], args.new_tokens, seeded):17.1f}")


if __name__ == "__main__":
    main()

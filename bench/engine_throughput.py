"""Offline throughput of the CUDA engine (the nano-vllm benchmark): 256 requests with
prompt and output lengths uniform in 100..1024 random tokens, eos ignored, all
submitted at once; Llama 3.2 1B shape, bfloat16 (or FP8 or INT4 layers with --format,
INT4 kept INT4 on the GPU), random weights.

    python bench/engine_throughput.py [--model llama-3.2-1b|qwen3-0.6b] [--requests 256] [--batch-invariant]
                                      [--format bf16|fp8|fp8-dynamic|fp8-blocks|fp8-head|int4]
                                      [--kv-cache-dtype auto|fp8] [--kv-cache-gb G] [--block-size 16]
                                      [--no-transformers]   # NVIDIA GPU, torch

By default the KV cache holds every request at once; `--kv-cache-gb` gives it that much
memory instead, so that the requests it does not hold wait (or are preempted), and
`--kv-cache-dtype fp8` then holds twice the tokens in it.

Beside it, in the same run, transformers' `generate` on the same requests as one
static batch: prompts left-padded, every row decoding to the longest output, and
only each request's own output tokens counted (what a server without continuous
batching delivers).

The floor: a decode step at batch B reads the weights once (2.47 GB at the Llama 3.2
1B shape, the tied head read again) and each sequence's K/V (32 KB a token there) and
does 2 FLOPs a weight per sequence; at the workload's mean context and the H200's
measured 4.27 TB/s and 790 TFLOP/s, the larger of the two times bounds the output
tokens per second.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pycuda.driver as cuda

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.base import KV_CACHE_DTYPES  # noqa: E402
from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.backends.cuda.linear import LinearWeight  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from devtools.checkpoints import SHAPES, make_model  # noqa: E402
from devtools.quantized import MODEL_FORMATS  # noqa: E402
from bench.floors import BANDWIDTH, PEAK, decode_costs  # noqa: E402


def weight_bytes_read(backend: CudaBackend) -> int:
    """The bytes of one pass over the weights as uploaded (FP8 or INT4 codes and their
    scales, where quantized): every layer matrix and the head once."""
    w = backend.weights
    return sum(x.nbytes for layer in w.layers for x in layer.values() if isinstance(x, LinearWeight)) + w.lm_head.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="llama-3.2-1b", help="the shape of the random model")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--batch-invariant", action="store_true", help="GEMMs in fixed row tiles, as the server's flag")
    ap.add_argument("--format", choices=sorted(MODEL_FORMATS), default="bf16",
                    help="the layers' weights (devtools/quantized.py's MODEL_FORMATS): bfloat16, FP8 with a scale "
                         "a row, the same with W8A8 steps, with 128x128 block scales, with the head too (plain or W8A8), or INT4")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="bfloat16 (auto) or FP8 e4m3 K/V")
    ap.add_argument("--kv-cache-gb", type=float, help="memory for the KV cache (default: room for every request)")
    ap.add_argument("--block-size", type=int, default=16, help="positions a KV block (a power of two)")
    ap.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip the transformers run")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(100, 1025, args.requests)
    output_lens = rng.integers(100, 1025, args.requests)
    tmp = tempfile.TemporaryDirectory()
    make_model(Path(tmp.name), SHAPES[args.model], seed=0)
    model = MODEL_FORMATS[args.format](load_model(tmp.name))
    backend = CudaBackend(model.config, model.model_weights(), batch_invariant=args.batch_invariant,
                          kv_cache_dtype=args.kv_cache_dtype, int4_weights=True)
    blocks = int((prompt_lens + output_lens).sum() // args.block_size + 2 * args.requests)
    if args.kv_cache_gb:
        blocks = int(args.kv_cache_gb * 1e9 // backend.kv_cache_bytes_per_block(args.block_size))
    building = time.perf_counter()
    engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=blocks, max_num_seqs=args.requests,
                                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                                    block_size=args.block_size))
    ready_s = time.perf_counter() - building  # the KV cache, and every decode graph captured
    warm = engine.make_sequence("warm", [1] * 64, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.add(warm)
    while engine.has_work():
        engine.step()
    prompts = [rng.integers(0, 128000, p).tolist() for p in prompt_lens]
    seqs = [engine.make_sequence(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=int(o), ignore_eos=True))
            for i, (p, o) in enumerate(zip(prompts, output_lens))]
    timeline = StepTimeline(backend)
    start = time.perf_counter()
    for s in seqs:
        engine.add(s)
    generated, steps = 0, 0

    def count(deltas) -> None:
        nonlocal generated
        generated += sum(len(o.token_ids) for o in deltas)
    while engine.has_work():  # as the server steps
        steps += engine.step_overlapped(count)
    elapsed = time.perf_counter() - start
    assert generated == output_lens.sum()
    # floor at batch B = all requests, mean context = mean prompt + half the mean output
    B, context = args.requests, prompt_lens.mean() + output_lens.mean() / 2
    weight_bytes, kv_bytes_per_token, flops_per_token = decode_costs(model.config)
    kv_bytes_per_token //= 2 if args.kv_cache_dtype == "fp8" else 1
    if args.format != "bf16":
        weight_bytes = weight_bytes_read(backend)
    step_s = max((weight_bytes + B * context * kv_bytes_per_token) / BANDWIDTH, B * flops_per_token / PEAK)
    theirs = f"{transformers_static_batch(tmp.name, prompts, output_lens):.0f}" if args.transformers else "-"
    tmp.cleanup()
    print(f"model: {args.model} shape, random weights, {args.format}, {backend.kv_cache_dtype} KV cache of {blocks} blocks "
          f"of {args.block_size} ({blocks * args.block_size / (prompt_lens + output_lens).mean():.0f} requests of the "
          f"mean length at once)")
    print(f"{'requests':>8} | {'output tokens':>13} | {'steps':>6} | {'time (s)':>8} | {'output tok/s':>12} | "
          f"{'transformers tok/s':>18} | {'floor tok/s':>11}")
    print(f"{B:>8} | {generated:>13} | {steps:>6} | {elapsed:8.1f} | {generated / elapsed:12.0f} | {theirs:>18} | "
          f"{B / step_s:11.0f}")
    graphs = backend.graphs
    print(f"(CUDA graph replays: {graphs.decode_replays + graphs.prompt_replays if graphs else 0} of {steps} steps; KV blocks: {blocks}; the cache and "
          f"{len(graphs.graphs) if graphs else 0} graphs ready in {ready_s:.2f} s)")
    timeline.report(elapsed)


def transformers_static_batch(model_dir: str, prompts: list[list[int]], output_lens: np.ndarray) -> float:
    """Output tokens/s of transformers' generate over all requests in one batch (see the docstring)."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every row's last prompt token in the last column
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    new = int(output_lens.max())
    with torch.no_grad():
        hf.generate(ids[:2].cuda(), attention_mask=mask[:2].cuda(), max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                    pad_token_id=0)
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del hf
    torch.cuda.empty_cache()
    return float(output_lens.sum()) / elapsed


class StepTimeline:
    """Where the run's wall time went: each step's GPU span (events on the backend's
    stream around it) and the time the engine thread sat waiting for it, by kind of step."""

    def __init__(self, backend: CudaBackend):
        self.backend, self.steps = backend, []
        launch = backend.launch

        def mark() -> cuda.Event:
            with backend._context():
                event = cuda.Event()
                event.record(backend.stream)
            return event

        def timed_launch(batch, masks=None):
            begin = mark()
            wait = launch(batch, masks)
            end = mark()
            record = {"prefill": any(s.start < len(s.seq.prompt_ids) for s in batch), "rows": len(batch),
                      "events": (begin, end), "blocked": 0.0}
            self.steps.append(record)

            def timed_wait():
                t = time.perf_counter()
                out = wait()
                record["blocked"] = time.perf_counter() - t
                return out
            return timed_wait
        backend.launch = timed_launch

    def gpu_ms(self, prefill: bool) -> list[float]:
        """The GPU span of each step with (or without) prompt rows, in ms."""
        with self.backend._context():
            return [r["events"][1].time_since(r["events"][0]) for r in self.steps if r["prefill"] == prefill]

    def report(self, elapsed: float) -> None:
        print(f"\n{'steps':>16} | {'count':>6} | {'mean rows':>9} | {'GPU s':>6} | {'engine blocked s':>16}")
        for kind, prefill in (("with prompt rows", True), ("decode only", False)):
            chosen = [r for r in self.steps if r["prefill"] == prefill]
            gpu = sum(self.gpu_ms(prefill)) / 1e3
            rows = np.mean([r["rows"] for r in chosen]) if chosen else 0
            print(f"{kind:>16} | {len(chosen):>6} | {rows:9.1f} | {gpu:6.2f} | {sum(r['blocked'] for r in chosen):16.2f}")
        print(f"(wall {elapsed:.2f} s: the GPU idles for whatever of it the steps' GPU time does not cover)")


if __name__ == "__main__":
    main()

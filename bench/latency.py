"""Batch-1 latency of the CUDA engine at the Llama 3.2 1B shape (random weights; bfloat16,
or the layers in a quantized format with --format): time per output token (128-token
prompt, 256 new tokens; greedy, and once with top-k and top-p sampling) and time to
first token (one 1024-token prompt, idle engine), beside the floor and, in the same
run, two peers: transformers' generate, and a plain PyTorch decode step compiled by
torch.compile and replayed as a CUDA graph (bench/torch_decode.py; also eager in a
graph). The peers run the bfloat16 checkpoint; INT4 stays INT4 on the GPU here (the
server dequantizes it at load).

    python bench/latency.py [--format bf16|fp8|fp8-dynamic|fp8-blocks|fp8-head|int4]
                            [--no-transformers] [--no-torch]   # an NVIDIA GPU, torch and transformers

Floors: decode reads every weight once per token (in bfloat16 2.47 GB at the 4.27 TB/s
copy bandwidth measured on the H200: 0.58 ms; quantized, its codes and scales);
prefill of 1024 tokens does 2.6 TFLOP (2 x 1.24 G parameters x 1024) at about 790
TFLOP/s of bf16 matmul: 3.2 ms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import torch_decode  # noqa: E402
from bench.engine_throughput import StepTimeline, weight_bytes_read  # noqa: E402
from bench.floors import BANDWIDTH, PEAK  # noqa: E402
from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, make_model  # noqa: E402
from devtools.quantized import MODEL_FORMATS  # noqa: E402

PREFILL_FLOOR_MS = 2 * 1.24e9 * 1024 / PEAK * 1e3


GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95)  # the sampling kernel's slowest path: both filters


def ours(engine: LLMEngine, prompt: list[int], new_tokens: int, sampling: dict = GREEDY) -> tuple[float, float]:
    """(time to first token, median time between later tokens), in ms, as the engine
    hands its deltas to the server."""
    params = SamplingParams(**sampling, max_tokens=new_tokens, ignore_eos=True, seed=0)
    seq = engine.make_sequence("bench", prompt, params)
    engine.add(seq)
    arrivals = []

    def on_deltas(deltas) -> None:
        if any(d.token_ids for d in deltas):
            arrivals.append(time.perf_counter())
    start = time.perf_counter()
    while engine.has_work():  # as the server steps
        engine.step_overlapped(on_deltas)
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    return (arrivals[0] - start) * 1e3, statistics.median(gaps) if gaps else float("nan")


def transformers_per_token(model_dir: str, prompt: list[int], new_tokens: int) -> float:
    """transformers' greedy generate at batch 1, ms per token after a warm-up."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / new_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=sorted(MODEL_FORMATS), default="bf16",
                    help="our engine's weights (devtools/quantized.py's MODEL_FORMATS)")
    ap.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip the transformers run")
    ap.add_argument("--no-torch", dest="torch", action="store_false", help="skip the PyTorch decode step")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), LLAMA_32_1B, seed=0)
        model = MODEL_FORMATS[args.format](load_model(tmp))
        prompt = list(range(1000, 1128))
        tpot, ttft, gpu_step = {}, {}, {}
        for graphs, invariant in ((False, False), (True, True), (True, False)):
            backend = CudaBackend(model.config, model.model_weights(), cuda_graphs=graphs, batch_invariant=invariant,
                                  int4_weights=True)
            engine = LLMEngine(model, backend, EngineConfig(num_kv_blocks=4096))
            ours(engine, prompt, 16)  # warm-up: kernels loaded, pool filled, graph captured
            # (each prompt its own: repeated, the prefix cache would hold all but its last block)
            ttft[graphs, invariant] = statistics.median(ours(engine, list(range(2000 + 1100 * i, 3024 + 1100 * i)), 1)[0]
                                                        for i in range(15))
            if graphs and not invariant:
                sampled_tpot = ours(engine, prompt, 256, SAMPLED)[1]
            timeline = StepTimeline(backend)  # (from here on, events around each step time it on the GPU)
            tpot[graphs, invariant] = ours(engine, prompt, 256)[1]
            gpu_step[graphs, invariant] = statistics.median(timeline.gpu_ms(prefill=False))
        decode_floor_ms = weight_bytes_read(backend) / BANDWIDTH * 1e3  # (the weights as uploaded: any of the three)
        hf_tpot = transformers_per_token(tmp, prompt, 256) if args.transformers else float("nan")
        peer = torch_decode.per_token_ms(tmp, prompt, 256) if args.torch else {}
    rows = [("batch-1 time per output token (ms)", tpot[True, False], decode_floor_ms),
            ("  the same, --enforce-eager (no CUDA graphs)", tpot[False, False], decode_floor_ms),
            ("  the same, --batch-invariant", tpot[True, True], decode_floor_ms),
            ("  the same, top-k 50 and top-p 0.95 sampling", sampled_tpot, decode_floor_ms),
            ("  peer: transformers generate", hf_tpot, decode_floor_ms),
            ("  peer: PyTorch step, torch.compile + CUDA graph", peer.get("compiled", float("nan")), decode_floor_ms),
            ("  peer: PyTorch step, eager in a CUDA graph", peer.get("eager", float("nan")), decode_floor_ms),
            ("time to first token, 1024-token prompt (ms)", ttft[True, False], PREFILL_FLOOR_MS),
            ("  the same, --batch-invariant", ttft[True, True], PREFILL_FLOOR_MS)]
    print(f"weights: {args.format}")
    print(f"{'metric':<50} | {'ms':>7} | {'floor':>6}")
    for label, ms, floor in rows:
        print(f"{label:<50} | {ms:7.2f} | {floor:6.2f}")
    print(f"(a decode step's GPU span, median: {gpu_step[True, False]:.2f} ms with CUDA graphs, {gpu_step[False, False]:.2f} "
          f"eager, {gpu_step[True, True]:.2f} batch-invariant; what a token takes beyond it, the GPU waits for the host)")
    if peer:
        print(f"(the PyTorch step's last-prompt-token logits against transformers': rel. L2 {peer['logits error']:.2e}; "
              "its figures are the GPU's alone, a graph replaying the next)")


if __name__ == "__main__":
    main()

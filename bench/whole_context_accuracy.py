"""Whether a prompt's attention over whole contexts (each query tile's context in one
partition, no merge: engine/backends/cuda/step_metadata.py's is_whole_context_prompt)
is as close to the float32 model as over partitions merged. Random prompts of 1,024 to
2,048 tokens at the Llama 3.2 1B and Qwen3-0.6B shapes (random weights), each computed
by the CUDA backend with contexts split and whole, against transformers in float32,
with transformers' bfloat16 (eager attention) beside: per prompt and on average, the
last position's logits' relative L2 error, and the error of the log-probability each
gives float32's first token (the bars of tests/gpu/test_model.py's comparisons, which
take 8 prompts of 1 to 2,000 tokens: too few to settle a change of the threshold).

    python3 bench/whole_context_accuracy.py [--prompts 16]   # NVIDIA GPU, torch and transformers
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_accuracy import rel  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, QWEN3_06B, make_model  # noqa: E402
from devtools.probes import our_logits  # noqa: E402
from engine.backends.cuda import step_metadata  # noqa: E402
from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from engine.sampler import log_softmax  # noqa: E402

THRESHOLDS = {"split": 2**30, "whole": 1}  # WHOLE_CONTEXT_PROMPT: never, always


def logits_with(engine: LLMEngine, ids: list[int], whole_context_prompt: int) -> np.ndarray:
    """Our last position's logits of `ids` with WHOLE_CONTEXT_PROMPT at the given size."""
    shipped = step_metadata.WHOLE_CONTEXT_PROMPT
    step_metadata.WHOLE_CONTEXT_PROMPT = whole_context_prompt
    try:
        return our_logits(engine, ids)
    finally:
        step_metadata.WHOLE_CONTEXT_PROMPT = shipped


def compare(name: str, shape: dict, hf_class: str, lengths: list[int], seed: int) -> None:
    import transformers

    rng = np.random.default_rng(seed)
    errors = {k: ([], []) for k in (*THRESHOLDS, "transformers bf16")}  # (rel. L2, log-prob error) a prompt
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        make_model(path, shape, seed=0)
        load = getattr(transformers, hf_class).from_pretrained
        hf32 = load(path, dtype=torch.float32).cuda().eval()
        hf16 = load(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
        model = load_model(path)
        engine = LLMEngine(model, CudaBackend(model.config, model.model_weights()),
                           EngineConfig(num_kv_blocks=1024, max_num_batched_tokens=4096))
        print(f"\n{name} shape: per prompt, rel. L2 of the logits / log-prob error of float32's first token")
        print(f"{'tokens':>6} | " + " | ".join(f"{k:>22}" for k in errors))
        for n in lengths:
            ids = rng.integers(0, 128000, n).tolist()
            with torch.no_grad():
                ref, b16 = (m(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu().numpy() for m in (hf32, hf16))
            logits = {"transformers bf16": b16} | {key: logits_with(engine, ids, threshold)
                                                    for key, threshold in THRESHOLDS.items()}
            best = int(ref.argmax())
            exact = log_softmax(ref.astype(np.float64))[best]
            for key, values in logits.items():
                errors[key][0].append(rel(values, ref))
                errors[key][1].append(abs(log_softmax(values.astype(np.float64))[best] - exact))
            print(f"{n:>6} | " + " | ".join(f"{e[0][-1]:10.2e} / {e[1][-1]:9.2e}" for e in errors.values()))
        print(f"{'mean':>6} | " + " | ".join(f"{np.mean(e[0]):10.2e} / {np.mean(e[1]):9.2e}" for e in errors.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="a shape, of 1,024 to 2,048 tokens")
    args = ap.parse_args()
    lengths = np.random.default_rng(0).integers(1024, 2049, args.prompts).tolist()
    compare("Llama 3.2 1B", LLAMA_32_1B, "LlamaForCausalLM", lengths, seed=1)
    compare("Qwen3-0.6B", QWEN3_06B, "Qwen3ForCausalLM", lengths, seed=2)


if __name__ == "__main__":
    main()

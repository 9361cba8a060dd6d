"""How far each bfloat16 implementation is from the float32 model, at the Llama 3.2 1B
shape (random weights, seed 0, the config in DESIGN.md), by prompt length.

    python bench/gpu_accuracy.py          # on a machine with an NVIDIA GPU, torch and transformers

Prints, per prompt length, the relative L2 error of last-position logits against
transformers in float32 (the reference) for: llamastream's CUDA backend, transformers
in bfloat16 (sdpa and eager attention), and llamastream's numpy backend (float32), and
the error between the CUDA backend and transformers' bfloat16.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.cuda.backend import CudaBackend  # noqa: E402
from engine.backends.numpy_backend import NumpyBackend  # noqa: E402
from engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from engine.model_loader import load_model  # noqa: E402
from devtools.checkpoints import LLAMA_32_1B, TEXT, make_model  # noqa: E402
from devtools.probes import our_logits, teacher_forced_argmax  # noqa: E402


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main() -> None:
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        hf16 = make_model(path, LLAMA_32_1B, seed=0).cuda()
        hf32 = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        eager = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").cuda().eval()
        model = load_model(path)
        cuda = LLMEngine(model, CudaBackend(model.config, model.model_weights()), EngineConfig(num_kv_blocks=1024))
        numpy = LLMEngine(model, NumpyBackend(model.config, model.model_weights()), EngineConfig(num_kv_blocks=256))
        ids_all = [128000] + cuda.tokenizer.encode(TEXT * 60, add_special_tokens=False)
        print(f"{'tokens':>6} | {'cuda vs fp32':>12} | {'hf bf16 sdpa vs fp32':>20} | {'hf bf16 eager vs fp32':>21} | "
              f"{'numpy vs fp32':>13} | {'cuda vs hf bf16':>15}")
        for n in (1, 17, 300, 2000):
            ids = ids_all[:n]

            def hf(m):
                with torch.no_grad():
                    return m(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu().numpy()

            ref, b16, b16e = hf(hf32), hf(hf16), hf(eager)
            ours = our_logits(cuda, ids)
            np_err = f"{rel(our_logits(numpy, ids), ref):13.2e}" if n <= 300 else f"{'(skipped)':>13}"
            print(f"{n:>6} | {rel(ours, ref):12.2e} | {rel(b16, ref):20.2e} | {rel(b16e, ref):21.2e} | {np_err} | {rel(ours, b16):15.2e}")
        teacher_forced(cuda, {"fp32": hf32, "bf16 sdpa": hf16, "bf16 eager": eager}, ids_all[:17])


def teacher_forced(engine, models: dict, prompt: list[int], steps: int = 256) -> None:
    """Greedy argmax agreement along one fixed continuation (float32 transformers' own)."""
    with torch.no_grad():
        seq_ids = models["fp32"].generate(torch.tensor([prompt], device="cuda"), max_new_tokens=steps,
                                          min_new_tokens=steps, do_sample=False)[0].tolist()
        preds = {name: m(torch.tensor([seq_ids], device="cuda")).logits[0].float().argmax(-1).cpu().numpy()[len(prompt) - 1 : -1]
                 for name, m in models.items()}
    preds["cuda (ours)"] = teacher_forced_argmax(engine, prompt, seq_ids)
    print(f"\nteacher-forced greedy agreement over {steps} steps (17-token prompt, fp32's own continuation):")
    names = list(preds)
    for a in names:
        print("  " + a.ljust(12) + " ".join(f"{b}: {np.mean(preds[a] == preds[b]):6.1%}" for b in names if b != a))


if __name__ == "__main__":
    main()

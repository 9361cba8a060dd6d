"""Write the AWQ and GPTQ checkpoints that llamastream's INT4 readers are tested against,
with GPTQModel (the maintained library that quantizes, writes and reads both formats).

Run by hand (CI never runs it), then commit what it writes under tests/fixtures/:

    python -m venv .venv-golden && .venv-golden/bin/pip install torch==2.14.1 transformers==5.24.0 \
        gptqmodel==7.7.0
    GPTQMODEL_CPU_WORKERS=2 .venv-golden/bin/python tests/golden/make_int4_fixtures.py

GPTQModel quantizes the tiny random Llama of make_fixtures.py on random calibration
tokens, with its own GPTQ (act-order asymmetric groups in the original "gptq" format,
and symmetric groups in order) and its own AWQ (the GEMM layout, on a copy of the tiny
Llama whose projections have multiples of 64 outputs, as its search needs), and saves
each checkpoint (tiny-llama-<scheme>/). Each is then loaded back by GPTQModel;
tiny_llama_int4_golden.npz holds, per scheme, every linear weight as the library
dequantizes it (its float16 scales widened exactly) and the logits of the golden
prompts of transformers' float32 Llama holding those weights.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
from gptqmodel.quantization import FORMAT, METHOD
from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SOURCE = FIXTURES / "tiny-llama"
EXTRAS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
PROMPTS = [[0, 17, 93, 250, 4, 11], list(range(1, 40)), [0] + [7, 300, 12] * 20]
SCHEMES = {  # name: (quantize config, source widened to multiples of 64 outputs)
    "gptq-act-order": (dict(bits=4, group_size=32, desc_act=True, sym=False), False),
    "gptq-sym": (dict(bits=4, group_size=32, desc_act=False, sym=True), False),
    "awq": (dict(bits=4, group_size=32, sym=False, quant_method=METHOD.AWQ, format=FORMAT.GEMM), True),
}


def widened_source(out: Path) -> Path:
    """The tiny Llama's config with 4 KV heads and 192 intermediate columns, random weights."""
    config = LlamaConfig.from_pretrained(SOURCE)
    config.num_key_value_heads, config.intermediate_size = 4, 192
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for extra in EXTRAS:
        shutil.copy(SOURCE / extra, out / extra)
    return out


def quantize(name: str, source: Path, settings: dict) -> Path:
    rng = np.random.default_rng(0)
    calibration = [{"input_ids": torch.tensor([rng.integers(0, 300, 48).tolist()]),
                    "attention_mask": torch.ones(1, 48, dtype=torch.long)} for _ in range(16)]
    model = GPTQModel.load(str(source), QuantizeConfig(**settings, offload_to_disk=False), device="cpu")
    model.quantize(calibration, batch_size=1)
    out = FIXTURES / f"tiny-llama-{name}"
    shutil.rmtree(out, ignore_errors=True)
    model.save(str(out))
    (out / "quant_log.csv").unlink(missing_ok=True)
    return out


def dequantized(out: Path, awq: bool) -> dict[str, np.ndarray]:
    """Every quantized linear's weight [out, in] as GPTQModel dequantizes it, in float32."""
    model = GPTQModel.load(str(out), device="cpu", dtype=torch.float16,
                           backend=BACKEND.AWQ_TORCH if awq else BACKEND.TORCH)
    weights = {}
    for name, module in model.model.named_modules():
        if hasattr(module, "qweight"):
            module.scales = module.scales.float()  # (exact: a float16 scale times a small integer)
            w = (dequantize_gemm(module.qweight, module.qzeros, module.scales, module.bits, module.group_size)
                 if awq else module.dequantize_weight())
            weights[f"{name}.weight"] = w.float().T.contiguous().numpy()
    return weights


def float32_logits(source: Path, weights: dict[str, np.ndarray], out: Path) -> list[np.ndarray]:
    """transformers' float32 Llama holding the checkpoint's other tensors (the embedding
    and the norms, as saved) and these weights."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = model.state_dict()
    state.update({k: v.float() for k, v in load_file(out / "model.safetensors").items() if k in state})
    state.update({k: torch.from_numpy(v) for k, v in weights.items()})
    model.load_state_dict(state)
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].float().numpy() for ids in PROMPTS]


def main() -> None:
    golden = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # (GPTQModel writes its logs into the working directory)
        widened = widened_source(Path(tmp) / "tiny-llama-64")
        for name, (settings, widen) in SCHEMES.items():
            source = widened if widen else SOURCE
            out = quantize(name, source, settings)
            text = (out / "config.json").read_text() + (out / "quantize_config.json").read_text()
            assert tmp not in text and "/tmp" not in text, "a checkpoint's config names a local path"
            weights = dequantized(out, awq=name == "awq")
            golden.update({f"{name}/{k}": v for k, v in weights.items()})
            for i, logits in enumerate(float32_logits(source, weights, out)):
                golden[f"{name}/logits{i}"] = logits
            config = json.loads((out / "config.json").read_text())["quantization_config"]
            print(f"{out.name}: {sum(p.stat().st_size for p in out.iterdir())} bytes, "
                  f"{config['quant_method']} {config.get('checkpoint_format', config.get('format'))}")
    for i, ids in enumerate(PROMPTS):
        golden[f"ids{i}"] = np.array(ids, np.int64)
    np.savez_compressed(FIXTURES / "tiny_llama_int4_golden.npz", **golden)


if __name__ == "__main__":
    main()

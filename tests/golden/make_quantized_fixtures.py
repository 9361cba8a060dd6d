"""Write the quantized checkpoints that llamastream's readers are tested against, with
the compressed-tensors library itself (the format's own writer and reader).

Run by hand (CI never runs it), then commit what it writes under tests/fixtures/:

    python -m venv .venv-golden && .venv-golden/bin/pip install torch==2.13.0 transformers==5.24.0 \
        compressed-tensors==0.20.1 safetensors
    .venv-golden/bin/python tests/golden/make_quantized_fixtures.py

From the tiny random Llama of make_fixtures.py, each scheme's linear layers (not the
head) are quantized with compressed-tensors' own scale and zero-point computation
(calculate_qparams over each group's or row's range), compressed by its
ModelCompressor and saved as a checkpoint (tiny-llama-<scheme>/). The checkpoint is
then loaded back by transformers, which decompresses it through compressed-tensors;
tiny_llama_quantized_golden.npz holds, per scheme, every linear weight as the library
dequantizes it and the logits of the golden prompts on that model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                             apply_quantization_config)
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SOURCE = FIXTURES / "tiny-llama"
PROMPTS = [[0, 17, 93, 250, 4, 11], list(range(1, 40)), [0] + [7, 300, 12] * 20]
SCHEMES = {  # name: (weight arguments, format)
    "w4a16-asym": (QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                   "pack-quantized"),
    "w4a16-sym": (QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                  "pack-quantized"),
    "fp8-channel": (QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel"),
                    "float-quantized"),
    "fp8-tensor": (QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                   "float-quantized"),
}


def weight_ranges(w: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The minimum and maximum over each quantization unit of a weight, shaped as its scale."""
    if args.strategy == "group":
        w = w.reshape(w.shape[0], -1, args.group_size)
        return w.amin(-1), w.amax(-1)
    if args.strategy == "channel":
        return w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    return w.amin().reshape(1), w.amax().reshape(1)


def write(name: str, args: QuantizationArgs, form: str) -> Path:
    model = AutoModelForCausalLM.from_pretrained(SOURCE, dtype=torch.float32)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            scale, zero = calculate_qparams(*weight_ranges(module.weight.data, args), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=form)
    compressor.compress_model(model)
    out = FIXTURES / f"tiny-llama-{name}"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    compressor.update_config(out)
    for extra in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(SOURCE / extra, out / extra)
    return out


def main() -> None:
    golden = {}
    for name, (args, form) in SCHEMES.items():
        out = write(name, args, form)
        model = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
        for param, value in model.state_dict().items():
            if param.startswith("model.layers.") and param.endswith("proj.weight"):
                golden[f"{name}/{param}"] = value.float().numpy()
        with torch.no_grad():
            for i, ids in enumerate(PROMPTS):
                golden[f"{name}/logits{i}"] = model(torch.tensor([ids])).logits[0].float().numpy()
        print(f"{out.name}: {sum(p.stat().st_size for p in out.iterdir())} bytes")
    for i, ids in enumerate(PROMPTS):
        golden[f"ids{i}"] = np.array(ids, np.int64)
    np.savez_compressed(FIXTURES / "tiny_llama_quantized_golden.npz", **golden)


if __name__ == "__main__":
    main()

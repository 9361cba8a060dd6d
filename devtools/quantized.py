"""A model's checkpoint rewritten in a quantized format, with numpy: each layer's linear
weights (not the embedding or the head) as the format's writers lay them out, and its
quantization_config. For the tests (every format written, read back and served) and for
the GPU's tests and benchmarks (the 1B shape in each format):

    python -m devtools.quantized SOURCE_DIR OUT_DIR --format gptq [--group 128]

The values: INT4 asymmetric per group (its range's min and max, 0 included: the zero
point is a nibble), FP8 e4m3 with a scale per row or per 128 x 128 block (fp8-dynamic:
a scale per row, and a config that says the activations are quantized a token at a
time when served).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from engine.model_loader import LoadedModel, load_model
from engine.quantization.fp8 import E4M3_MAX, Fp8Weight, f32_to_e4m3
from engine.quantization.int4 import _AWQ_SHIFTS, Int4Weight, pack_int32
from engine.weights import is_layer_matrix

FORMATS = ("awq", "gptq", "pack-quantized", "fp8-channel", "fp8-dynamic", "fp8-block")
FP8_BLOCK = (128, 128)


def quantize_int4(w: np.ndarray, group: int) -> Int4Weight:
    """Asymmetric INT4 with per-group min/max (what AWQ and GPTQ checkpoints hold)."""
    out, columns = w.shape
    g = w.reshape(out, columns // group, group)
    lo, hi = np.minimum(g.min(axis=2), 0), np.maximum(g.max(axis=2), 0)  # (0 in range: the zero point is a nibble)
    scale = (np.maximum(hi - lo, 1e-8) / 15).astype(np.float16).astype(np.float32)
    zero = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.round(g / scale[..., None]) + zero[..., None], 0, 15).astype(np.uint8).reshape(out, columns)
    return Int4Weight(q, scale, zero, (np.arange(columns) // group).astype(np.int32))


def quantize_fp8_blocks(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> Fp8Weight:
    """e4m3 with a scale per block of `block` (rows, columns): its largest magnitude is 448."""
    rows, cols = block
    out, columns = w.shape
    padded = np.zeros((-(-out // rows) * rows, -(-columns // cols) * cols), np.float32)
    padded[:out, :columns] = np.abs(w)
    peak = padded.reshape(padded.shape[0] // rows, rows, -1, cols).max(axis=(1, 3))
    scale = (np.maximum(peak, 1e-12) / E4M3_MAX).astype(np.float32)
    return Fp8Weight(f32_to_e4m3(w / np.repeat(np.repeat(scale, rows, 0), cols, 1)[:out, :columns]), scale, block)


def gptq_v1(q: Int4Weight) -> Int4Weight:
    """GPTQ's v1 files store zero points minus one, so a zero point of 0 cannot be
    written (it would read as 16): those groups move up by one step."""
    low = q.zero == 0
    codes = np.where(low[:, q.group], np.minimum(q.codes + 1, 15), q.codes).astype(np.uint8)
    return Int4Weight(codes, q.scale, np.where(low, 1, q.zero).astype(np.uint8), q.group)


def _e4m3(codes: np.ndarray) -> np.ndarray:
    return codes.view(ml_dtypes.float8_e4m3fn)  # (written as safetensors' F8_E4M3)


def _int4_parts(base: str, q: Int4Weight, fmt: str) -> dict[str, np.ndarray]:
    if fmt == "awq":  # [in, out / 8], columns in AWQ's interleaved order; fp16 scales [groups, out]
        return {base + ".qweight": pack_int32(q.codes.T, axis=1, shifts=_AWQ_SHIFTS),
                base + ".qzeros": pack_int32(q.zero.T, axis=1, shifts=_AWQ_SHIFTS),
                base + ".scales": q.scale.T.astype(np.float16)}
    if fmt == "gptq":  # v1: [in / 8, out], zero points stored minus one, the group of each input row
        return {base + ".qweight": pack_int32(q.codes.T, axis=0),
                base + ".qzeros": pack_int32(q.zero.T - 1, axis=1),
                base + ".scales": q.scale.T.astype(np.float16), base + ".g_idx": q.group}
    # compressed-tensors pack-quantized: [out, in / 8], zero points packed along the rows
    return {base + ".weight_packed": pack_int32(q.codes, axis=1), base + ".weight_scale": q.scale,
            base + ".weight_zero_point": pack_int32(q.zero, axis=0),
            base + ".weight_shape": np.array(q.codes.shape, np.int64)}


def _fp8_parts(base: str, q: Fp8Weight) -> dict[str, np.ndarray]:
    if q.block is None:  # compressed-tensors float-quantized: a scale per row
        return {base + ".weight": _e4m3(q.codes), base + ".weight_scale": q.scale}
    return {base + ".weight": _e4m3(q.codes), base + ".weight_scale_inv": q.scale}  # Hugging Face's fp8


def _config(fmt: str, group: int) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "version": "gemm", "w_bit": 4, "q_group_size": group, "zero_point": True}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq"}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    weights = ({"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}
               if fmt == "pack-quantized" else {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"})
    scheme = {"targets": ["Linear"], "weights": weights}
    if fmt == "fp8-dynamic":  # (llm-compressor's FP8_DYNAMIC: activations quantized a token at a time when served)
        scheme["input_activations"] = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                       "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized" if fmt == "pack-quantized" else
            "float-quantized", "config_groups": {"group_0": scheme}, "ignore": ["lm_head"]}


def quantize(w: np.ndarray, fmt: str, group: int) -> Int4Weight | Fp8Weight:
    """One weight as `fmt` holds it."""
    if fmt in ("fp8-channel", "fp8-dynamic"):
        return dataclasses.replace(Fp8Weight.quantize(w), dynamic_activations=fmt == "fp8-dynamic")
    if fmt == "fp8-block":
        return quantize_fp8_blocks(w)
    q = quantize_int4(w, group)
    return gptq_v1(q) if fmt == "gptq" else q


def write_quantized(source: Path, out: Path, fmt: str, group: int = 128) -> dict[str, Int4Weight | Fp8Weight]:
    """`source` (a Hugging Face directory) rewritten in `fmt` (FORMATS) into `out`;
    returns the quantized weights written, by name."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors, written = {}, {}
    for name, t in load_model(source).weights.items():
        w = t.float32()
        if not (name.startswith("model.layers.") and w.ndim == 2):
            tensors[name] = w
            continue
        q = written[name] = quantize(w, fmt, group)
        base = name[: -len(".weight")]
        tensors.update(_fp8_parts(base, q) if fmt.startswith("fp8") else _int4_parts(base, q, fmt))
    save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _config(fmt, group)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--format", choices=FORMATS, required=True)
    ap.add_argument("--group", type=int, default=128, help="INT4 group size (default 128)")
    args = ap.parse_args()
    written = write_quantized(args.source, args.out, args.format, args.group)
    print(f"wrote {args.out}: {len(written)} weights in {args.format}")


if __name__ == "__main__":
    main()


def fp8_fast(w: np.ndarray, block: tuple[int, int] | None = None) -> Fp8Weight:
    """Fp8Weight.quantize (per row), or quantize_fp8_blocks with `block`, rounding with
    ml_dtypes: ties go to even rather than down (about one code in 4 million differs), 30
    times faster, for quantizing the 1B shape in the GPU's tests and benchmarks."""
    if block is None:
        scale = (np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-12) / E4M3_MAX).astype(np.float32)
        full = scale
    else:
        rows, cols = block
        out, columns = w.shape
        padded = np.zeros((-(-out // rows) * rows, -(-columns // cols) * cols), np.float32)
        padded[:out, :columns] = np.abs(w)
        scale = (np.maximum(padded.reshape(padded.shape[0] // rows, rows, -1, cols).max(axis=(1, 3)), 1e-12)
                 / E4M3_MAX).astype(np.float32)
        full = np.repeat(np.repeat(scale, rows, 0), cols, 1)[:out, :columns]
    codes = np.clip(w / full, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return Fp8Weight(codes, scale, block)


def int4_model(model: LoadedModel, group: int = 128) -> LoadedModel:
    """A LoadedModel with its layers' matrices quantized by quantize_int4 (AWQ's and GPTQ's
    asymmetric groups, in order)."""
    return dataclasses.replace(model, weights={
        name: quantize_int4(t.float32(), group) if is_layer_matrix(name, t) else t for name, t in model.weights.items()})


def fp8_model(model: LoadedModel, block: tuple[int, int] | None = None, head: bool = False,
              dynamic_activations: bool = False) -> LoadedModel:
    """A LoadedModel with its layers' matrices (and its head, or the embedding it is tied
    to, with `head`) quantized by fp8_fast, marked as an FP8-dynamic checkpoint's where
    `dynamic_activations` (W8A8 on the GPU)."""
    head_name = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    return dataclasses.replace(model, weights={
        name: dataclasses.replace(fp8_fast(t.float32(), block), dynamic_activations=dynamic_activations)
        if is_layer_matrix(name, t) or (head and name == head_name) else t
        for name, t in model.weights.items()})


# The benchmarks' --format: a bfloat16 model's layer matrices (and the head, with fp8-head)
# in each format the GPU serves, as --quantization fp8 and the checkpoints of each give them.
MODEL_FORMATS: dict[str, Callable[[LoadedModel], LoadedModel]] = {
    "bf16": lambda m: m,
    "fp8": fp8_model,  # a scale a row
    "fp8-dynamic": lambda m: fp8_model(m, dynamic_activations=True),  # W8A8 steps, as FP8-dynamic checkpoints
    "fp8-blocks": lambda m: fp8_model(m, FP8_BLOCK),  # Hugging Face's fp8 checkpoints
    "fp8-head": lambda m: fp8_model(m, head=True),  # --quantize-lm-head: the tied head too
    "fp8-dynamic-head": lambda m: fp8_model(m, head=True, dynamic_activations=True),  # W8A8 steps, the head too
    "int4": int4_model,  # groups of 128 with zero points, as AWQ and GPTQ checkpoints
}

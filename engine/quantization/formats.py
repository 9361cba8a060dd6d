"""Which quantized format a checkpoint is in (its config.json's quantization_config),
and the gathering of its stored tensors into one quantized tensor per linear weight."""

from __future__ import annotations

import numpy as np

from engine.quantization.fp8 import Fp8Weight
from engine.quantization.int4 import Int4Weight, from_awq, from_gptq, from_pack_quantized
from engine.weights import Weights, is_layer_matrix

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "awq", "gptq")  # quantization_config.quant_method
QUANTIZE_AT_LOAD = ("fp8",)  # --quantization


def _stored(weights: Weights, name: str, *, required: bool = True) -> np.ndarray | None:
    """A stored tensor's array, taken out of `weights`."""
    tensor = weights.pop(name, None)
    if tensor is None:
        if required:
            raise ValueError(f"the checkpoint's quantization_config says its weights are quantized, but {name} is "
                             "missing: is config.json the one its tensors were written with?")
        return None
    return tensor.data if tensor.format == "stored" else tensor.float32()


def _linears(weights: Weights, suffix: str) -> list[str]:
    """The linear weights (by their plain name) that have a stored tensor ending in `suffix`."""
    return sorted(name[: -len(suffix)] for name in weights if name.endswith(suffix))


def read_quantized(config: dict | None, weights: Weights) -> Weights:
    """`weights` with each quantized linear gathered under its plain name (`X.weight`);
    unchanged for a checkpoint without a quantization_config. Raises ValueError naming
    the format for one llamastream does not serve, and the tensor where a format's
    config does not match its tensors."""
    if not config:
        return weights
    method = config.get("quant_method")
    weights = dict(weights)
    if method == "awq":
        _check(config.get("version", "gemm").lower() == "gemm" and config.get("w_bit", config.get("bits", 4)) == 4,
               f"AWQ {config.get('version')} with {config.get('w_bit', config.get('bits'))} bits", "the GEMM layout, 4 bits")
        group = config.get("q_group_size", config.get("group_size", 128))
        for base in _linears(weights, ".qweight"):
            weights[base + ".weight"] = _checked(base, from_awq(
                _stored(weights, base + ".qweight"), _stored(weights, base + ".qzeros"), _stored(weights, base + ".scales"),
                group))
    elif method == "gptq":
        _check(config.get("bits", 4) == 4, f"GPTQ with {config.get('bits')} bits", "4 bits")
        v1 = config.get("checkpoint_format", "gptq") == "gptq"
        for base in _linears(weights, ".qweight"):
            weights[base + ".weight"] = _checked(base, from_gptq(
                _stored(weights, base + ".qweight"), _stored(weights, base + ".qzeros"),
                _stored(weights, base + ".scales"), _stored(weights, base + ".g_idx", required=False),
                config.get("group_size", 128), zeros_minus_one=v1))
    elif method == "fp8":
        block = tuple(config.get("weight_block_size") or ()) or None
        for base in _linears(weights, ".weight_scale_inv"):
            weights[base + ".weight"] = _checked_fp8(base, Fp8Weight(
                _stored(weights, base + ".weight"), _stored(weights, base + ".weight_scale_inv").astype(np.float32), block))
    elif method == "compressed-tensors":
        _read_compressed_tensors(config, weights)
    else:
        raise ValueError(f"the checkpoint is quantized with {method!r}, which llamastream does not serve: it serves "
                         f"{', '.join(QUANTIZATION_METHODS)} (quantization_config.quant_method), and GGUF files")
    leftover = [name for name, t in weights.items() if t.format == "stored"]
    if leftover:
        raise ValueError(f"tensor {leftover[0]} is stored as integers, which the {method} format as configured does "
                         "not read: does quantization_config match the checkpoint?")
    return weights


def _read_compressed_tensors(config: dict, weights: Weights) -> None:
    form = config.get("format")
    schemes = [g.get("weights") or {} for g in (config.get("config_groups") or {}).values()]
    if form == "pack-quantized":
        for base in _linears(weights, ".weight_packed"):
            scheme = schemes[0] if schemes else {}
            _check(scheme.get("num_bits", 4) == 4 and scheme.get("type", "int") == "int",
                   f"compressed-tensors pack-quantized with {scheme.get('num_bits')}-bit {scheme.get('type')}", "4-bit int")
            shape = tuple(int(d) for d in _stored(weights, base + ".weight_shape"))
            weights[base + ".weight"] = _checked(base, from_pack_quantized(
                _stored(weights, base + ".weight_packed"), _stored(weights, base + ".weight_scale"),
                _stored(weights, base + ".weight_zero_point", required=False), shape, scheme.get("group_size")))
    elif form in ("float-quantized", "naive-quantized"):
        activations = next(iter((config.get("config_groups") or {}).values()), {}).get("input_activations") or {}
        dynamic = activations.get("type") == "float" and activations.get("num_bits") == 8 and bool(activations.get("dynamic"))
        for base in _linears(weights, ".weight_scale"):
            scale = _stored(weights, base + ".weight_scale").astype(np.float32).reshape(-1, 1)
            weights[base + ".weight"] = _checked_fp8(base, Fp8Weight(_stored(weights, base + ".weight"), scale,
                                                                     dynamic_activations=dynamic))
            weights.pop(base + ".input_scale", None)  # (static activation scales: activations stay bfloat16)
    else:
        raise ValueError(f"the checkpoint is in compressed-tensors' {form!r} format, which llamastream does not serve: "
                         "it serves pack-quantized (INT4) and float-quantized (FP8) weights")


def _check(ok: bool, what: str, served: str) -> None:
    if not ok:
        raise ValueError(f"the checkpoint is quantized as {what}, which llamastream does not serve ({served})")


def _checked(name: str, weight):
    """A quantized weight whose parts agree with one another, or ValueError naming it."""
    out, columns = weight.shape
    if weight.scale.shape[0] != out or weight.zero.shape != weight.scale.shape or weight.group.shape != (columns,) \
            or weight.group.max(initial=0) >= weight.scale.shape[1]:
        raise ValueError(f"{name}: its packed weights ({out} x {columns}), scales {weight.scale.shape} and zero points "
                         f"{weight.zero.shape} do not agree with the group size in quantization_config")
    return weight


def _checked_fp8(name: str, weight: Fp8Weight) -> Fp8Weight:
    """An FP8 weight with one scale, one a row or one a block of its codes (as the
    format says), or ValueError naming it."""
    out, columns = weight.shape
    if weight.block is None:
        if weight.scale.size == 1 or weight.scale.shape == (out, 1):
            return weight
        expected = f"one for the tensor or one a row ({out} x 1)"
    else:
        rows, cols = weight.block
        expected = f"one a {rows} x {cols} block ({-(-out // rows)} x {-(-columns // cols)}: weight_block_size)"
        if weight.scale.shape == (-(-out // rows), -(-columns // cols)):
            return weight
    raise ValueError(f"{name}: its FP8 codes ({out} x {columns}) and scales {weight.scale.shape} do not agree with "
                     f"quantization_config, which asks for {expected}")


def quantize_at_load(method: str, weights: Weights, head: str | None = None) -> Weights:
    """A bfloat16 (or float32) checkpoint's layer matrices quantized (`--quantization
    fp8`: per-output-channel scales), and the tensor named `head` if given (the head, or
    the embedding it is tied to: at batch 1 a fifth of the bytes); the embedding and the
    head stay as they are otherwise."""
    if method not in QUANTIZE_AT_LOAD:
        raise ValueError(f"--quantization {method}: llamastream quantizes at load to {', '.join(QUANTIZE_AT_LOAD)}")
    out = dict(weights)
    for name in [n for n, t in weights.items() if is_layer_matrix(n, t)] + [head] * bool(head):
        if isinstance(out[name], (Fp8Weight, Int4Weight)):
            raise ValueError(f"--quantization {method}: {name} is quantized already (the checkpoint is): "
                             "leave --quantization out")
        out[name] = Fp8Weight.quantize(out[name].float32())
    return out

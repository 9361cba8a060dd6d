"""Load weights as float32 numpy arrays under Hugging Face's tensor names.

Sources: a Hugging Face directory (`*.safetensors`, sharded or not) or a GGUF file
(dequantized with the `gguf` package; llama.cpp's Q/K row permutation undone).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from engine.config import ModelConfig

Weights = dict[str, np.ndarray]
Progress = Callable[[int, int], None]  # (done, total)

_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # widened to float32 below: numpy has no bfloat16
    "F64": np.float64,
}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, float32 array) from one .safetensors file.

    The format is an 8-byte header length, a JSON header, then raw tensors; the
    safetensors package's numpy API cannot return bfloat16, so read it directly.
    """
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        raw = np.frombuffer(data[begin:end], dtype=dtype).reshape(meta["shape"])
        yield name, bf16_bits_to_f32(raw) if meta["dtype"] == "BF16" else raw.astype(np.float32)


def load_hf_weights(path: Path, progress: Progress | None = None) -> Weights:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}: a Hugging Face model directory needs them")
    weights: Weights = {}
    for i, file in enumerate(files):
        weights.update(_read_safetensors(file))
        if progress:
            progress(i + 1, len(files))
    return weights


_GGUF_NAMES = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", r"model.layers.\1.input_layernorm.weight"),
    (r"blk\.(\d+)\.ffn_norm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", r"model.layers.\1.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", r"model.layers.\1.mlp.down_proj.weight"),
]


def gguf_to_hf_name(name: str) -> str | None:
    for pattern, replacement in _GGUF_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which interleaves each head's rotary halves."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_weights(reader, config: ModelConfig, progress: Progress | None = None) -> Weights:
    from gguf import dequantize

    weights: Weights = {}
    for i, tensor in enumerate(reader.tensors):
        name = gguf_to_hf_name(tensor.name)
        if name is None:  # e.g. rope_freqs: recomputed from the config
            continue
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config.num_kv_heads)
        weights[name] = w
        if progress:
            progress(i + 1, len(reader.tensors))
    return weights


def check_weights(weights: Weights, config: ModelConfig) -> None:
    """Fail at load, naming the tensor, rather than with a shape error mid-request."""
    h, inter = config.hidden_size, config.intermediate_size
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        expected.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.q_size, h),
            p + "self_attn.k_proj.weight": (config.kv_size, h),
            p + "self_attn.v_proj.weight": (config.kv_size, h),
            p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    for name, shape in expected.items():
        if name not in weights:
            raise ValueError(f"weight {name} is missing from the checkpoint")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, expected {shape} from config.json")

"""Load a checkpoint's tensors, each in its stored format, under Hugging Face's names;
and gather them into the weights an architecture's layer reads (ModelWeights).

Sources: a Hugging Face directory (`*.safetensors`, sharded or not: float32, float16
and bfloat16) or a GGUF file (dequantized to float32 with the `gguf` package;
llama.cpp's Q/K row permutation undone). A Tensor keeps its format so that each
backend multiplies by it as it can: the CUDA backend uploads bfloat16 as it is, the
numpy backend widens everything to float32. Integer and FP8 tensors are kept as
stored, for engine/quantization to gather into quantized weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.quantization.kv_cache import KvScale

Progress = Callable[[int, int], None]  # (done, total)

_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # bit patterns: numpy has no bfloat16
    "F64": np.float64,
}
_STORED_DTYPES = {"I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                  "F8_E4M3": np.uint8}  # (FP8 as its bit patterns)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@dataclass(frozen=True)
class Tensor:
    """A checkpoint tensor as stored: float32 values ("f32"), bfloat16 bit patterns in
    uint16 ("bf16"), or integers and FP8 bit patterns as they are ("stored": the parts
    of a quantized weight)."""

    data: np.ndarray
    format: str

    @staticmethod
    def of(values: np.ndarray) -> "Tensor":
        return Tensor(np.ascontiguousarray(values, dtype=np.float32), "f32")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def float32(self) -> np.ndarray:
        if self.format == "stored":
            return self.data.astype(np.float32)
        return bf16_bits_to_f32(self.data) if self.format == "bf16" else self.data

    def bf16_bits(self) -> np.ndarray:
        """As bfloat16 (rounded to nearest, ties to even, where stored wider)."""
        return self.data if self.format == "bf16" else f32_to_bf16_bits(self.data)

    @staticmethod
    def stack(parts: list["Tensor"]) -> "Tensor":
        """The parts concatenated along their first dimension, in the format they share
        (float32 if they differ, or are quantized in a format that cannot: engine/quantization)."""
        if all(isinstance(p, Tensor) for p in parts) and len({p.format for p in parts}) == 1:
            return Tensor(np.concatenate([p.data for p in parts]), parts[0].format)
        if len({type(p) for p in parts}) == 1 and not isinstance(parts[0], Tensor):
            fused = type(parts[0]).concatenate(parts)
            if fused is not None:
                return fused
        return Tensor.of(np.concatenate([p.float32() for p in parts]))


Weights = dict[str, Tensor]


def is_layer_matrix(name: str, tensor) -> bool:
    """Whether a checkpoint tensor is one of the layers' matrices (the projections that
    quantized formats store quantized; not the norms, the embedding or the head)."""
    return name.startswith("model.layers.") and len(tensor.shape) == 2


@dataclass
class ModelWeights:
    """The weights the model reads: the embedding, the final norm, the head (the
    embedding itself when tied), and each layer's under the names its architecture's
    `layer` uses (fused ones as one matrix)."""

    embed: Tensor
    final_norm: Tensor
    lm_head: Tensor
    layers: list[dict[str, Tensor]]
    kv_scales: list[KvScale]  # each layer's, for an FP8 KV cache

    @staticmethod
    def gather(weights: Weights, config: ModelConfig) -> "ModelWeights":
        from engine.models import architecture_of
        from engine.quantization.kv_cache import read_kv_scales

        arch = architecture_of(config)
        fused_parts = {part for f in arch.fused for part in f.parts}
        layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            layer = {name: weights[prefix + name] for name in arch.layer_weights if name not in fused_parts}
            layer.update({f.name: Tensor.stack([weights[prefix + part] for part in f.parts]) for f in arch.fused})
            layers.append(layer)
        embed = weights["model.embed_tokens.weight"]
        return ModelWeights(embed, weights["model.norm.weight"],
                            embed if config.tie_word_embeddings else weights["lm_head.weight"], layers,
                            read_kv_scales(weights, config.num_layers))


def _read_safetensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) from one .safetensors file.

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
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"]) or _STORED_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {meta['dtype']}")
        begin, end = meta["data_offsets"]
        raw = np.frombuffer(data[begin:end], dtype=dtype).reshape(meta["shape"])
        if meta["dtype"] in _STORED_DTYPES:
            yield name, Tensor(raw, "stored")
        else:
            yield name, Tensor(raw, "bf16") if meta["dtype"] == "BF16" else Tensor.of(raw)


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


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which interleaves each head's rotary halves."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_weights(reader, config: ModelConfig, progress: Progress | None = None) -> Weights:
    """The tensors of a GGUF file: Q4_0, Q4_1, Q8_0 and Q4_K matrices as stored (GgufWeight),
    every other type dequantized to float32."""
    from gguf import dequantize

    from engine.models import architecture_of
    from engine.quantization.gguf import KEPT, GgufWeight

    arch = architecture_of(config)
    weights: Weights = {}
    for i, tensor in enumerate(reader.tensors):
        name = arch.hf_name_of_gguf(tensor.name)
        if name is None:  # e.g. rope_freqs: recomputed from the config
            continue
        shape = [int(d) for d in reversed(tensor.shape)]
        kept = tensor.tensor_type in KEPT and len(shape) == 2
        if kept:  # a row of blocks per row of weights
            w = np.asarray(tensor.data).reshape(shape[0], -1)
        else:
            w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        heads = next((getattr(config, h) for n, h in arch.permuted_for_gguf_rope.items() if name.endswith(n)), None)
        if heads:
            w = unpermute_qk(w, heads)  # (whole rows: a row of blocks moves as its row of values does)
        weights[name] = GgufWeight(np.ascontiguousarray(w), tensor.tensor_type, shape[1]) if kept else Tensor.of(w)
        if progress:
            progress(i + 1, len(reader.tensors))
    return weights


def check_weights(weights: Weights, config: ModelConfig) -> None:
    """Fail at load, naming the tensor, rather than with a shape error mid-request."""
    from engine.models import architecture_of
    from engine.quantization.kv_cache import read_kv_scales

    read_kv_scales(weights, config.num_layers)

    for name, shape in architecture_of(config).tensor_shapes(config).items():
        if name not in weights:
            raise ValueError(f"weight {name} is missing from the checkpoint")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, expected {shape} from config.json")

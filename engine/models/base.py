"""What an architecture is, written once: how its config reads, which checkpoint
tensors it has (under Hugging Face and GGUF names), which of them fuse into one
matrix, and its decoder layer as a sequence of operations (LayerOps) that every
backend implements. Backends never name a checkpoint tensor or spell a layer."""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import ModelConfig


class UnsupportedModel(ValueError):
    """A checkpoint of an architecture llamastream does not serve."""


@dataclass(frozen=True)
class Fused:
    """A weight the layer reads as one matrix: the checkpoint's tensors `parts`
    (per-layer names) stacked along the output dimension, in that order."""

    name: str
    parts: tuple[str, ...]


class LayerOps(Protocol):
    """What a decoder layer does, step by step, to one step's tokens. The residual stream
    is the ops' own state: `rms_norm` reads it, `add_to_residual` adds into it. Values
    are whatever the backend passes between its ops; weights are named as the
    architecture's `layer_weights` and `fused` name them."""

    def rms_norm(self, weight: str) -> Any:
        """RMSNorm of the residual stream, with `weight`."""

    def linear(self, x: Any, weight: str) -> Any:
        """x @ weight^T."""

    def head_rms_norm(self, qkv: Any, q_weight: str, k_weight: str) -> Any:
        """RMSNorm of each query and key head of the fused projection (Qwen3's q/k norm)."""

    def rope_and_cache(self, qkv: Any) -> Any:
        """Rotate the query and key heads by their positions and write K and V to the
        layer's paged cache; returns the rotated projection."""

    def attention(self, qkv: Any) -> Any:
        """Causal grouped-query attention of the queries over the cached keys and values."""

    def silu_and_mul(self, gate_up: Any) -> Any:
        """silu(gate) * up of the fused gate/up projection."""

    def add_to_residual(self, x: Any) -> None:
        """residual += x."""


class Architecture(abc.ABC):
    """One model architecture. Subclasses set the names and write `layer`."""

    name: str  # as in errors and logs
    model_types: tuple[str, ...]  # config.json's model_type
    hf_architectures: tuple[str, ...]  # config.json's architectures
    gguf_architecture: str | None = None  # GGUF's general.architecture, where llamastream reads it
    layer_weights: tuple[str, ...]  # per-layer tensors, Hugging Face names after "model.layers.{i}."
    fused: tuple[Fused, ...] = ()
    # GGUF per-layer tensor names (after "blk.{i}.") for Hugging Face's (after "model.layers.{i}.")
    gguf_layer_names: dict[str, str] = {}
    # tensors llama.cpp stores with each head's rotary halves interleaved, and the config
    # field that counts their heads
    permuted_for_gguf_rope: dict[str, str] = {}

    @abc.abstractmethod
    def layer(self, ops: LayerOps) -> None:
        """One decoder layer, as the ops that compute it."""

    @abc.abstractmethod
    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        """The model's shape from config.json."""

    def config_from_gguf(self, field, vocab_size: int, tied: bool) -> ModelConfig:
        """The model's shape from GGUF metadata (`field(key, default)` reads `{gguf_architecture}.{key}`)."""
        raise UnsupportedModel(f"llamastream reads {self.name} checkpoints as Hugging Face directories, not GGUF files")

    # -- tensor names ----------------------------------------------------------------
    def tensor_shapes(self, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, with its shape (Hugging Face names)."""
        shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        per_layer = self.layer_shapes(c)
        for i in range(c.num_layers):
            shapes.update({f"model.layers.{i}.{name}": per_layer[name] for name in self.layer_weights})
        return shapes

    @abc.abstractmethod
    def layer_shapes(self, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Each of `layer_weights` with its shape."""

    def hf_name_of_gguf(self, name: str) -> str | None:
        """The Hugging Face name of a GGUF tensor, or None for one that is not read."""
        top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        if name in top:
            return top[name]
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m and m.group(2) in self.gguf_layer_names:
            return f"model.layers.{m.group(1)}.{self.gguf_layer_names[m.group(2)]}"
        return None

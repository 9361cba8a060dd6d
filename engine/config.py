"""The model's shape, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style rope scaling (`rope_type: llama3` in config.json)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    architecture: str = "llama"  # a name in engine.models.ARCHITECTURES

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], architecture: str) -> "ModelConfig":
        """The fields every architecture here shares, from config.json (engine.models
        finds the architecture)."""
        heads = cfg["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta inside); older checkpoints
        # such as Llama 3.2's have `rope_scaling` beside `rope_theta`.
        scaling = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
        rope_theta = (scaling or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                rope = RopeScaling(
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling["low_freq_factor"]),
                    high_freq_factor=float(scaling["high_freq_factor"]),
                    original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
                )
            elif kind not in (None, "default"):
                raise ValueError(f"unsupported rope_scaling type {kind!r}: only 'llama3' is implemented")
        return cls(
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            architecture=architecture,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json's fields, but for `architectures` and `model_type` (engine.models has those)."""
        cfg: dict[str, Any] = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = {"rope_type": "llama3", **self.rope_scaling.__dict__}
        return cfg

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies, [head_dim / 2], exactly as transformers computes them."""
        dim = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
        s = self.rope_scaling
        if s is None:
            return inv_freq.astype(np.float32)
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32)

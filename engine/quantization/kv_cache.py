"""The FP8 KV cache's scales: a layer's K (and V) are cached as e4m3 codes of K / k_scale
and read back as code * k_scale, vLLM's convention. A checkpoint calibrated for an FP8
cache carries the scales (compressed-tensors' kv_cache_scheme writes
`self_attn.k_scale`, ModelOpt `self_attn.k_proj.k_scale`); without them the scale is 1,
as in vLLM. Every backend caches with the same float32 reciprocal of each scale
(`KvScale.inverse`), so that their codes match bit for bit."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from engine.quantization.fp8 import e4m3_to_f32, f32_to_e4m3
from engine.weights import Weights

_NAMES = {"k": ("self_attn.k_scale", "self_attn.k_proj.k_scale"),  # (compressed-tensors', ModelOpt's)
          "v": ("self_attn.v_scale", "self_attn.v_proj.v_scale")}


@dataclass(frozen=True)
class KvScale:
    """One layer's: its cache holds e4m3(K * inverse(k)) and e4m3(V * inverse(v))."""

    k: float = 1.0
    v: float = 1.0

    @staticmethod
    def inverse(scale: float) -> np.float32:
        """What a value is multiplied by to be cached, in float32 (every backend's)."""
        return np.float32(1.0) / np.float32(scale)

    @functools.cached_property  # (read at every launch that writes the cache)
    def inverses(self) -> tuple[np.float32, np.float32]:
        """What the kernels that write the cache multiply K and V by."""
        return self.inverse(self.k), self.inverse(self.v)


def cache_scales(kv_scales: list[KvScale], fp8: bool) -> list[KvScale]:
    """The scales a cache is written with: the checkpoint's for an FP8 cache; a cache of
    wider elements needs none (1)."""
    return list(kv_scales) if fp8 else [KvScale()] * len(kv_scales)


def store_e4m3(x: np.ndarray, scale: float) -> np.ndarray:
    """K or V (float32) as an FP8 cache holds them: the e4m3 codes of x over `scale`."""
    return f32_to_e4m3(x * KvScale.inverse(scale))


def load_e4m3(codes: np.ndarray, scale: float) -> np.ndarray:
    """K or V in float32 from an FP8 cache's codes."""
    return e4m3_to_f32(codes) * np.float32(scale)


def read_kv_scales(weights: Weights, num_layers: int) -> list[KvScale]:
    """Each layer's scales in `weights` (1 where the checkpoint has none).
    Raises ValueError naming the tensor where one is not a positive number or a layer
    lacks what the others have."""
    found = {}
    for i in range(num_layers):
        for kv, names in _NAMES.items():
            for name in names:
                tensor = weights.get(f"model.layers.{i}.{name}")
                if tensor is not None:
                    found[i, kv] = _scalar(f"model.layers.{i}.{name}", tensor.float32())
    if not found:
        return [KvScale()] * num_layers
    missing = next(((i, kv) for i in range(num_layers) for kv in _NAMES if (i, kv) not in found), None)
    if missing:
        raise ValueError(f"the checkpoint has calibrated KV-cache scales, but not model.layers.{missing[0]}."
                         f"{_NAMES[missing[1]][0]}: are its safetensors files complete?")
    return [KvScale(found[i, "k"], found[i, "v"]) for i in range(num_layers)]


def _scalar(name: str, values: np.ndarray) -> float:
    if values.size != 1 or not np.isfinite(values).all() or float(values.ravel()[0]) <= 0:
        raise ValueError(f"{name} is not one positive number (shape {values.shape}): a KV-cache scale is one float "
                         "a layer")
    return float(np.float32(values.ravel()[0]))

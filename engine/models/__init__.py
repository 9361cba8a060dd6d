"""The architectures llamastream serves, each written once (base.py says what that
means), and the registry that finds a checkpoint's."""

from __future__ import annotations

from typing import Any

from engine.config import ModelConfig
from engine.models.base import Architecture, Fused, LayerOps, UnsupportedModel
from engine.models.llama import Llama
from engine.models.qwen3 import Qwen3

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (Llama(), Qwen3())}

__all__ = ["ARCHITECTURES", "Architecture", "Fused", "LayerOps", "UnsupportedModel", "architecture_for_hf",
           "architecture_for_gguf", "architecture_of"]


def _supported() -> str:
    return ", ".join(f"{a.name} ({', '.join(a.hf_architectures)})" for a in ARCHITECTURES.values())


def architecture_for_hf(cfg: dict[str, Any]) -> Architecture:
    """The architecture of a config.json, by its `model_type`, else its `architectures`."""
    model_type, names = cfg.get("model_type"), cfg.get("architectures") or []
    for arch in ARCHITECTURES.values():
        if model_type in arch.model_types or (model_type is None and set(names) & set(arch.hf_architectures)):
            return arch
    if model_type is None and not names:  # (a bare config: Llama, as llamastream always read it)
        return ARCHITECTURES["llama"]
    raise UnsupportedModel(f"unsupported model: model_type {model_type!r}, architectures {names}; llamastream serves "
                           f"{_supported()}")


def architecture_for_gguf(name: str | None) -> Architecture:
    for arch in ARCHITECTURES.values():
        if arch.gguf_architecture is not None and arch.gguf_architecture == name:
            return arch
    readable = [a.gguf_architecture for a in ARCHITECTURES.values() if a.gguf_architecture]
    raise UnsupportedModel(f"GGUF architecture {name!r} is not supported: llamastream reads GGUF files of "
                           f"{', '.join(map(repr, readable))}, and serves {_supported()} from Hugging Face directories")


def architecture_of(config: ModelConfig) -> Architecture:
    return ARCHITECTURES[config.architecture]

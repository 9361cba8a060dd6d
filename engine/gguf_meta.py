"""Open GGUF files, and read their metadata fields as plain Python values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ModelConfig, RopeScaling


class TruncatedGGUF(ValueError):
    """A GGUF file whose tensors reach past its end."""


def open_gguf(path: Path):
    """A GGUFReader of `path`; a truncated or corrupt file raises ValueError saying so,
    naming the first tensor whose bytes are not all in the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    size = path.stat().st_size

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs, fields):  # (gguf's own step that maps each tensor's bytes)
            for field in fields:
                _, name, _, dims, dtype, offset = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(dtype[0])]
                begin = int(start_offs + offset[0])
                end = begin + int(np.prod(dims)) * type_size // block
                if end > size:
                    raise TruncatedGGUF(f"{path} is truncated or corrupt: tensor {bytes(name).decode(errors='replace')} "
                                     f"needs bytes {begin} to {end}, but the file has {size}; download or convert it again")
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(path)
    except TruncatedGGUF:
        raise
    except Exception as e:  # (numpy's or struct's words, from deep in the header's parsing)
        raise ValueError(f"{path} is not a readable GGUF file, truncated or corrupt ({size} bytes): {e}") from e


def field_value(reader, key: str) -> Any:
    """The field's value (str, number, bool or list), or None if absent."""
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported: llamastream serves 'llama' models")

    def get(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"llama.{key}")
        return default if value is None else value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = get("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens"))
    scaling = None
    if get("rope.scaling.type") == "llama3" or get("rope.scaling.factor"):
        scaling = RopeScaling(
            factor=float(get("rope.scaling.factor")),
            low_freq_factor=float(get("rope.scaling.low_freq_factor", 1.0)),
            high_freq_factor=float(get("rope.scaling.high_freq_factor", 4.0)),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length", 8192)),
        )
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return ModelConfig(
        hidden_size=hidden,
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings=not has_output,
    )

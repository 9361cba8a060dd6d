"""Open GGUF files, and read their metadata fields as plain Python values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.config import ModelConfig


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
    """The model's shape, by the architecture general.architecture names."""
    from engine.models import architecture_for_gguf

    name = field_value(reader, "general.architecture")
    arch = architecture_for_gguf(name)

    def field(key: str, default: Any = None) -> Any:
        value = field_value(reader, f"{name}.{key}")
        return default if value is None else value

    vocab = field("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return arch.config_from_gguf(field, int(vocab), tied)

"""GGUF's block-quantized weights kept as stored (Q4_0, Q4_1, Q8_0, Q4_K): blocks of
32 weights along a row, each with a float16 scale (and Q4_1 a float16 minimum).

    Q4_0: d, 16 bytes of nibbles            w = d * (q - 8)
    Q4_1: d, m, 16 bytes of nibbles         w = d * q + m
    Q8_0: d, 32 signed bytes                w = d * q

A block's byte j holds weight j in its low nibble and weight j + 16 in its high one.
Q4_K groups eight such blocks in 144 bytes: float16 d and dmin, 6-bit scales and mins
(sc, mn) per block, and 128 bytes of nibbles where each 32 hold one block in their low
nibbles and the next in their high ones; w = d * sc * q - dmin * mn.

Dequantized by the gguf package (what llama.cpp's converter ships) for the numpy and
CUDA backends; the CPU backend's kernels read the blocks themselves."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, dequantize

from engine.quantization.base import QuantizedWeight

KEPT = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K)


@dataclass(frozen=True)
class GgufWeight(QuantizedWeight):
    """A weight [rows, columns] as GGUF stores it: each row's blocks, raw."""

    blocks: np.ndarray  # uint8 [rows, columns / 32 * bytes a block]
    kind: GGMLQuantizationType
    columns: int

    @property
    def format(self) -> str:
        return self.kind.name.lower()

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.blocks.shape[0], self.columns)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes

    def float32(self) -> np.ndarray:
        return np.asarray(dequantize(self.blocks, self.kind), np.float32).reshape(self.shape)

    @staticmethod
    def concatenate(parts: list["GgufWeight"]) -> "GgufWeight | None":
        """The parts' rows, one after another, if they share a kind (a fused projection)."""
        if len({(p.kind, p.columns) for p in parts}) != 1:
            return None
        return GgufWeight(np.concatenate([p.blocks for p in parts]), parts[0].kind, parts[0].columns)

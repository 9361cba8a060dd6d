"""What a quantized linear weight offers the backends, as a Tensor does: its shape, its
bytes as stored, and its values dequantized to float32 or bfloat16."""

from __future__ import annotations

import numpy as np

from engine.weights import f32_to_bf16_bits


class QuantizedWeight:
    codes: np.ndarray  # one code per weight, [out, in]
    format: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def float32(self) -> np.ndarray:
        raise NotImplementedError

    def bf16_bits(self) -> np.ndarray:
        return f32_to_bf16_bits(self.float32())

    @staticmethod
    def concatenate(parts: list) -> "QuantizedWeight | None":
        """The parts' rows as one weight of this format (a fused projection), or None
        where the format cannot: they are then fused dequantized."""
        return None

"""FP8 e4m3 weights: a sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
infinities, and S.1111.111 is NaN. Largest magnitude 448."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.quantization.base import QuantizedWeight

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + mantissa / 8) * np.exp2(exponent.astype(np.float64) - 7)
    subnormal = mantissa / 8 * 2.0 ** -6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3 = _e4m3_table()  # the value of each bit pattern
_POSITIVE = np.sort(E4M3[:0x7F])  # the finite non-negative values, ascending


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    return E4M3[bits]


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """The nearest e4m3 bit pattern of each value (saturating at ±448; ties go to the
    larger magnitude's neighbour below, as searchsorted leaves them)."""
    a = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(_POSITIVE, a), 1, len(_POSITIVE) - 1)
    lo = hi - 1
    nearest = np.where(a - _POSITIVE[lo] <= _POSITIVE[hi] - a, lo, hi)
    code = np.searchsorted(E4M3[:0x7F], _POSITIVE[nearest])  # (the table is ascending over 0x00..0x7E)
    return (code | np.where(x < 0, 0x80, 0)).astype(np.uint8)


@dataclass(frozen=True)
class Fp8Weight(QuantizedWeight):
    """A linear weight [out, in] of e4m3 bit patterns and its scales: one for the
    tensor, one per output row, or one per block of `block` (rows, columns).
    `dynamic_activations`: its checkpoint quantizes the activations it multiplies to
    e4m3 too, a token at a time (compressed-tensors' dynamic input_activations, as
    vLLM multiplies such weights): the CUDA backend's W8A8 products do, for steps of
    many rows. The numpy backend, the exact reference, multiplies them unquantized."""

    codes: np.ndarray  # uint8 [out, in]: e4m3 bit patterns
    scale: np.ndarray  # float32: [1, 1], [out, 1] or [ceil(out / rows), ceil(in / cols)]
    block: tuple[int, int] | None = None
    format: str = "fp8"
    dynamic_activations: bool = False

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes

    def float32(self) -> np.ndarray:
        scale = self.scale
        if self.block is not None:
            rows, cols = self.block
            scale = np.repeat(np.repeat(scale, rows, axis=0), cols, axis=1)[: self.shape[0], : self.shape[1]]
        return e4m3_to_f32(self.codes) * scale

    @staticmethod
    def concatenate(parts: list["Fp8Weight"]) -> "Fp8Weight | None":
        """The parts' rows as one weight (a fused projection), with per-row scales (a
        part's per-tensor scale given to each of its rows), or block scales where every
        part but the last fills whole blocks of rows; None otherwise."""
        block, dynamic = parts[0].block, all(p.dynamic_activations for p in parts)
        if any(p.block != block for p in parts) or (block and any(p.shape[0] % block[0] for p in parts[:-1])):
            return None
        codes = np.concatenate([p.codes for p in parts])
        if block:
            return Fp8Weight(codes, np.concatenate([p.scale for p in parts]), block, dynamic_activations=dynamic)
        rows = [np.broadcast_to(p.scale.reshape(-1, 1), (p.shape[0], 1)) for p in parts]
        return Fp8Weight(codes, np.concatenate(rows).astype(np.float32), dynamic_activations=dynamic)

    @staticmethod
    def quantize(w: np.ndarray) -> "Fp8Weight":
        """Per-output-channel: each row scaled so that its largest magnitude is 448."""
        scale = np.maximum(np.abs(w).max(axis=1, keepdims=True), 1e-12) / E4M3_MAX
        return Fp8Weight(f32_to_e4m3(w / scale), scale.astype(np.float32))

"""INT4 weight-only layouts, unpacked at load into one canonical form: a value 0..15
per weight, and per (output row, group) a scale and a zero point, with the group of
each input column (act-order checkpoints list theirs):

    w[o, i] = (q[o, i] - zero[o, group[i]]) * scale[o, group[i]]

- AutoAWQ's GEMM layout: qweight int32 [in, out / 8], eight output columns a word in
  the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble k holds column AWQ_ORDER[k]); qzeros the
  same over [groups, out / 8]; scales float16 [groups, out].
- GPTQ: qweight int32 [in / 8, out], eight input rows a word in order; qzeros int32
  [groups, out / 8], eight output columns a word in order, stored minus one in the
  original ("gptq") checkpoint format and as they are in "gptq_v2"; scales [groups,
  out]; g_idx int32 [in] where act-order reordered the columns.
- compressed-tensors pack-quantized: weight_packed int32 [out, in / 8], eight input
  columns a word in order, values offset by 8 (symmetric); weight_scale [out, groups];
  weight_zero_point, where asymmetric, packed as int32 [out / 8, groups].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.quantization.base import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_SHIFTS = 4 * np.argsort(AWQ_ORDER)  # column j of a word sits at nibble AWQ_REVERSE[j]
_SHIFTS = 4 * np.arange(8)


def unpack_int32(packed: np.ndarray, axis: int, shifts: np.ndarray = _SHIFTS) -> np.ndarray:
    """Eight 4-bit values from each int32 along `axis` (value k at bits shifts[k]..+3)."""
    p = np.moveaxis(packed.astype(np.uint32), axis, -1)
    values = (p[..., None] >> shifts.astype(np.uint32)) & 0xF
    return np.moveaxis(values.reshape(*p.shape[:-1], -1).astype(np.uint8), -1, axis)


def pack_int32(values: np.ndarray, axis: int, shifts: np.ndarray = _SHIFTS) -> np.ndarray:
    """The inverse of unpack_int32 (for writing checkpoints in tests and fixtures)."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    packed = np.bitwise_or.reduce(v << shifts.astype(np.uint32), axis=-1)
    return np.ascontiguousarray(np.moveaxis(packed.view(np.int32), -1, axis))


@dataclass(frozen=True)
class Int4Weight(QuantizedWeight):
    codes: np.ndarray  # uint8 [out, in], 0..15
    scale: np.ndarray  # float32 [out, groups]
    zero: np.ndarray  # uint8 [out, groups]
    group: np.ndarray  # int32 [in]: the group of each input column
    format: str = "int4"

    @property
    def nbytes(self) -> int:
        """As stored: half a byte a weight, and the group parameters."""
        return self.codes.size // 2 + self.scale.size * 2 + self.zero.size // 2

    def float32(self) -> np.ndarray:
        g = self.group
        return (self.codes.astype(np.float32) - self.zero[:, g]) * self.scale[:, g]

    @staticmethod
    def concatenate(parts: list["Int4Weight"]) -> "Int4Weight | None":
        """The parts' rows as one weight (a fused projection), where their columns share
        one grouping (as the projections of one checkpoint's layer do); None otherwise."""
        if any(not np.array_equal(p.group, parts[0].group) for p in parts[1:]):
            return None
        return Int4Weight(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]),
                          np.concatenate([p.zero for p in parts]), parts[0].group)


def groups_in_order(columns: int, group_size: int) -> np.ndarray:
    return (np.arange(columns) // group_size).astype(np.int32)


def from_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group_size: int) -> Int4Weight:
    q = unpack_int32(qweight, axis=1, shifts=_AWQ_SHIFTS)  # [in, out]
    zero = unpack_int32(qzeros, axis=1, shifts=_AWQ_SHIFTS)  # [groups, out]
    return Int4Weight(np.ascontiguousarray(q.T), np.ascontiguousarray(scales.astype(np.float32).T),
                      np.ascontiguousarray(zero.T), groups_in_order(q.shape[0], group_size))


def from_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray | None,
              group_size: int, zeros_minus_one: bool) -> Int4Weight:
    q = unpack_int32(qweight, axis=0)  # [in, out]
    zero = unpack_int32(qzeros, axis=1)  # [groups, out]
    if zeros_minus_one:
        zero = (zero.astype(np.int16) + 1).astype(np.uint8)  # (16 for a stored 15: not a nibble, but the value it means)
    group = g_idx.astype(np.int32) if g_idx is not None else groups_in_order(q.shape[0], group_size)
    return Int4Weight(np.ascontiguousarray(q.T), np.ascontiguousarray(scales.astype(np.float32).T),
                      np.ascontiguousarray(zero.T), group)


def from_pack_quantized(packed: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None,
                        shape: tuple[int, int], group_size: int | None) -> Int4Weight:
    out, columns = shape
    q = unpack_int32(packed, axis=1)[:, :columns]
    groups = scale.shape[1]
    if zero_point is None:
        zero = np.full((out, groups), 8, np.uint8)
    else:
        zero = unpack_int32(zero_point, axis=0)[:out]  # (packed offset by 8, as the values are)
    group = groups_in_order(columns, group_size) if group_size else np.zeros(columns, np.int32)
    return Int4Weight(q, scale.astype(np.float32), zero, group)

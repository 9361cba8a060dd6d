"""Linear weights in the forms the CPU kernels read (cpu_src/linear.c), repacked at
load from every format a checkpoint holds, never widened to float32:

- u4: GGUF Q4_0, Q4_1 and Q4_K, and the INT4 checkpoints (AWQ, GPTQ, compressed-tensors
  pack-quantized): a nibble a weight, and per block of 32 a scale d with an offset m
  (w = d q + m) or a zero point z (w = d (q - z)), one for the whole matrix where the
  format has one (Q4_0: 8).
- u8: GGUF Q8_0, its signed bytes offset by 128 (a zero point of 128).
- float: bfloat16, float16 and float32 as they are; FP8 e4m3 with its scales (per
  tensor, row or 128-column block) as a scale per row and group of columns.

The products of u4 and u8 quantize the activations in blocks of 32 first, to int8 or
int16 (ACTIVATION_BYTES; the kernels' comment says how), and their codes are laid out for
one or the other; float ones multiply in float32 like the numpy reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as GGML
from gguf.quants import Q4_K

from engine.backends.cpu.kernels import CpuKernels, addr
from engine.quantization.fp8 import Fp8Weight
from engine.quantization.gguf import GgufWeight
from engine.quantization.int4 import Int4Weight
from engine.weights import Tensor

BLOCK = 32
TILE_ROWS = 16  # weight rows of a tile in linear.c's TILE_LAYOUT
PANEL = 2048  # columns of a panel in linear.c's PANEL_LAYOUT
FLOAT_KINDS = {"f32": 0, "bf16": 1, "f16": 2, "e4m3": 3}  # as cpu_src/linear.c's enum
E4M3_AS_F16 = 256.0  # linear.c reads an e4m3 byte as a float16 of its value / 256
ACTIVATION_BYTES = {"int8": 1, "int16": 2}  # of each of base.CPU_ACTIVATIONS


@dataclass(frozen=True)
class CpuLinear:
    """A weight [n, k] as one of the kernels' forms. u4/u8: codes over kp >= k columns
    (a zero block pads a row to whole blocks) and rows by tiles of TILE_ROWS (zero rows
    pad the last), and per block of 32 a scale d and an offset m, or a zero point z
    (m = -d z), or without either the matrix's one zero point `zero`; d and m float16
    where that is exact (the checkpoint's own scales, as few bytes as it stores), else
    float32; codes and scales by panels of PANEL columns.
    float: codes in `kind`, and `scale` per row and group of `group` columns (or None).
    `perm`: the input column each of kp reads, where a checkpoint reordered them.
    `act`: the bytes of an activation (ACTIVATION_BYTES) that u4 and u8 codes are laid out for."""

    form: str  # "u4", "u8" or "float"
    codes: np.ndarray
    n: int
    k: int
    kp: int
    d: np.ndarray | None = None
    m: np.ndarray | None = None
    z: np.ndarray | None = None
    zero: int = 0
    kind: str = "f32"
    scale: np.ndarray | None = None
    group: int = 0
    perm: np.ndarray | None = None
    act: int = 2
    pointers: tuple = field(init=False, repr=False, compare=False)  # the arrays' addresses, as multiply reads them

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.d, self.m, self.z, self.scale) if a is not None)

    @property
    def dtype(self) -> str:
        """What the kernels multiply by, as ModelInfo says it."""
        return {"u4": "int4", "u8": "int8"}.get(self.form) or {"e4m3": "fp8_e4m3", "bf16": "bfloat16",
                                                              "f16": "float16"}.get(self.kind, "float32")

    def __post_init__(self) -> None:
        object.__setattr__(self, "pointers", tuple(addr(a) for a in (self.codes, self.d, self.m, self.z, self.scale,
                                                                     self.perm)))

    def product(self, kernels: CpuKernels, y: int, x: int, ldx: int, rows: int,
                scratch: "QuantizedRows") -> "PackedCall":
        """The call that makes y [rows, n] = x [rows, k] (row stride ldx) @ w^T, float32 at
        those addresses (`scratch` holds x quantized: u4, u8), its arguments packed once:
        a step of as many rows makes the same call again."""
        codes, d, m, z, scale, perm = self.pointers
        if self.form == "float":
            fn = kernels.linear_float_packed
            args = (y, self.n, x, ldx, rows, self.k, codes, FLOAT_KINDS[self.kind], scale, self.group, self.n)
        else:
            fn = kernels.linear_q_packed
            args = (y, self.n, x, ldx, rows, self.k, perm, scratch.xq, scratch.sx, scratch.xs, self.kp, codes, d, m, z,
                    self.zero, self.d.dtype == np.float16, self.n, 4 if self.form == "u4" else 8, self.act)
        return PackedCall(fn, args)

    def __call__(self, kernels: CpuKernels, x: np.ndarray) -> np.ndarray:
        """x [rows, k] float32 @ w^T: [rows, n] float32."""
        x = np.ascontiguousarray(x, np.float32)
        y = np.empty((len(x), self.n), np.float32)
        scratch = QuantizedRows(len(x), self.kp)  # (held while the call runs)
        self.product(kernels, addr(y), addr(x), self.k, len(x), scratch)()
        return y


class PackedCall:
    """A kernel call whose arguments (addresses and ints) it holds packed in an array, as
    linear.c's *_packed functions take them."""

    __slots__ = ("fn", "args", "ptr")

    def __init__(self, fn, args: tuple):
        self.fn, self.args = fn, np.array([a or 0 for a in args], np.int64)
        self.ptr = addr(self.args)

    def __call__(self) -> None:
        self.fn(self.ptr)


class QuantizedRows:
    """Room for `rows` activation rows of up to `columns` quantized (linear.c's linear_q),
    int8 or int16. The rows start on cache lines: the products read them 64 bytes at a
    time, and where such reads straddle two lines a batch of 8 multiplies ~15% slower."""

    def __init__(self, rows: int, columns: int):
        self.arrays = (line_aligned(rows * columns, np.int16), np.empty(rows * columns // BLOCK, np.float32),
                       np.empty(rows * columns // BLOCK, np.float32))
        self.xq, self.sx, self.xs = (addr(a) for a in self.arrays)


def line_aligned(n: int, dtype) -> np.ndarray:
    """An uninitialised array of n `dtype`s whose first element starts a 64-byte cache line."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.empty(n * itemsize + 63, np.uint8)
    start = -addr(raw) % 64
    return raw[start : start + n * itemsize].view(dtype)


def repack(weight, activations: str = "int16") -> CpuLinear:
    """A checkpoint's linear weight (a Tensor or a QuantizedWeight) in a kernel's form, its
    integer products quantizing the activations to `activations` (base.CPU_ACTIVATIONS)."""
    if isinstance(weight, GgufWeight):
        return _from_gguf(weight, ACTIVATION_BYTES[activations])
    if isinstance(weight, Int4Weight):
        return _from_int4(weight, ACTIVATION_BYTES[activations])
    if isinstance(weight, Fp8Weight):
        return _from_fp8(weight)
    if isinstance(weight, Tensor) and weight.format in ("f32", "bf16") and weight.shape[1] % 8 == 0:
        return _float(weight.data, weight.format)
    return _float(np.ascontiguousarray(weight.float32(), np.float32), "f32")


def _float(codes: np.ndarray, kind: str, scale: np.ndarray | None = None, group: int = 0) -> CpuLinear:
    n, k = codes.shape
    if k % 8 or (group and group % 8):  # (the kernel reads eight columns at a time)
        raise ValueError(f"the CPU kernels read weights of a multiple of 8 columns (in groups of as many), not {k} "
                         f"(groups of {group or k}): serve this model with --device numpy")
    return CpuLinear("float", np.ascontiguousarray(codes), n, k, k, kind=kind, scale=scale, group=group or k)


def _blocks(q: np.ndarray, d: np.ndarray, bits: int, k: int, act: int, *, m: np.ndarray | None = None,
            z: np.ndarray | int | None = None, perm: np.ndarray | None = None) -> CpuLinear:
    """u4 or u8 from q [n, blocks, 32] (0..15 or 0..255), d and m or z [n, blocks] (or
    one z for every block), laid out for activations of `act` bytes."""
    zero, z = (z, None) if isinstance(z, int) else (0, z)
    n, blocks, _ = q.shape
    pad = -n % TILE_ROWS  # (zero rows complete the last tile)
    q, d, m, z = (None if a is None else np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, d, m, z))
    # linear.c's TILE_LAYOUT, E = 4 / act weights a lane: [tile, block, slot c, row, weight E c + e]
    lane = 4 // act
    tiles = q.reshape(-1, TILE_ROWS, blocks, BLOCK // lane, lane).transpose(0, 2, 3, 1, 4)
    if bits == 4:  # slot c in the low nibbles, slot c + (its slots) / 2 in the high
        half = tiles.shape[2] // 2
        tiles = tiles[:, :, :half] | (tiles[:, :, half:] << 4)
    codes = tiles.reshape(len(tiles), blocks, -1).astype(np.uint8)
    scales = [a for a in (d, m) if a is not None]
    half = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in scales)
    d, m = (None if a is None else _panels(_by_tile(a.astype(np.float16 if half else np.float32))) for a in (d, m))
    return CpuLinear(f"u{bits}", _panels(codes), n, k, blocks * BLOCK, d=d, m=m,
                     z=None if z is None else _panels(_by_tile(z.astype(np.uint8))), zero=zero, perm=perm, act=act)


def _by_tile(a: np.ndarray) -> np.ndarray:
    """Block scales [rows, blocks] as TILE_LAYOUT holds them: [tile, block, row of the tile]."""
    return a.reshape(-1, TILE_ROWS, a.shape[1]).transpose(0, 2, 1)


def _panels(a: np.ndarray) -> np.ndarray:
    """[tiles, blocks, ...] as linear.c's PANEL_LAYOUT: the tiles' blocks of each PANEL
    columns (the last what is left), one panel after the other, starting on a cache line."""
    width = PANEL // BLOCK
    flat = np.concatenate([a[:, b : b + width].ravel() for b in range(0, a.shape[1], width)])
    out = line_aligned(flat.size, flat.dtype)
    out[:] = flat
    return out


def _from_gguf(w: GgufWeight, act: int) -> CpuLinear:
    n, k = w.shape
    raw = w.blocks.reshape(n, -1, w.blocks.shape[1] // _gguf_blocks(w))
    f16 = lambda a: a.copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if w.kind == GGML.Q8_0:
        d = f16(raw[..., 0:2])
        q = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return _blocks(q, d, 8, k, act, z=128)
    if w.kind in (GGML.Q4_0, GGML.Q4_1):
        d = f16(raw[..., 0:2])
        packed = raw[..., -16:]  # byte j: weight j (low nibble), weight j + 16 (high)
        q = np.concatenate([packed & 0xF, packed >> 4], axis=-1)
        if w.kind == GGML.Q4_0:
            return _blocks(q, d, 4, k, act, z=8)
        return _blocks(q, d, 4, k, act, m=f16(raw[..., 2:4]))
    if w.kind == GGML.Q4_K:  # super-blocks of 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
        supers = raw.reshape(-1, raw.shape[-1])
        d, dmin = f16(supers[:, 0:2])[:, None], f16(supers[:, 2:4])[:, None]
        sc, mn = Q4_K.get_scale_min(supers[:, 4:16])
        packed = supers[:, 16:].reshape(-1, 4, BLOCK)  # chunk c: sub-block 2c low, 2c + 1 high (u4's own order)
        q = np.stack([packed & 0xF, packed >> 4], axis=2).reshape(n, -1, BLOCK)
        return _blocks(q, (d * sc).reshape(n, -1), 4, k, act, m=(-dmin * mn).reshape(n, -1))
    raise ValueError(f"no CPU kernel reads GGUF {w.kind.name}")


def _gguf_blocks(w: GgufWeight) -> int:
    """Blocks a row (of 32 weights, or of 256 for the K-quants)."""
    return w.columns // (256 if w.kind == GGML.Q4_K else BLOCK)


def _from_int4(w: Int4Weight, act: int) -> CpuLinear:
    n, k = w.shape
    perm = None
    group = w.group
    if np.any(np.diff(group) < 0):  # act-order: the columns read in group order
        perm = np.argsort(group, kind="stable").astype(np.int32)
        group = group[perm]
    padded = -(-k // BLOCK) * BLOCK
    block_group = np.pad(group, (0, padded - k), mode="edge").reshape(-1, BLOCK)
    if np.any(block_group != block_group[:, :1]):
        return _float(np.ascontiguousarray(w.float32(), np.float32), "f32")  # (groups not whole blocks of 32)
    codes = w.codes if perm is None else w.codes[:, perm]
    q = np.pad(codes, ((0, 0), (0, padded - k))).reshape(n, -1, BLOCK)
    g = block_group[:, 0]
    return _blocks(q, w.scale[:, g], 4, k, act, z=w.zero[:, g], perm=perm)


def _from_fp8(w: Fp8Weight) -> CpuLinear:
    n, k = w.shape
    if w.block is None:  # per tensor or per row: one group of every column
        scale = np.broadcast_to(w.scale, (n, 1))
        return _float(w.codes, "e4m3", np.ascontiguousarray(scale * E4M3_AS_F16, np.float32), k)
    rows, cols = w.block
    scale = np.repeat(w.scale, rows, axis=0)[:n]
    return _float(w.codes, "e4m3", np.ascontiguousarray(scale * E4M3_AS_F16, np.float32), cols)

"""Linear layers on the GPU: a weight in its format, and y = x @ w^T by it.

A GEMM tile of one row takes our GEMV (gemv.cu), in the weight's format. A tile of 2 to
32 rows of an FP8 weight takes our skinny GEMM (skinny_gemm.cu), which reads the codes
once. Larger tiles of an FP8 weight whose checkpoint quantizes its activations too
(LinearWeight.w8a8: an FP8-dynamic checkpoint) are W8A8 products, given a cuBLASLt
handle (`lt`): the tile's rows quantized to e4m3 a token at a time, the codes
multiplied on the FP8 tensor cores (cuBLASLt takes one scale an operand on sm_90, so
none there), and the sums scaled by the token's scale and the weight row's
(fp8_activations.cu); at 1,024 rows a layer's four products take 105 µs against 171 in
bfloat16 (bench/fp8_gemm.py). Other tiles take cuBLAS in bfloat16: an FP8 or INT4
weight is first dequantized to bfloat16 into a scratch buffer (gemv.cu's dequantize_*),
once per product whatever its tiles, in chunks of rows where it is larger than the
buffer (the head). The W8A8 products quantize their rows into the same scratch, in
chunks of the rows it holds; where a step's layer is one such product, the kernels
around it quantize and scale back instead (`w8a8_plan`, forward.py). The skinny GEMM's
limits are measured (bench/skinny_gemm.py): at 64 rows it is behind dequantizing and
cuBLAS, and for bfloat16 weights behind cuBLAS at every row count, as yet. The
single-token fusions of forward.py (the GEMVs that also normalise, rotate or activate)
exist in each format.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.backends.cuda.cublas import Cublas, DataType
from engine.backends.cuda.cublaslt import CublasLt, GemmShape, LtPlan
from engine.backends.cuda.kernels import Kernels, skinny_split

BF16, FP8, INT4 = "bf16", "fp8", "int4"
FORMATS = (BF16, FP8, INT4)
SKINNY_TILES = {FP8: 32}  # the formats whose tiles of 2 rows to this many take the skinny GEMM
MAX_PLANS = 256  # cuBLASLt plans of W8A8 products kept (Linear._plan)


@dataclass(frozen=True)
class LinearWeight:
    """A linear layer's weight on the GPU, [d_out, d_in] in `format`: bfloat16 bits;
    e4m3 codes with float32 scales (one per row, scale_cols 0; or one per 128 x 128
    block, [ceil(d_out / 128), scale_cols]); or INT4 codes, two a byte (column 2b in
    byte b's low nibble), with a (scale, zero point) pair of float32 per group of
    d_in / scale_cols columns, [d_out, scale_cols, 2] (cuda_src/weights.cuh)."""

    format: str
    data: Any  # a GPUArray: bfloat16 bits, uint8 e4m3 codes, or uint8 pairs of INT4 codes
    d_out: int
    d_in: int
    scale: Any = None  # fp8, int4: a GPUArray of float32
    scale_cols: int = 0
    w8a8: bool = False  # fp8 with a scale a row: its checkpoint's activations are FP8 too (Fp8Weight.dynamic_activations)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)


class Linear:
    """y = x @ w^T on the stream, one product per GEMM tile of rows (step_metadata).
    `scratch` (a GPUArray) holds a dequantized weight, or a chunk of one, for cuBLAS:
    bfloat16, at least one row of every quantized weight. `skinny_tiles`: the largest
    tile of each format that takes the skinny GEMM (at most SKINNY_MAX_ROWS; benchmarks
    compare others). `lt`: the cuBLASLt handle of the W8A8 products (none: FP8 tiles of
    more rows dequantize)."""

    def __init__(self, blas: Cublas, stream, scratch=None, skinny_tiles: dict[str, int] = SKINNY_TILES,
                 lt: CublasLt | None = None):
        self.blas, self.stream, self.scratch, self.skinny_tiles, self.lt = blas, stream, scratch, skinny_tiles, lt
        # the W8A8 products' plans, most recently used last (None: cuBLASLt has no algorithm)
        self._plans: OrderedDict[GemmShape, LtPlan | None] = OrderedDict()

    def __call__(self, kernels: Kernels, y, x, w: LinearWeight, tiles: list[tuple[int, int]]) -> None:
        """y [rows, d_out] (bfloat16, or float32 for logits) from x [rows, d_in] in bfloat16,
        over the (first row, rows) tiles."""
        if w.format not in FORMATS:
            raise ValueError(f"no GPU product for {w.format} weights (formats: {', '.join(FORMATS)})")
        out_f32 = y.dtype == np.float32
        y_row, x_row = w.d_out * y.dtype.itemsize, w.d_in * 2
        y_type = DataType.F32 if out_f32 else DataType.BF16
        gemm_tiles = []
        for r, rows in tiles:
            y_ptr, x_ptr = int(y.gpudata) + r * y_row, int(x.gpudata) + r * x_row
            if rows == 1:  # (d_in is a multiple of 8, 16 for FP8, as gemv.cu needs: checked at upload)
                kernels.gemv(self.stream, y_ptr, x_ptr, w, w.d_in, w.d_out, out_f32)
            elif self._skinny(kernels, w, rows):
                kernels.skinny_gemm(self.stream, y_ptr, x_ptr, w, rows, w.d_in, w.d_out, out_f32)
            else:
                gemm_tiles.append((y_ptr, x_ptr, rows))
        if not gemm_tiles:
            return
        if w.format == BF16:
            for y_ptr, x_ptr, rows in gemm_tiles:
                self.blas.gemm(y_ptr, y_type, x_ptr, DataType.BF16, int(w.data.gpudata), DataType.BF16, rows, w.d_in,
                               w.d_out)
            return
        if w.w8a8 and self.lt is not None:  # (tiles cuBLASLt has no FP8 algorithm for dequantize, below)
            gemm_tiles = [(y_ptr, x_ptr, rows) for y_ptr, x_ptr, rows in gemm_tiles
                          if not self._w8a8(kernels, y_ptr, x_ptr, rows, w, y_type)]
            if not gemm_tiles:
                return
        chunk = min(w.d_out, self.scratch.nbytes // (2 * w.d_in))
        for first in range(0, w.d_out, chunk):
            n = min(chunk, w.d_out - first)
            kernels.dequantize(self.stream, self.scratch, w, first, n)
            for y_ptr, x_ptr, rows in gemm_tiles:  # (the chunk's columns of y, whose rows stay d_out wide)
                self.blas.gemm(y_ptr + first * y.dtype.itemsize, y_type, x_ptr, DataType.BF16, int(self.scratch.gpudata),
                               DataType.BF16, rows, w.d_in, n, ldy=w.d_out)

    def w8a8_plan(self, kernels: Kernels, w: LinearWeight, tiles: list[tuple[int, int]]) -> LtPlan | None:
        """The plan of w's product over `tiles` where it is a single W8A8 product of the
        codes its caller brings (`w8a8_codes`): one tile, of more rows than the skinny GEMM
        takes, of an FP8-dynamic weight. None otherwise: then `__call__` computes it."""
        if not (w.w8a8 and self.lt is not None and len(tiles) == 1):
            return None
        rows = tiles[0][1]
        if rows == 1 or self._skinny(kernels, w, rows):
            return None
        return self._plan(GemmShape(rows, w.d_in, w.d_out, DataType.BF16, DataType.E4M3, DataType.E4M3))

    def w8a8_codes(self, plan: LtPlan, y, codes, w: LinearWeight) -> None:
        """y [rows, d_out] = codes [rows, d_in] @ w^T, the plan's product of e4m3 codes:
        sums in bfloat16, to be scaled back by the codes' row scales and w.scale (SumScales)."""
        self.lt.matmul(plan, 0, int(y.gpudata), int(codes.gpudata), int(w.data.gpudata))

    def _w8a8(self, kernels: Kernels, y_ptr: int, x_ptr: int, rows: int, w: LinearWeight, y_type: DataType) -> bool:
        """A tile's W8A8 product, in chunks of the rows the scratch holds (codes, then
        their scales); False where cuBLASLt has no algorithm for it."""
        chunk = self.scratch.nbytes // (w.d_in + 4)
        firsts = range(0, rows, chunk)
        plans = [self._plan(GemmShape(min(chunk, rows - first), w.d_in, w.d_out, y_type, DataType.E4M3, DataType.E4M3))
                 for first in firsts]
        if None in plans:
            return False
        codes, y_bytes = int(self.scratch.gpudata), 4 if y_type == DataType.F32 else 2
        for first, plan in zip(firsts, plans):
            n = plan.shape.tokens
            scales = codes + n * w.d_in
            y_rows, x_rows = y_ptr + first * w.d_out * y_bytes, x_ptr + first * w.d_in * 2
            kernels.quantize_rows_e4m3(self.stream, codes, scales, x_rows, n, w.d_in)
            self.lt.matmul(plan, 0, y_rows, codes, int(w.data.gpudata))
            kernels.scale_rows_and_cols(self.stream, y_rows, scales, w.scale, n, w.d_out, y_type == DataType.F32)
        return True

    def _plan(self, shape: GemmShape) -> LtPlan | None:
        """cuBLASLt's descriptors and algorithm for a W8A8 product's shape, kept for the
        MAX_PLANS shapes used last: eager prompt steps come in any number of rows, and
        asking the heuristic takes the host ~0.1 ms. (A CUDA graph keeps what it
        captured: a plan's descriptors are read only when a product is queued.)"""
        if shape in self._plans:
            self._plans.move_to_end(shape)
            return self._plans[shape]
        plan = self.lt.plan(shape, 1)
        if not plan.candidates:
            plan.close()
            plan = None
        self._plans[shape] = plan
        if len(self._plans) > MAX_PLANS:
            _, oldest = self._plans.popitem(last=False)
            if oldest is not None:
                oldest.close()
        return plan

    def _skinny(self, kernels: Kernels, w: LinearWeight, rows: int) -> bool:
        """Whether a tile of `rows` rows takes the skinny GEMM."""
        return (rows <= self.skinny_tiles.get(w.format, 0)
                and skinny_split(rows, w.d_in, w.d_out, w.format, kernels.sm_count) is not None)

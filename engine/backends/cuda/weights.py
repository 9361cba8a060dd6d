"""The model's weights uploaded to the GPU: matrices as LinearWeights (with Q/K/V and
gate/up fused as the architecture fuses them), norms and the embedding table as
bfloat16 arrays, under the names the architecture's layer reads.

FP8 matrices stay FP8 (e4m3 codes and float32 scales: per row, a per-tensor scale
given to every row, or 128 x 128 blocks). Other quantized formats (INT4, GGUF's
blocks), and FP8 of another block size or of rows not a multiple of 16 wide, are
uploaded dequantized to bfloat16. With `int4`, INT4 matrices stay INT4 (codes
repacked two a byte, a scale and a zero point per group) where their groups are runs
of columns a multiple of 32 wide (not act-order's): the INT4 kernels are not yet
ahead of bfloat16 (a batch-1 token took as long, a prompt longer, and a step of more
rows dequantizes every matrix: bench/RESULTS.md), so only the benchmarks and tests
ask for them. The embedding gather reads bfloat16, so a quantized
embedding is uploaded dequantized as well (its tied head stays FP8)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pycuda.gpuarray as gpuarray

from engine.backends.cuda.linear import BF16, FP8, INT4, LinearWeight
from engine.quantization.fp8 import Fp8Weight
from engine.quantization.int4 import Int4Weight, groups_in_order
from engine.weights import ModelWeights, Tensor

FP8_BLOCK = (128, 128)  # the block scales gemv.cu reads
SCRATCH_BYTES = 64 * 2**20  # Llama 3.2 1B's gate/up projection in bfloat16: its head goes in 9 chunks


def fp8_on_gpu(tensor) -> bool:
    """Whether the GPU's kernels read this weight as FP8 as it is."""
    return (isinstance(tensor, Fp8Weight) and tensor.shape[1] % 16 == 0
            and (tensor.block is None or tuple(tensor.block) == FP8_BLOCK))


def fp8_linear(tensor: Fp8Weight) -> LinearWeight:
    """An FP8 weight on the GPU as gemv.cu reads it (fp8_on_gpu must hold)."""
    d_out, d_in = tensor.shape
    scale = tensor.scale.astype(np.float32)
    if tensor.block is None:  # per row, or one for the tensor given to every row
        scale = np.broadcast_to(scale.reshape(-1), (d_out,))
    return LinearWeight(FP8, gpuarray.to_gpu(np.ascontiguousarray(tensor.codes)), d_out, d_in,
                        gpuarray.to_gpu(np.ascontiguousarray(scale)), 0 if tensor.block is None else scale.shape[1],
                        w8a8=tensor.dynamic_activations and tensor.block is None)


def int4_group_columns(tensor) -> int | None:
    """The group size of an INT4 weight the GPU's kernels read as INT4 (groups in order,
    each a multiple of 32 columns), else None."""
    if not isinstance(tensor, Int4Weight):
        return None
    d_in, groups = tensor.shape[1], tensor.scale.shape[1]
    size = d_in // groups
    if d_in % groups or size % 32 or not np.array_equal(tensor.group, groups_in_order(d_in, size)):
        return None
    return size


def int4_linear(tensor: Int4Weight) -> LinearWeight:
    """An INT4 weight on the GPU as gemv.cu reads it (int4_group_columns must give its size)."""
    d_out, d_in = tensor.shape
    packed = (tensor.codes[:, 0::2] | tensor.codes[:, 1::2] << 4).astype(np.uint8)
    params = np.stack([tensor.scale.astype(np.float32), tensor.zero.astype(np.float32)], axis=-1)
    return LinearWeight(INT4, gpuarray.to_gpu(np.ascontiguousarray(packed)), d_out, d_in,
                        gpuarray.to_gpu(np.ascontiguousarray(params)), tensor.scale.shape[1])


@dataclass
class DeviceWeights:
    embed: gpuarray.GPUArray  # [vocab, hidden], bfloat16
    final_norm: gpuarray.GPUArray
    lm_head: LinearWeight  # the embedding's data when tied (bfloat16)
    layers: list[dict[str, LinearWeight | gpuarray.GPUArray]]
    nbytes: int

    def _matrices(self) -> list[LinearWeight]:
        return [w for w in [self.lm_head, *(w for layer in self.layers for w in layer.values())]
                if isinstance(w, LinearWeight)]

    @property
    def formats(self) -> set[str]:
        """The formats of the matrices as uploaded."""
        return {w.format for w in self._matrices()}

    @property
    def w8a8(self) -> bool:
        """Whether any matrix takes W8A8 products (LinearWeight.w8a8)."""
        return any(w.w8a8 for w in self._matrices())

    @property
    def scratch_bytes(self) -> int:
        """The bfloat16 scratch a quantized weight is dequantized into for cuBLAS: its
        largest matrix, up to SCRATCH_BYTES (larger ones go in chunks of rows); 0 if none."""
        sizes = [2 * w.d_out * w.d_in for w in self._matrices() if w.format != BF16]
        return min(max(sizes, default=0), SCRATCH_BYTES)

    @staticmethod
    def upload(weights: ModelWeights, int4: bool = False) -> "DeviceWeights":
        uploaded: dict[int, gpuarray.GPUArray] = {}  # bfloat16 arrays (a tied head is the embedding's upload)
        quantized: list[LinearWeight] = []

        def array(tensor: Tensor) -> gpuarray.GPUArray:
            if id(tensor) not in uploaded:
                uploaded[id(tensor)] = gpuarray.to_gpu(tensor.bf16_bits())
            return uploaded[id(tensor)]

        def upload(tensor: Tensor) -> LinearWeight | gpuarray.GPUArray:
            if len(tensor.shape) == 1:
                return array(tensor)
            if fp8_on_gpu(tensor):
                quantized.append(fp8_linear(tensor))
                return quantized[-1]
            if int4 and int4_group_columns(tensor):
                quantized.append(int4_linear(tensor))
                return quantized[-1]
            return LinearWeight(BF16, array(tensor), *tensor.shape)

        layers = [{name: upload(tensor) for name, tensor in layer.items()} for layer in weights.layers]
        embed, final_norm, lm_head = array(weights.embed), array(weights.final_norm), upload(weights.lm_head)
        nbytes = sum(a.nbytes for a in uploaded.values()) + sum(w.nbytes for w in quantized)
        return DeviceWeights(embed, final_norm, lm_head, layers, nbytes)

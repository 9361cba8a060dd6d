"""The model's weights uploaded to the GPU: matrices as LinearWeights (bfloat16, with
Q/K/V and gate/up fused as the architecture fuses them), norms and the embedding table
as bfloat16 arrays, under the names the architecture's layer reads."""

from __future__ import annotations

from dataclasses import dataclass

import pycuda.gpuarray as gpuarray

from engine.backends.cuda.linear import BF16, LinearWeight
from engine.weights import ModelWeights, Tensor


@dataclass
class DeviceWeights:
    embed: gpuarray.GPUArray  # [vocab, hidden], bfloat16
    final_norm: gpuarray.GPUArray
    lm_head: LinearWeight  # the embedding's data when tied
    layers: list[dict[str, LinearWeight | gpuarray.GPUArray]]
    nbytes: int

    @staticmethod
    def upload(weights: ModelWeights) -> "DeviceWeights":
        uploaded: dict[int, gpuarray.GPUArray] = {}  # (a tied head is the embedding's upload)

        def array(tensor: Tensor) -> gpuarray.GPUArray:
            if id(tensor) not in uploaded:
                uploaded[id(tensor)] = gpuarray.to_gpu(tensor.bf16_bits())
            return uploaded[id(tensor)]

        def upload(tensor: Tensor) -> LinearWeight | gpuarray.GPUArray:
            if len(tensor.shape) == 1:
                return array(tensor)
            d_out, d_in = tensor.shape
            return LinearWeight(BF16, array(tensor), d_out, d_in)

        layers = [{name: upload(tensor) for name, tensor in layer.items()} for layer in weights.layers]
        embed, final_norm, lm_head = array(weights.embed), array(weights.final_norm), upload(weights.lm_head)
        return DeviceWeights(embed, final_norm, lm_head, layers, sum(a.nbytes for a in uploaded.values()))

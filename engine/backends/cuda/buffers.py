"""Device memory of a step: its metadata and activations (StepBuffers), and the paged
KV cache every step reads and writes (KvCache)."""

from __future__ import annotations

import math

import numpy as np
import pycuda.gpuarray as gpuarray

from engine.backends.cuda.kernels import block_shift
from engine.backends.cuda.step_metadata import FIELDS, StepShape, field_sizes
from engine.config import ModelConfig
from engine.quantization.kv_cache import KvScale


class StepBuffers:
    """Device memory for one step of a given shape: int32 metadata, then activations.
    With `within`, views of the leading elements of flat buffers instead (`shared`):
    CUDA graphs run one at a time on one stream, so all of them share one set."""

    def __init__(self, c: ModelConfig, shape: StepShape, empty=None, within: dict[str, gpuarray.GPUArray] | None = None):
        for name, (dims, dtype) in self.layout(c, shape).items():
            setattr(self, name, empty(dims, dtype) if within is None else within[name][: math.prod(dims)].reshape(dims))
        offsets = np.cumsum([0] + field_sizes(shape))
        self.meta_ptr = {name: np.uintp(int(self.meta.gpudata) + 4 * int(o)) for name, o in zip(FIELDS, offsets)}

    @staticmethod
    def shared(c: ModelConfig, shapes: list[StepShape]) -> dict[str, gpuarray.GPUArray]:
        """A flat buffer per name, as large as the largest of `shapes` needs, for `within`."""
        layouts = [StepBuffers.layout(c, s) for s in shapes]
        return {name: gpuarray.empty(max(math.prod(layout[name][0]) for layout in layouts), dtype)
                for name, (_, dtype) in layouts[0].items()}

    @staticmethod
    def layout(c: ModelConfig, shape: StepShape) -> dict[str, tuple[tuple[int, ...], type]]:
        T, P, rows, sample_rows = shape.tokens, shape.partitions, shape.rows, max(1, shape.head_rows)
        partial = shape.partial_rows
        return {
            "meta": ((sum(field_sizes(shape)),), np.int32),
            "residual": ((T, c.hidden_size), np.float32),
            "h": ((rows, c.hidden_size), np.uint16),
            "qkv": ((rows, c.q_size + 2 * c.kv_size), np.uint16),
            "attn": ((rows, c.q_size), np.uint16),
            "delta": ((rows, c.hidden_size), np.uint16),
            "gate_up": ((rows, 2 * c.intermediate_size), np.uint16),
            "act": ((rows, c.intermediate_size), np.uint16),
            # the activation scales of W8A8 products, in turn (forward.LayerLaunches)
            "row_scales": ((rows,), np.float32),
            "other_row_scales": ((rows,), np.float32),
            "part_acc": ((partial, c.num_heads, P, c.head_dim), np.float32),
            "part_max": ((partial, c.num_heads, P), np.float32),
            "part_sum": ((partial, c.num_heads, P), np.float32),
            "final": ((sample_rows, c.hidden_size), np.uint16),
            "logits": ((sample_rows, c.vocab_size), np.float32),
        }


class KvCache:
    """Each layer's K and V, [blocks, kv_heads, block_size, head_dim] (a KV head's
    positions of a block in one run, as attention reads them): bfloat16, or e4m3 codes
    where `fp8` (cuda_src/kv_cache.cuh), written and read over each layer's `scales`.
    Slot block * block_size + offset names a block's position. One block more than asked
    for, `dummy_block`, belongs to no sequence: the padding rows of CUDA graphs and
    batch-invariant tiles write there."""

    def __init__(self, c: ModelConfig, num_blocks: int, block_size: int, fp8: bool, scales: list[KvScale]):
        self.block_shift = block_shift(block_size)  # (a ValueError unless a power of two)
        shape, dtype = (num_blocks + 1, c.num_kv_heads, block_size, c.head_dim), self.element(fp8)
        self.k = [gpuarray.empty(shape, dtype) for _ in range(c.num_layers)]
        self.v = [gpuarray.empty(shape, dtype) for _ in range(c.num_layers)]
        self.block_size, self.dummy_block, self.scales = block_size, num_blocks, scales

    @staticmethod
    def element(fp8: bool) -> np.dtype:
        """The cache's element as the host holds it: bfloat16's bits, or an e4m3 code."""
        return np.dtype(np.uint8 if fp8 else np.uint16)

    @staticmethod
    def bytes_per_block(c: ModelConfig, block_size: int, fp8: bool) -> int:
        return 2 * c.num_layers * block_size * c.kv_size * KvCache.element(fp8).itemsize

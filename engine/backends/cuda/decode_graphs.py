"""CUDA graphs of decode steps: one captured step per batch-size bucket, replayed with
a single launch instead of hundreds."""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import numpy as np
import pycuda.gpuarray as gpuarray

from engine.backends.cuda.buffers import StepBuffers
from engine.backends.cuda.forward import ForwardPass
from engine.backends.cuda.graph import CudaGraph
from engine.backends.cuda.kernels import SIGNATURES, Kernels
from engine.backends.cuda.step_metadata import StepShape, decode_shape
from engine.scheduler import ScheduledSeq

log = logging.getLogger("llamastream.engine")
Metadata = Callable[[list[ScheduledSeq], StepShape], np.ndarray]  # a step's metadata array


class DecodeGraphs:
    """One captured decode step per batch-size bucket, for batches of single-token
    decodes (of generated tokens: prompt tokens take other GEMM tiles) whose contexts
    fit `max_context`; padding rows use the dummy KV block. The buckets are vLLM's
    (1, 2, 4, then every multiple of 8), so that a batch pads to at most 7 rows more;
    all are captured up front, and share one set of buffers (StepBuffers.shared).
    Replays run the same kernels as eager steps, over the bucket's rows: with batch
    invariance on they compute exactly what eager steps do. `kernels` is the
    programmatic build (kernels.py)."""

    def __init__(self, forward: ForwardPass, kernels: Kernels, metadata: Metadata, max_batch: int, max_context: int,
                 invariant: bool):
        self.forward, self.kernels, self.invariant = forward, kernels, invariant
        block_size = forward.cache.block_size
        self.buckets = sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})
        self.max_blocks = -(-max_context // block_size)
        self.max_context = self.max_blocks * block_size
        self.replays = 0
        start = time.perf_counter()
        shapes = {size: decode_shape(size, self.max_blocks, self.max_context, invariant) for size in self.buckets}
        shared = StepBuffers.shared(forward.config, list(shapes.values()))
        self.graphs: dict[int, tuple[StepShape, StepBuffers, CudaGraph]] = {
            size: self._capture(shape, shared, metadata) for size, shape in shapes.items()}
        log.info("captured %d CUDA graphs for decode batches of 1 to %d in %.2f s (%d programmatic launches each)",
                 len(self.buckets), max_batch, time.perf_counter() - start, self.graphs[1][2].programmatic_edges)

    def for_batch(self, batch: list[ScheduledSeq]) -> tuple[StepShape, StepBuffers, CudaGraph] | None:
        """The graph that runs `batch`, or None where it must run eagerly."""
        if len(batch) > self.buckets[-1]:
            return None
        if any(s.num_tokens != 1 or not s.samples or s.start < len(s.seq.prompt_ids) for s in batch):
            return None
        if max(s.start + 1 for s in batch) > self.max_context:
            return None
        self.replays += 1
        return self.graphs[self.buckets[bisect.bisect_left(self.buckets, len(batch))]]

    def _capture(self, shape: StepShape, shared: dict[str, gpuarray.GPUArray], metadata: Metadata):
        forward = self.forward
        buffers = StepBuffers(forward.config, shape, within=shared)
        buffers.meta.set(metadata([], shape))  # all padding: valid to run
        forward.queue(buffers, shape, self.kernels)  # once eagerly, so cuBLAS settles its choices outside the capture
        forward.stream.synchronize()
        graph = CudaGraph(forward.stream.handle, lambda: forward.queue(buffers, shape, self.kernels),
                          awaiting_kernels=SIGNATURES)
        return shape, buffers, graph

    def close(self) -> None:
        for _, _, graph in self.graphs.values():
            graph.close()

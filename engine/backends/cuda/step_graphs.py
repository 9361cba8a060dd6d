"""CUDA graphs of the steps whose kernels take less time on the GPU than their launches
take on the host: one captured step per bucket, replayed with a single launch instead
of hundreds."""

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
from engine.backends.cuda.step_metadata import StepShape, decode_shape, prompt_shape
from engine.scheduler import ScheduledSeq

log = logging.getLogger("llamastream.engine")
Metadata = Callable[[list[ScheduledSeq], StepShape], np.ndarray]  # a step's metadata array
# Prompt chunks up to 2,048 tokens, in steps of 128 past 128 (a chunk pads to its bucket:
# at most 127 rows). Eager, a step's ~160 launches each start after the previous kernel
# has drained, even where the host launches faster than the GPU runs them: a 1,024-token
# prompt's first token took 5.2 ms replayed against 5.6 eager (bench/HISTORY.md).
PROMPT_BUCKETS = (16, 32, 64) + tuple(range(128, 2049, 128))
# Decode batches of up to this many sequences also take graphs in contexts past
# max_context: eager, their launches took longer than their GPU work (bench/long_context.py).
LONG_DECODE_MAX_BATCH = 16


class StepGraphs:
    """Captured steps of three kinds:
    - decode: a batch of single-token decodes (of generated tokens: prompt tokens take
      other GEMM tiles) in contexts up to `max_context`, in vLLM's batch-size buckets (1,
      2, 4, then every multiple of 8) up to `max_batch`, so that a batch pads to at most
      7 rows more;
    - long decode: the same, in contexts up to `long_context`, for the buckets up to
      LONG_DECODE_MAX_BATCH (each graph's attention covers its longest context: its
      other partitions end at once, but their blocks still launch, and its block
      tables are that wide, so these graphs are kept for longer contexts and small batches);
    - prompt: one sequence's last prompt chunk (the rest of a prompt whose prefix is
      cached or computed, or a short prompt) in contexts up to `max_context`, in
      buckets of `prompt_buckets` tokens.
    Padding rows use the dummy KV block. All are captured up front and share one set of
    buffers (StepBuffers.shared). Replays run the same kernels as eager steps, over the
    bucket's rows: with batch invariance on they compute exactly what eager steps do.
    `kernels` is the programmatic build (kernels.py)."""

    def __init__(self, forward: ForwardPass, kernels: Kernels, metadata: Metadata, max_batch: int, max_context: int,
                 long_context: int, query_rows: int, invariant: bool, prompt_buckets: tuple[int, ...] = PROMPT_BUCKETS):
        self.forward, self.kernels, self.invariant = forward, kernels, invariant
        block_size = forward.cache.block_size
        self.decode_buckets = sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})
        self.prompt_buckets = sorted(prompt_buckets)
        max_blocks = -(-max_context // block_size)
        self.max_context = max_blocks * block_size
        long_blocks = -(-long_context // block_size)
        self.long_context = max(long_blocks * block_size, self.max_context)
        self.long_decode_buckets = [n for n in self.decode_buckets
                                    if n <= LONG_DECODE_MAX_BATCH and self.long_context > self.max_context]
        self.decode_replays = self.long_decode_replays = self.prompt_replays = 0  # (decode: long ones included)
        start = time.perf_counter()
        shapes = ({("decode", n): decode_shape(n, max_blocks, self.max_context, invariant) for n in self.decode_buckets}
                  | {("long decode", n): decode_shape(n, long_blocks, self.long_context, invariant)
                     for n in self.long_decode_buckets}
                  | {("prompt", n): prompt_shape(n, max_blocks, self.max_context, query_rows, invariant)
                     for n in self.prompt_buckets})
        shared = StepBuffers.shared(forward.config, list(shapes.values()))
        self.graphs: dict[tuple[str, int], tuple[StepShape, StepBuffers, CudaGraph]] = {
            key: self._capture(shape, shared, metadata) for key, shape in shapes.items()}
        log.info("captured %d CUDA graphs (decode batches of 1 to %d in contexts of up to %d tokens, and of 1 to %d "
                 "up to %d; prompt chunks of up to %d tokens) in %.2f s (%d programmatic launches each)",
                 len(self.graphs), max_batch, self.max_context, max(self.long_decode_buckets, default=0),
                 self.long_context, max(self.prompt_buckets, default=0), time.perf_counter() - start,
                 self.graphs["decode", 1][2].programmatic_edges)

    def for_batch(self, batch: list[ScheduledSeq]) -> tuple[StepShape, StepBuffers, CudaGraph] | None:
        """The graph that runs `batch`, or None where it must run eagerly."""
        context = max(s.start + s.num_tokens for s in batch)
        if len(batch) == 1 and self._is_prompt_chunk(batch[0]) and context <= self.max_context:
            self.prompt_replays += 1
            return self.graphs["prompt", self.prompt_buckets[bisect.bisect_left(self.prompt_buckets, batch[0].num_tokens)]]
        if any(s.num_tokens != 1 or not s.samples or s.start < len(s.seq.prompt_ids) for s in batch):
            return None
        kind, buckets = ("decode", self.decode_buckets) if context <= self.max_context else \
            ("long decode", self.long_decode_buckets)
        if context > self.long_context or not buckets or len(batch) > buckets[-1]:
            return None
        self.decode_replays += 1
        self.long_decode_replays += kind == "long decode"
        return self.graphs[kind, buckets[bisect.bisect_left(buckets, len(batch))]]

    def _is_prompt_chunk(self, s: ScheduledSeq) -> bool:
        """A prompt's last chunk (it samples), of prompt tokens only, that a bucket holds."""
        return (bool(self.prompt_buckets) and s.samples and s.start + s.num_tokens <= len(s.seq.prompt_ids)
                and s.num_tokens <= self.prompt_buckets[-1])

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

"""The CUDA backend: the device and its context, and the step protocol the engine
drives (engine/backends/base.py). One step uploads its token metadata in one copy,
runs the forward pass on one stream (forward.py, replayed as a CUDA graph where one
fits: step_graphs.py), samples on the GPU (sampler.py) and copies back only the
chosen token ids. `launch` queues all of it and returns, so that the engine's host
work overlaps the GPU's; up to two steps are in flight."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import numpy as np
import pycuda.driver as cuda
import pycuda.gpuarray as gpuarray
from pycuda.tools import DeviceMemoryPool

from engine.backends.base import MAX_STEPS_IN_FLIGHT, SampleLater, Wait, is_fp8_kv_cache
from engine.backends.cuda.buffers import KvCache, StepBuffers
from engine.backends.cuda.cublas import Cublas, CublasError
from engine.backends.cuda.cublaslt import CublasLt
from engine.backends.cuda.step_graphs import PROMPT_BUCKETS, StepGraphs
from engine.backends.cuda.forward import ForwardPass
from engine.backends.cuda.kernels import MAX_PART_BLOCKS, Kernels, prefill_query_rows
from engine.backends.cuda.linear import Linear
from engine.backends.cuda.sampler import GpuSampler
from engine.backends.cuda.step_metadata import LARGE_PARTITION, StepShape, build_metadata, step_shape
from engine.backends.cuda.weights import DeviceWeights
from engine.config import ModelConfig
from engine.quantization.kv_cache import cache_scales
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.weights import ModelWeights

log = logging.getLogger("llamastream.engine")
FORMAT_NAMES = {"bf16": "bfloat16", "fp8": "fp8_e4m3", "int4": "int4"}  # LinearWeight formats, as weight_dtype says them
WORKSPACE_BYTES = 32 * 2**20
ACTIVATION_RESERVE_BYTES = 2 * 2**30  # kept free for activations and logits
# The smallest block size (a power of two) of which a partition's blocks fit the
# attention kernels' table (MAX_PART_BLOCKS, with one block each side of it).
MIN_BLOCK_SIZE = 1 << (-(-LARGE_PARTITION // (MAX_PART_BLOCKS - 2)) - 1).bit_length()


def kv_cache_budget(fraction: float, total: int, free: int, ours: int) -> float:
    """Bytes the KV cache may take: this process's share of the GPU (`fraction` of its
    `total` memory, as vLLM's --gpu-memory-utilization is a share per instance) less
    what the process holds already (`ours`: weights and buffers), within what is still
    `free`, less ACTIVATION_RESERVE_BYTES. So replicas sharing a GPU each take their
    fraction, and a process started beside others takes no more than is left."""
    return min(fraction * total - ours, free) - ACTIVATION_RESERVE_BYTES


@dataclass
class StepSlot:
    """What one step in flight owns on the host: page-locked memory for its sampled
    tokens, and the event its sampling records. Each step in flight has its own, so
    that a step's copy never lands on tokens not read yet, and waiting for a step waits
    for it alone."""

    tokens: np.ndarray  # int32 [max sampling rows]
    done: cuda.Event


class CudaBackend:
    name = "cuda"

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: int = 0, cuda_graphs: bool = True,
                 graph_max_batch: int = 256, graph_max_context: int = 4096, prompt_graphs: bool = True,
                 batch_invariant: bool = False, kv_cache_dtype: str = "auto", int4_weights: bool = False):
        if config.head_dim not in (64, 128) or config.num_heads // config.num_kv_heads > 8:
            raise ValueError("the CUDA attention kernels need head_dim 64 or 128 and at most 8 heads per KV head")
        if config.hidden_size % 8 or config.intermediate_size % 8:
            raise ValueError("the CUDA kernels need hidden and intermediate sizes that are multiples of 8")
        self.config = config
        # K and V in bfloat16, or as e4m3 codes over each layer's scales, as the numpy
        # backend's (engine/quantization/kv_cache.py): half the bytes, twice the tokens
        self.fp8_kv = is_fp8_kv_cache(kv_cache_dtype)
        self.kv_scales = cache_scales(weights.kv_scales, self.fp8_kv)
        self.kv_cache_dtype = "fp8_e4m3" if self.fp8_kv else "bfloat16"
        self.batch_invariant = batch_invariant  # GEMMs in fixed tiles: see step_metadata
        cuda.init()
        self.device = cuda.Device(device)
        self.ctx = self.device.retain_primary_context()
        with self._context():
            self._free_at_start = cuda.mem_get_info()[0]  # (what this process takes is measured from here)
            major, minor = self.device.compute_capability()
            sm_count = self.device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
            group = config.num_heads // config.num_kv_heads
            self.kernel_build = (config.head_dim, group, f"sm_{major}{minor}", sm_count, self.fp8_kv)  # Kernels' arguments
            self.kernels = Kernels(*self.kernel_build)
            self.query_rows = prefill_query_rows(group)
            self.stream = cuda.Stream()
            self.pool = DeviceMemoryPool()
            self.workspace = cuda.mem_alloc(WORKSPACE_BYTES)
            self.blas = Cublas(self.stream.handle, int(self.workspace), WORKSPACE_BYTES)
            self.weights = DeviceWeights.upload(weights, int4=int4_weights)  # (INT4 as INT4: weights.py)
            self.weight_bytes = self.weights.nbytes
            # FP8 matrices stay FP8 (weights.py); other quantized ones are uploaded as bfloat16
            self.weight_dtype = " and ".join(sorted({FORMAT_NAMES[f] for f in self.weights.formats}))
            scratch = self.weights.scratch_bytes
            lt = CublasLt(self.stream.handle, int(self.workspace), WORKSPACE_BYTES) if self.weights.w8a8 else None
            self.linear = Linear(self.blas, self.stream, gpuarray.empty(scratch // 2, np.uint16) if scratch else None,
                                 lt=lt)  # (the W8A8 products of FP8-dynamic checkpoints: linear.py)
            # cos and sin of every RoPE angle the model meets (vLLM's cos_sin_cache): a
            # position's row is read by every layer, with nothing to compute
            self.cos_sin = gpuarray.empty((config.max_position_embeddings, config.head_dim // 2, 2), np.float32)
            self.kernels.rope_cos_sin(self.stream, self.cos_sin, gpuarray.to_gpu(config.rope_inv_freq()),
                                      config.max_position_embeddings)
            self.sampler = GpuSampler(self.kernels, self.stream, config.vocab_size, self.pool.allocate)
            self.stream.synchronize()
        log.info("CUDA backend on %s: %.2f GB of weights (%s%s)", self.device.name(), self.weights.nbytes / 1e9,
                 self.weight_dtype, "; FP8 activations in steps of many tokens" if self.weights.w8a8 else "")
        self._graph_settings = (cuda_graphs, graph_max_batch, graph_max_context, PROMPT_BUCKETS if prompt_graphs else ())
        self.cache: KvCache | None = None
        self.forward_pass: ForwardPass | None = None
        self.graphs: StepGraphs | None = None
        self._previous_samples: dict[Sequence, int] = {}  # where the last step's tokens sit in `sampled`

    def __del__(self):
        # PyCUDA's memory pool frees the blocks it holds when it is destroyed, and aborts
        # the process if no context is current then (as at a script's end): free them
        # now, with ours, and let later frees go straight to the driver.
        if getattr(self, "pool", None) is not None:
            with self._context():
                self.pool.stop_holding()

    @contextlib.contextmanager
    def _context(self):
        """Make our context current on the calling thread (the engine thread, in serving)."""
        self.ctx.push()
        try:
            yield
        finally:
            cuda.Context.pop()

    # -- the KV cache -------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        return KvCache.bytes_per_block(self.config, block_size, self.fp8_kv)

    def blocks_for_memory_fraction(self, fraction: float, block_size: int) -> int:
        """KV blocks that fit while this process stays under `fraction` of the GPU's memory
        (kv_cache_budget)."""
        with self._context():
            free, total = cuda.mem_get_info()
        budget = kv_cache_budget(fraction, total, free, self._free_at_start - free)
        return max(0, int(budget // self.kv_cache_bytes_per_block(block_size)))

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_batch: int, max_context: int) -> None:
        """The cache, and the CUDA graphs for decode steps of up to `max_batch` sequences
        (of fewer in contexts past graph_max_context, up to `max_context`) and for short
        prompt chunks."""
        if block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"block size {block_size} is too small for the attention kernel: use at least "
                             f"{MIN_BLOCK_SIZE}")
        c = self.config
        with self._context():
            self.cache = KvCache(c, num_blocks, block_size, self.fp8_kv, self.kv_scales)
            # A step samples at most one token per sequence, and each holds a block. The
            # device buffer stays put (graphs read it).
            self.sampled = gpuarray.empty(num_blocks, np.int32)
            self.sampler.allocate_masks(max_batch)
            self._step_slots = [StepSlot(cuda.pagelocked_empty(num_blocks, np.int32), cuda.Event())
                                for _ in range(MAX_STEPS_IN_FLIGHT)]
            arrivals = gpuarray.zeros((max_batch, c.num_kv_heads), np.int32)  # a row per token of a decode step
            self.forward_pass = ForwardPass(c, self.weights, self.cache, self.linear, self.cos_sin, self.sampled,
                                            arrivals, self.stream)
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GB)", num_blocks, block_size,
                 num_blocks * block_size, num_blocks * self.kv_cache_bytes_per_block(block_size) / 1e9)
        enabled, graph_max_batch, graph_max_context, prompt_buckets = self._graph_settings
        if enabled:
            with self._context():  # (compiles the kernels' build for graphs and captures them)
                self.graphs = StepGraphs(self.forward_pass, Kernels(*self.kernel_build, programmatic=True),
                                         self._metadata, min(graph_max_batch, max_batch),
                                         min(graph_max_context, max_context), max_context, self.query_rows,
                                         self.batch_invariant, prompt_buckets)

    def host_array(self, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        """Page-locked: an upload from pageable memory may wait until the stream
        reaches it, holding the host for the work queued before it."""
        with self._context():
            return cuda.pagelocked_empty(shape, dtype)

    def is_fatal(self, error: BaseException) -> bool:
        """A driver or cuBLAS error may leave the context unusable: stop serving."""
        return isinstance(error, (cuda.Error, CublasError))

    # -- one step -----------------------------------------------------------------
    def _metadata(self, batch: list[ScheduledSeq], shape: StepShape) -> np.ndarray:
        return build_metadata(batch, shape, self.cache.block_size, self.cache.dummy_block, self.query_rows,
                              self._previous_samples)

    def _forward(self, batch: list[ScheduledSeq]) -> gpuarray.GPUArray:
        """Run the step's tokens; return float32 logits [sampling sequences, vocab] on the GPU."""
        graph = self.graphs.for_batch(batch) if self.graphs else None
        if graph is not None:
            shape, buffers, replay = graph
            buffers.meta.set_async(self._metadata(batch, shape), stream=self.stream)
            replay.launch()
            return buffers.logits[: sum(s.samples for s in batch)]
        shape = step_shape(batch, self.query_rows, self.batch_invariant)
        buffers = StepBuffers(self.config, shape, lambda dims, dtype: gpuarray.empty(dims, dtype, allocator=self.pool.allocate))
        buffers.meta.set_async(self._metadata(batch, shape), stream=self.stream)
        self.forward_pass.queue(buffers, shape, self.kernels)
        # (buffers go back to the pool when dropped: later work on this one stream is
        # ordered after the kernels that use them)
        return buffers.logits[: shape.samples]

    def forward(self, batch: list[ScheduledSeq]) -> np.ndarray:
        """Logits of the sampling sequences, on the host (for tests and logprobs)."""
        with self._context():
            logits = self._forward(batch).get(stream=self.stream)
            self.stream.synchronize()
        return logits

    def execute(self, batch: list[ScheduledSeq], masks: np.ndarray | None = None):
        return self.launch(batch, masks)()

    def launch(self, batch: list[ScheduledSeq], masks: np.ndarray | None = None) -> Wait:
        """Queue the step (forward pass, sampling, the copy of the chosen tokens to the
        host) and return at once; the returned function waits for its samples. Pending
        tokens of the batch are read from the previous step's samples on the device."""
        return self.launch_forward(batch)(masks)

    def launch_forward(self, batch: list[ScheduledSeq]) -> SampleLater:
        """Queue the step's forward pass; the returned function queues its sampling (the
        rows of sequences with a guide masked first) and the copy of the tokens."""
        sampling = [s.seq for s in batch if s.samples]
        self._step_slots.append(self._step_slots.pop(0))
        slot = self._step_slots[0]
        with self._context():
            logits = self._forward(batch)
        self._previous_samples = {seq: i for i, seq in enumerate(sampling)}

        def sample(masks: np.ndarray | None) -> Wait:
            with self._context():
                collect = (self.sampler.sample(logits, sampling, self.sampled, slot.tokens, masks)
                           if sampling else list)
                slot.done.record(self.stream)

            def wait():
                with self._context():
                    slot.done.synchronize()  # (without the GIL: the server's threads run meanwhile)
                    outputs = iter(collect())
                return [next(outputs) if s.samples else None for s in batch]
            return wait
        return sample

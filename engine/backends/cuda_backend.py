"""The CUDA backend: our kernels in cuda_src/ (compiled by PyCUDA) and cuBLAS GEMMs.

Weights live on the GPU in bfloat16 with Q/K/V and gate/up fused; the residual
stream is float32 holding bfloat16 values, as transformers' bfloat16 hidden states
are. One step uploads its token metadata in one copy, runs every layer on one
stream, samples on the GPU and copies back only the chosen token ids (and the
logits rows of requests that asked for logprobs). `launch` queues all of it and
returns, so that the engine's host work overlaps the GPU's.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pycuda.driver as cuda
import pycuda.gpuarray as gpuarray
from pycuda.tools import DeviceMemoryPool

from engine.backends.cublas import Cublas, CublasError
from engine.backends.cuda_graph import CudaGraph
from engine.backends.cuda_kernels import (ATTENTION_THREADS, GEMV_WARPS, MAX_PART_BLOCKS, PREFILL_THREADS,
                                          SAMPLE_CLUSTER, SAMPLE_THREADS, STAGED_INPUT_BYTES, Kernels, blocks_per_sm,
                                          gemv_split, prefill_query_rows, rope_and_cache_threads)
from engine.backends.step_metadata import (FIELDS, PARTITION, SMALL_DECODE, StepShape, build_metadata, decode_shape,
                                           field_sizes, step_shape)
from engine.config import ModelConfig
from engine.models import architecture_of
from engine.sampler import SampleOutput, TokenLogprob, log_softmax
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.weights import ModelWeights, Tensor

log = logging.getLogger("llamastream.engine")
WORKSPACE_BYTES = 32 * 2**20
ACTIVATION_RESERVE_BYTES = 2 * 2**30  # kept free for activations and logits


def _ptr(a) -> np.uintp:
    return np.uintp(int(a.gpudata) if hasattr(a, "gpudata") else int(a))


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
        return {
            "meta": ((sum(field_sizes(shape)),), np.int32),
            "residual": ((T, c.hidden_size), np.float32),
            "h": ((rows, c.hidden_size), np.uint16),
            "qkv": ((rows, c.q_size + 2 * c.kv_size), np.uint16),
            "attn": ((rows, c.q_size), np.uint16),
            "delta": ((rows, c.hidden_size), np.uint16),
            "gate_up": ((rows, 2 * c.intermediate_size), np.uint16),
            "act": ((rows, c.intermediate_size), np.uint16),
            "part_acc": ((T, c.num_heads, P, c.head_dim), np.float32),
            "part_max": ((T, c.num_heads, P), np.float32),
            "part_sum": ((T, c.num_heads, P), np.float32),
            "final": ((sample_rows, c.hidden_size), np.uint16),
            "logits": ((sample_rows, c.vocab_size), np.float32),
        }


class DecodeGraphs:
    """One captured decode step per batch-size bucket, for batches of single-token
    decodes (of generated tokens: prompt tokens take other GEMM tiles) whose contexts
    fit `max_context`; padding rows use the dummy KV block. The buckets are vLLM's
    (1, 2, 4, then every multiple of 8), so that a batch pads to at most 7 rows more;
    all are captured up front, and share one set of buffers (StepBuffers.shared).
    Replays run the same kernels as eager steps, over the bucket's rows: with batch
    invariance on they compute exactly what eager steps do."""

    def __init__(self, backend: "CudaBackend", max_batch: int, max_context: int):
        self.backend = backend
        self.buckets = sorted({b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch})
        self.max_blocks = -(-max_context // backend.block_size)
        self.max_context = self.max_blocks * backend.block_size
        self.replays = 0
        self.kernels = Kernels(*backend.kernel_build, programmatic=True)
        start = time.perf_counter()
        shapes = {size: self._shape(size) for size in self.buckets}
        shared = StepBuffers.shared(backend.config, list(shapes.values()))
        self.graphs: dict[int, tuple[StepShape, StepBuffers, CudaGraph]] = {
            size: self._capture(shape, shared) for size, shape in shapes.items()}
        log.info("captured %d CUDA graphs for decode batches of 1 to %d in %.2f s (%d programmatic launches each)",
                 len(self.buckets), max_batch, time.perf_counter() - start, self.graphs[1][2].programmatic_edges)

    def for_batch(self, batch: list[ScheduledSeq]):
        if len(batch) > self.buckets[-1]:
            return None
        if any(s.num_tokens != 1 or not s.samples or s.start < len(s.seq.prompt_ids) for s in batch):
            return None
        if max(s.start + 1 for s in batch) > self.max_context:
            return None
        self.replays += 1
        return self.graphs[self.buckets[bisect.bisect_left(self.buckets, len(batch))]]

    def _shape(self, size: int) -> StepShape:
        return decode_shape(size, self.max_blocks, self.max_context, self.backend.batch_invariant)

    def _capture(self, shape: StepShape, shared: dict[str, gpuarray.GPUArray]):
        be = self.backend
        buffers = StepBuffers(be.config, shape, within=shared)
        buffers.meta.set(be._metadata([], shape))  # all padding: valid to run
        be._launch(buffers, shape, self.kernels)  # once eagerly, so cuBLAS settles its choices outside the capture
        be.stream.synchronize()
        graph = CudaGraph(be.stream.handle, lambda: be._launch(buffers, shape, self.kernels),
                          awaiting_kernels=Kernels.SIGNATURES)
        return shape, buffers, graph

    def close(self) -> None:
        for _, _, graph in self.graphs.values():
            graph.close()


@dataclass(frozen=True)
class _Normed:
    """The residual stream's RMSNorm with `weight`, not yet computed (fused into a GEMV if it can be)."""

    weight: str


@dataclass(frozen=True)
class _Linear:
    """x @ weight^T, not yet computed: where it lands, and what rides with it, is up to its consumer."""

    x: "_Normed | gpuarray.GPUArray"
    weight: str


class _LayerLaunches:
    """The LayerOps of engine/models, each queued as this backend's kernels for one step.

    Values between ops are StepBuffers' arrays, or the lazy _Normed and _Linear, which
    their consumer computes into the buffer it needs. That is where the single-token
    fusions (`fused`, a step of one row: gemv.cu) come in: rms_norm -> linear ->
    rope_and_cache is one gemv_rmsnorm_rope, rms_norm -> linear -> silu_and_mul one
    gemv_rmsnorm_silu, and linear -> add_to_residual one gemv_add. Otherwise an add to
    the residual is left pending and rides in the next add_rmsnorm."""

    def __init__(self, backend: "CudaBackend", kernels: Kernels, buffers: StepBuffers, shape: StepShape, fused: bool):
        self.be, self.k, self.b, self.shape, self.fused = backend, kernels, buffers, shape, fused
        c = backend.config
        self.c, self.st, self.m = c, backend.stream, buffers.meta_ptr
        self.eps, self.tiles = np.float32(c.rms_norm_eps), shape.gemm_tiles()
        self.pending = np.uintp(0)  # a delta not yet added into the residual

    def at_layer(self, weights: dict[str, gpuarray.GPUArray], k_cache: gpuarray.GPUArray,
                 v_cache: gpuarray.GPUArray) -> None:
        self.w, self.kc, self.vc = weights, k_cache, v_cache

    # -- the ops ----------------------------------------------------------------------
    def rms_norm(self, weight: str):
        if self.fused:
            return _Normed(weight)
        return self._add_rmsnorm(weight)

    def linear(self, x, weight: str) -> _Linear:
        return _Linear(x, weight)

    def head_rms_norm(self, qkv, q_weight: str, k_weight: str) -> gpuarray.GPUArray:
        c, b = self.c, self._into(qkv, self.b.qkv)
        self.k.head_rmsnorm.prepared_async_call((self.shape.tokens, c.num_heads + c.num_kv_heads), (32, 1, 1), self.st,
                                                _ptr(b), _ptr(self.w[q_weight]), _ptr(self.w[k_weight]),
                                                np.int32(c.num_heads), np.int32(c.num_kv_heads), self.eps)
        return b

    def rope_and_cache(self, qkv) -> gpuarray.GPUArray:
        c, m, b = self.c, self.m, self.b
        if self._fusible(qkv):
            self.be._gemv_call(self.k.gemv_rmsnorm_rope, (c.q_size + 2 * c.kv_size) // 2, c.hidden_size * 2, _ptr(b.qkv),
                               _ptr(b.residual), _ptr(self.w[qkv.x.weight]), self.eps, _ptr(self.w[qkv.weight]),
                               _ptr(self.kc), _ptr(self.vc), m["positions"], m["slots"], _ptr(self.be.cos_sin),
                               np.int32(c.num_heads), np.int32(c.num_kv_heads), np.int32(c.head_dim),
                               np.int32(c.hidden_size))
            return b.qkv
        self._into(qkv, b.qkv)
        threads = rope_and_cache_threads(c.num_heads, c.num_kv_heads, c.head_dim)
        self.k.rope_and_cache.prepared_async_call((self.shape.tokens, 1), (threads, 1, 1), self.st, _ptr(b.qkv),
                                                  _ptr(self.kc), _ptr(self.vc), m["positions"], m["slots"],
                                                  _ptr(self.be.cos_sin), np.int32(c.num_heads),
                                                  np.int32(c.num_kv_heads), np.int32(c.head_dim))
        return b.qkv

    def attention(self, qkv: gpuarray.GPUArray) -> gpuarray.GPUArray:
        self.be._attention(self.k, self.b, self.shape, self.kc, self.vc)
        return self.b.attn

    def silu_and_mul(self, gate_up) -> gpuarray.GPUArray:
        c, b = self.c, self.b
        if self._fusible(gate_up):
            self.be._gemv_call(self.k.gemv_rmsnorm_silu, c.intermediate_size, c.hidden_size * 2, _ptr(b.act),
                               _ptr(b.residual), _ptr(self.w[gate_up.x.weight]), self.eps, _ptr(self.w[gate_up.weight]),
                               np.int32(c.hidden_size))
            return b.act
        self._into(gate_up, b.gate_up)
        inter = c.intermediate_size
        self.k.silu_and_mul.prepared_async_call((-(-inter // (8 * 256)), self.shape.tokens), (256, 1, 1), self.st,
                                                _ptr(b.act), _ptr(b.gate_up), np.int32(inter))
        return b.act

    def add_to_residual(self, x) -> None:
        if self.fused and isinstance(x, _Linear) and not isinstance(x.x, _Normed):
            self.be._gemv_call(self.k.gemv_add, self.c.hidden_size, 0, _ptr(self.b.residual), _ptr(x.x),
                               _ptr(self.w[x.weight]), np.int32(x.x.shape[-1]))
        else:
            self.pending = _ptr(self._into(x, self.b.delta))

    # -- computing lazy values --------------------------------------------------------
    def _fusible(self, value) -> bool:
        """Whether `value` is a GEMV of a norm that the consuming GEMV kernel can compute itself."""
        return self.fused and isinstance(value, _Linear) and isinstance(value.x, _Normed)

    def _add_rmsnorm(self, weight: str) -> gpuarray.GPUArray:
        """h = RMSNorm(residual + pending), the pending delta added into the residual."""
        b = self.b
        self.k.add_rmsnorm.prepared_async_call((self.shape.tokens, 1), (256, 1, 1), self.st, _ptr(b.residual),
                                               self.pending, _ptr(self.w[weight]), _ptr(b.h), self.m["all_rows"],
                                               np.int32(self.c.hidden_size), self.eps)
        self.pending = np.uintp(0)
        return b.h

    def _into(self, value, out: gpuarray.GPUArray) -> gpuarray.GPUArray:
        """`value` computed, into `out` where it is a linear (an array is already computed)."""
        if not isinstance(value, _Linear):
            return value
        x = self._add_rmsnorm(value.x.weight) if isinstance(value.x, _Normed) else value.x
        w = self.w[value.weight]
        self.be._linear(self.k, out, x, w, self.tiles, w.shape[1], w.shape[0])
        return out


class CudaBackend:
    name = "cuda"

    def __init__(self, config: ModelConfig, weights: ModelWeights, device: int = 0, cuda_graphs: bool = True,
                 graph_max_batch: int = 256, graph_max_context: int = 4096, batch_invariant: bool = False):
        if config.head_dim not in (64, 128) or config.num_heads // config.num_kv_heads > 8:
            raise ValueError("the CUDA attention kernels need head_dim 64 or 128 and at most 8 heads per KV head")
        if config.hidden_size % 8 or config.intermediate_size % 8:
            raise ValueError("the CUDA kernels need hidden and intermediate sizes that are multiples of 8")
        self.config = config
        self.architecture = architecture_of(config)
        self.batch_invariant = batch_invariant  # GEMMs in fixed tiles: see step_metadata
        cuda.init()
        self.device = cuda.Device(device)
        self.ctx = self.device.retain_primary_context()
        with self._context():
            major, minor = self.device.compute_capability()
            self.sm_count = self.device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT)
            group = config.num_heads // config.num_kv_heads
            self.kernel_build = (config.head_dim, group, f"sm_{major}{minor}")
            self.kernels = Kernels(*self.kernel_build)
            self.query_rows = prefill_query_rows(group)
            self.stream = cuda.Stream()
            self.pool = DeviceMemoryPool()
            self.workspace = cuda.mem_alloc(WORKSPACE_BYTES)
            self.blas = Cublas(self.stream.handle, int(self.workspace), WORKSPACE_BYTES)
            self._upload_weights(weights)
            # cos and sin of every RoPE angle the model meets (vLLM's cos_sin_cache): a
            # position's row is read by every layer, with nothing to compute
            half = config.head_dim // 2
            self.cos_sin = gpuarray.empty((config.max_position_embeddings, half, 2), np.float32)
            inv_freq = gpuarray.to_gpu(config.rope_inv_freq())
            self.kernels.rope_cos_sin.prepared_async_call((config.max_position_embeddings, 1), (half, 1, 1), self.stream,
                                                          _ptr(self.cos_sin), _ptr(inv_freq), np.int32(half))
            self.stream.synchronize()
        log.info("CUDA backend on %s: %.2f GB of bfloat16 weights", self.device.name(), self.weight_bytes / 1e9)
        self.block_size = 0
        self.dummy_block = 0  # a KV block no sequence owns: padding rows of graphs use it
        self.k_cache: list[gpuarray.GPUArray] = []
        self.v_cache: list[gpuarray.GPUArray] = []
        self._graph_settings = (cuda_graphs, graph_max_batch, graph_max_context)
        self.graphs: DecodeGraphs | None = None
        self._previous_samples: dict[Sequence, int] = {}  # where the last step's tokens sit in `sampled`

    @contextlib.contextmanager
    def _context(self):
        """Make our context current on the calling thread (the engine thread, in serving)."""
        self.ctx.push()
        try:
            yield
        finally:
            cuda.Context.pop()

    def _upload_weights(self, weights: ModelWeights) -> None:
        """Each weight in bfloat16, under the names the model's layer reads (engine/models)."""
        self.weight_bytes = 0

        def up(tensor: Tensor) -> gpuarray.GPUArray:
            bits = tensor.bf16_bits()
            self.weight_bytes += bits.nbytes
            return gpuarray.to_gpu(bits)

        self.embed = up(weights.embed)
        self.lm_head = self.embed if weights.lm_head is weights.embed else up(weights.lm_head)
        self.final_norm = up(weights.final_norm)
        self.layers = [{name: up(tensor) for name, tensor in layer.items()} for layer in weights.layers]

    # -- the KV cache -------------------------------------------------------------
    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        return 2 * c.num_layers * block_size * c.kv_size * 2

    def blocks_for_memory_fraction(self, fraction: float, block_size: int) -> int:
        """KV blocks that fit while the process stays under `fraction` of the GPU's memory."""
        with self._context():
            free, total = cuda.mem_get_info()
        budget = free - (1.0 - fraction) * total - ACTIVATION_RESERVE_BYTES
        return max(0, int(budget // self.kv_cache_bytes_per_block(block_size)))

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_batch: int) -> None:
        """The cache, and the CUDA graphs for decode steps of up to `max_batch` sequences."""
        if PARTITION // block_size + 2 > MAX_PART_BLOCKS:
            raise ValueError(f"block size {block_size} is too small for the attention kernel: use at least "
                             f"{-(-PARTITION // (MAX_PART_BLOCKS - 2))}")
        c = self.config
        shape = ((num_blocks + 1) * block_size, c.num_kv_heads, c.head_dim)  # + the dummy block
        with self._context():
            self.k_cache = [gpuarray.empty(shape, np.uint16) for _ in range(c.num_layers)]
            self.v_cache = [gpuarray.empty(shape, np.uint16) for _ in range(c.num_layers)]
            # A step samples at most one token per sequence, and each holds a block. The
            # device buffer stays put (graphs read it). Two steps may be in flight: each
            # takes the other's host buffer and end event, so that a step's copy never
            # lands on tokens not read yet, and waiting for a step waits for it alone.
            self.sampled = gpuarray.empty(num_blocks, np.int32)
            # The decode attention kernel's arrival counts (attention.cu), zero between
            # launches: a row per token of a small decode step (is_small_decode).
            self.arrivals = gpuarray.zeros((SMALL_DECODE, c.num_kv_heads), np.int32)
            self._step_slots = [(cuda.pagelocked_empty(num_blocks, np.int32), cuda.Event()) for _ in range(2)]
        self.block_size, self.dummy_block = block_size, num_blocks
        log.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GB)", num_blocks, block_size,
                 num_blocks * block_size, num_blocks * self.kv_cache_bytes_per_block(block_size) / 1e9)
        enabled, graph_max_batch, max_context = self._graph_settings
        if enabled:
            with self._context():  # (compiles the kernels' build for graphs and captures them)
                self.graphs = DecodeGraphs(self, min(graph_max_batch, max_batch), max_context)

    def is_fatal(self, error: BaseException) -> bool:
        """A driver or cuBLAS error may leave the context unusable: stop serving."""
        return isinstance(error, (cuda.Error, CublasError))

    # -- one step -----------------------------------------------------------------
    def _empty(self, shape, dtype) -> gpuarray.GPUArray:
        return gpuarray.empty(shape, dtype, allocator=self.pool.allocate)

    def _upload(self, values, dtype) -> gpuarray.GPUArray:
        """A small host array to the device, queued on the stream, from the pool."""
        return gpuarray.to_gpu_async(np.asarray(values, dtype=dtype), allocator=self.pool.allocate, stream=self.stream)

    def _metadata(self, batch: list[ScheduledSeq], shape: StepShape) -> np.ndarray:
        return build_metadata(batch, shape, self.block_size, self.dummy_block, self.query_rows, self._previous_samples)

    def _launch(self, b: StepBuffers, shape: StepShape, k: Kernels) -> None:
        """Queue the whole forward pass for `shape` on the stream (no allocation, no sync):
        each layer is the architecture's (engine/models), queued by _LayerLaunches."""
        c, st, m = self.config, self.stream, b.meta_ptr
        T, S, H = shape.tokens, shape.samples, c.hidden_size
        k.embedding_gather.prepared_async_call((T, 1), (256, 1, 1), st, _ptr(b.residual), _ptr(self.embed), m["ids"],
                                               _ptr(self.sampled), np.int32(H))
        ops = _LayerLaunches(self, k, b, shape, fused=self._all_gemv(shape))
        for layer, kc, vc in zip(self.layers, self.k_cache, self.v_cache):
            ops.at_layer(layer, kc, vc)
            self.architecture.layer(ops)
        if S:
            k.add_rmsnorm.prepared_async_call((S, 1), (256, 1, 1), st, _ptr(b.residual), ops.pending, _ptr(self.final_norm),
                                              _ptr(b.final), m["sample_rows"], np.int32(H), np.float32(c.rms_norm_eps))
            self._linear(k, b.logits, b.final, self.lm_head, shape.head_tiles(), H, c.vocab_size)

    def _all_gemv(self, shape: StepShape) -> bool:
        """Whether every GEMM of the step is our GEMV (a step of one row), whose
        normalised input fits its shared memory: then norms, RoPE, SiLU and residual adds
        ride in the GEMVs where the layer's ops allow (gemv.cu, _LayerLaunches)."""
        return not shape.invariant and shape.rows == 1 and 2 * self.config.hidden_size <= STAGED_INPUT_BYTES

    def _gemv_call(self, fn, d_out: int, staged_bytes: int, *args) -> None:
        """Launch a gemv.cu kernel over d_out outputs, as many blocks as are resident at
        once (each group of warps loops over rows); `args` end with d_in."""
        rows_per_block = GEMV_WARPS // gemv_split(int(args[-1]))
        blocks = min(-(-d_out // rows_per_block), self.sm_count * blocks_per_sm(fn, 32 * GEMV_WARPS))
        fn.prepared_async_call((blocks, 1), (32 * GEMV_WARPS, 1, 1), self.stream, *args, np.int32(d_out),
                               shared_size=staged_bytes)

    def _attention(self, k: Kernels, b: StepBuffers, shape: StepShape, kc: gpuarray.GPUArray, vc: gpuarray.GPUArray) -> None:
        """Partial results per context partition, for decode rows (and the padding between
        the segments) from the decode kernel and for prompt rows from the prefill kernel,
        then the merge kernel over all rows; in a small decode step the decode kernel
        merges them itself (see step_metadata.is_small_decode)."""
        c, st, m = self.config, self.stream, b.meta_ptr
        grid = (c.num_kv_heads, shape.partitions)
        partials = (_ptr(b.part_acc), _ptr(b.part_max), _ptr(b.part_sum), _ptr(b.qkv), _ptr(kc), _ptr(vc),
                    m["tables"], np.int32(shape.max_blocks), m["token_seq"], m["positions"])
        sizes = (np.int32(c.num_heads), np.int32(c.num_kv_heads), np.int32(self.block_size), np.int32(shape.partition),
                 np.float32(c.head_dim ** -0.5))
        decode_rows = shape.tokens - shape.prompt
        if decode_rows:
            arrivals = _ptr(self.arrivals) if shape.small_decode else np.uintp(0)
            k.paged_attention_partial.prepared_async_call((decode_rows, *grid), (ATTENTION_THREADS, 1, 1), st, _ptr(b.attn),
                                                          arrivals, *partials, *sizes)
        if shape.prompt_tiles:
            k.prefill_attention_partial.prepared_async_call((shape.prompt_tiles, *grid), (PREFILL_THREADS, 1, 1), st,
                                                            *partials, m["prompt_tiles"], *sizes)
        if not shape.small_decode:
            k.paged_attention_merge.prepared_async_call((shape.tokens, c.num_heads), (c.head_dim, 1, 1), st, _ptr(b.attn),
                                                        _ptr(b.part_acc), _ptr(b.part_max), _ptr(b.part_sum), m["positions"],
                                                        np.int32(shape.partition), np.int32(shape.partitions))

    def _forward(self, batch: list[ScheduledSeq]) -> gpuarray.GPUArray:
        """Run the step's tokens; return float32 logits [sampling sequences, vocab] on the GPU."""
        graph = self.graphs.for_batch(batch) if self.graphs else None
        if graph is not None:
            shape, buffers, replay = graph
            buffers.meta.set_async(self._metadata(batch, shape), stream=self.stream)
            replay.launch()
            return buffers.logits[: len(batch)]
        shape = step_shape(batch, self.query_rows, self.batch_invariant)
        buffers = StepBuffers(self.config, shape, self._empty)
        buffers.meta.set_async(self._metadata(batch, shape), stream=self.stream)
        self._launch(buffers, shape, self.kernels)
        # (buffers go back to the pool when dropped: later work on this one stream is
        # ordered after the kernels that use them)
        return buffers.logits[: shape.samples]

    def _linear(self, k: Kernels, y: gpuarray.GPUArray, x: gpuarray.GPUArray, w: gpuarray.GPUArray,
                tiles: list[tuple[int, int]], d_in: int, d_out: int) -> None:
        """y = x @ w^T, one GEMM per (first row, rows) tile (see step_metadata): our GEMV
        for a tile of one row (only ever a whole step's row: batch-invariant tiles are
        larger), cuBLAS otherwise."""
        out_f32 = y.dtype == np.float32
        y_row, x_row = d_out * y.dtype.itemsize, d_in * 2
        for r, rows in tiles:
            y_ptr, x_ptr = int(y.gpudata) + r * y_row, int(x.gpudata) + r * x_row
            if rows == 1:  # (d_in is a multiple of 8, as gemv.cu needs: see __init__)
                self.gemv(y_ptr, x_ptr, w, d_in, d_out, out_f32, k)
            else:
                self.blas.linear(y_ptr, x_ptr, int(w.gpudata), rows, d_in, d_out, out_f32)

    def gemv(self, y: int, x: int, w: gpuarray.GPUArray, d_in: int, d_out: int, out_f32: bool,
             kernels: Kernels | None = None) -> None:
        """y = x @ w^T for one row x by gemv.cu (by the plain build unless told)."""
        self._gemv_call((kernels or self.kernels).gemv, d_out, 0, np.uintp(y), np.int32(out_f32), np.uintp(x), _ptr(w),
                        np.int32(d_in))

    def forward(self, batch: list[ScheduledSeq]) -> np.ndarray:
        """Logits of the sampling sequences, on the host (for tests and logprobs)."""
        with self._context():
            logits = self._forward(batch).get(stream=self.stream)
            self.stream.synchronize()
        return logits

    def execute(self, batch: list[ScheduledSeq]) -> list[SampleOutput | None]:
        return self.launch(batch)()

    def launch(self, batch: list[ScheduledSeq]) -> Callable[[], list[SampleOutput | None]]:
        """Queue the step (forward pass, sampling, the copy of the chosen tokens to the
        host) and return at once; the returned function waits for its samples. pending
        tokens of the batch are read from the previous step's samples on the device."""
        sampling = [s.seq for s in batch if s.samples]
        self._step_slots.reverse()
        tokens_host, done = self._step_slots[0]
        with self._context():
            collect = self._sample(self._forward(batch), sampling, tokens_host) if sampling else list
            done.record(self.stream)
        self._previous_samples = {seq: i for i, seq in enumerate(sampling)}

        def wait() -> list[SampleOutput | None]:
            with self._context():
                done.synchronize()  # (without the GIL: the server's threads run meanwhile)
                outputs = iter(collect())
            return [next(outputs) if s.samples else None for s in batch]
        return wait

    # -- sampling -------------------------------------------------------------------
    def _sample(self, logits: gpuarray.GPUArray, seqs, tokens_host: np.ndarray) -> Callable[[], list[SampleOutput]]:
        """Queue sampling into `sampled` and the copy of the tokens to `tokens_host`;
        return what reads them once the stream has got that far."""
        st, S, V = self.stream, len(seqs), self.config.vocab_size
        raw = {}
        wants = [i for i, q in enumerate(seqs) if q.params.top_logprobs is not None]
        if wants:  # logprobs describe the raw distribution: read those rows before penalties
            host = logits.get(stream=st)
            st.synchronize()
            raw = {i: log_softmax(host[i].astype(np.float64)) for i in wants}
        self._apply_penalties(logits, seqs)
        p = [q.params for q in seqs]
        fields = np.stack([  # one upload: the kernel's seven per-request arrays, row by row
            np.array([x.temperature for x in p], np.float32).view(np.int32),
            np.array([x.top_p for x in p], np.float32).view(np.int32),
            np.array([x.top_k for x in p], np.int32),
            np.array([x.min_p for x in p], np.float32).view(np.int32),
            np.array([q.seed & 0xFFFFFFFF for q in seqs], np.uint32).view(np.int32),
            np.array([(q.seed >> 32) & 0xFFFFFFFF for q in seqs], np.uint32).view(np.int32),
            np.array([q.num_generated for q in seqs], np.int32),
        ])
        uploaded = self._upload(fields, np.int32)
        args = [np.uintp(int(uploaded.gpudata) + 4 * S * i) for i in range(len(fields))]
        self.kernels.sample_tokens.prepared_async_call((SAMPLE_CLUSTER, S), (SAMPLE_THREADS, 1, 1), st, _ptr(self.sampled),
                                                       _ptr(logits), np.int32(V), *args)
        tokens = tokens_host[:S]
        cuda.memcpy_dtoh_async(tokens, self.sampled.gpudata, st)

        def collect() -> list[SampleOutput]:
            results = []
            for i, (q, t) in enumerate(zip(seqs, tokens.tolist())):
                lp = None
                if i in raw:
                    n = q.params.top_logprobs
                    top = np.argsort(-raw[i], kind="stable")[:n]
                    lp = TokenLogprob(t, float(raw[i][t]), [(int(j), float(raw[i][j])) for j in top])
                results.append(SampleOutput(t, lp))
            return results
        return collect

    def _apply_penalties(self, logits: gpuarray.GPUArray, seqs) -> None:
        rows, toks, counts, banned = [], [], [], []
        for i, q in enumerate(seqs):
            pp = q.params
            ban = set(q.banned_token_ids())  # one entry per token: two would race
            if pp.has_penalties:
                seen = np.unique(np.asarray(q.prompt_ids + q.output_ids))
                out_ids, out_counts = np.unique(np.asarray(q.output_ids, dtype=np.int64), return_counts=True)
                count = dict(zip(out_ids.tolist(), out_counts.tolist()))
                for t in seen.tolist():
                    if t not in ban:
                        rows.append(i); toks.append(t); counts.append(count.get(t, 0)); banned.append(0)
            for t in ban:
                rows.append(i); toks.append(t); counts.append(0); banned.append(1)
        if not rows:
            return
        st = self.stream
        arrays = [self._upload(rows, np.int32), self._upload(toks, np.int32), self._upload(counts, np.int32), self._upload(banned, np.int32),
                  self._upload([q.params.repetition_penalty for q in seqs], np.float32),
                  self._upload([q.params.presence_penalty for q in seqs], np.float32),
                  self._upload([q.params.frequency_penalty for q in seqs], np.float32)]
        n = len(rows)
        self.kernels.apply_penalties.prepared_async_call(((n + 255) // 256, 1), (256, 1, 1), st, _ptr(logits),
                                                         np.int32(self.config.vocab_size), np.int32(n),
                                                         *[_ptr(a) for a in arrays])

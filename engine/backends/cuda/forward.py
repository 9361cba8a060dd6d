"""One step's forward pass, queued on the stream: the embedding gather, each layer as
its architecture spells it (engine/models) with the ops launched as our kernels
(LayerLaunches), the final norm of the rows that sample, and the head.

The residual stream is float32 holding bfloat16 values, as transformers' bfloat16
hidden states are; every other activation is bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pycuda.gpuarray as gpuarray

from engine.backends.cuda.buffers import KvCache, StepBuffers
from engine.backends.cuda.kernels import STAGED_INPUT_BYTES, Kernels, PagedAttention, ptr
from engine.backends.cuda.linear import Linear, LinearWeight
from engine.backends.cuda.step_metadata import StepShape
from engine.backends.cuda.weights import DeviceWeights
from engine.config import ModelConfig
from engine.models import architecture_of
from engine.quantization.kv_cache import KvScale


class ForwardPass:
    """Queues a step's forward pass (no allocation, no sync, so that graphs capture it).
    `sampled` holds the previous step's tokens on the device; `arrivals` the decode
    attention kernel's counters, zero between launches (attention.cu)."""

    def __init__(self, config: ModelConfig, weights: DeviceWeights, cache: KvCache, linear: Linear,
                 cos_sin: gpuarray.GPUArray, sampled: gpuarray.GPUArray, arrivals: gpuarray.GPUArray, stream):
        self.config, self.architecture = config, architecture_of(config)
        self.weights, self.cache, self.linear = weights, cache, linear
        self.cos_sin, self.sampled, self.arrivals, self.stream = cos_sin, sampled, arrivals, stream

    def queue(self, b: StepBuffers, shape: StepShape, k: Kernels) -> None:
        c, st, m, w = self.config, self.stream, b.meta_ptr, self.weights
        k.embedding_gather(st, b.residual, w.embed, m["ids"], self.sampled, shape.tokens, c.hidden_size)
        ops = LayerLaunches(self, k, b, shape, fused=self._all_gemv(shape))
        for layer, k_cache, v_cache, kv_scale in zip(w.layers, self.cache.k, self.cache.v, self.cache.scales):
            ops.at_layer(layer, k_cache, v_cache, kv_scale)
            self.architecture.layer(ops)
        if shape.samples:
            k.add_rmsnorm(st, b.residual, ops.pending, w.final_norm, b.final, m["sample_rows"], shape.samples,
                          c.hidden_size, c.rms_norm_eps)
            self.linear(k, b.logits, b.final, w.lm_head, shape.head_tiles())

    def _all_gemv(self, shape: StepShape) -> bool:
        """Whether every GEMM of the step is our GEMV (a step of one row), whose
        normalised input fits its shared memory: then norms, RoPE, SiLU and residual adds
        ride in the GEMVs where the layer's ops allow (gemv.cu, LayerLaunches)."""
        return not shape.invariant and shape.rows == 1 and 2 * self.config.hidden_size <= STAGED_INPUT_BYTES


@dataclass(frozen=True)
class _Normed:
    """The residual stream's RMSNorm with `weight`, not yet computed (fused into a GEMV if it can be)."""

    weight: str


@dataclass(frozen=True)
class _Linear:
    """x @ weight^T, not yet computed: where it lands, and what rides with it, is up to its consumer."""

    x: "_Normed | gpuarray.GPUArray"
    weight: str


class LayerLaunches:
    """The LayerOps of engine/models, each queued as our kernels for one step.

    Values between ops are StepBuffers' arrays, or the lazy _Normed and _Linear, which
    their consumer computes into the buffer it needs. That is where the single-token
    fusions (`fused`, a step of one row: gemv.cu) come in: rms_norm -> linear ->
    rope_and_cache is one gemv_rmsnorm_rope, rms_norm -> linear -> silu_and_mul one
    gemv_rmsnorm_silu, and linear -> add_to_residual one gemv_add, each in the weight's
    format (bfloat16, FP8 or INT4). Otherwise an add to the residual is left pending and rides
    in the next add_rmsnorm."""

    def __init__(self, forward: ForwardPass, kernels: Kernels, buffers: StepBuffers, shape: StepShape, fused: bool):
        self.fwd, self.k, self.b, self.shape, self.fused = forward, kernels, buffers, shape, fused
        c = forward.config
        self.c, self.st, self.m, self.eps = c, forward.stream, buffers.meta_ptr, c.rms_norm_eps
        self.tiles = shape.gemm_tiles()
        self.pending = None  # a delta not yet added into the residual
        m, b = self.m, buffers
        self.attention_inputs = PagedAttention(
            b.part_acc, b.part_max, b.part_sum, b.qkv, m["tables"], shape.max_blocks, m["token_seq"], m["positions"],
            c.num_heads, c.num_kv_heads, forward.cache.block_size, shape.partition, shape.partitions, c.head_dim ** -0.5)

    def at_layer(self, weights: dict[str, LinearWeight | gpuarray.GPUArray], k_cache: gpuarray.GPUArray,
                 v_cache: gpuarray.GPUArray, kv_scale: KvScale) -> None:
        self.w, self.kc, self.vc, self.kv_scale = weights, k_cache, v_cache, kv_scale

    # -- the ops ----------------------------------------------------------------------
    def rms_norm(self, weight: str):
        return _Normed(weight) if self.fused else self._add_rmsnorm(weight)

    def linear(self, x, weight: str) -> _Linear:
        return _Linear(x, weight)

    def head_rms_norm(self, qkv, q_weight: str, k_weight: str) -> gpuarray.GPUArray:
        c, out = self.c, self._into(qkv, self.b.qkv)
        self.k.head_rmsnorm(self.st, out, self.w[q_weight], self.w[k_weight], self.shape.tokens, c.num_heads,
                            c.num_kv_heads, self.eps)
        return out

    def rope_and_cache(self, qkv) -> gpuarray.GPUArray:
        c, m, b = self.c, self.m, self.b
        if self._fusible(qkv):
            self.k.gemv_rmsnorm_rope(self.st, b.qkv, b.residual, self.w[qkv.x.weight], self.eps, self.w[qkv.weight],
                                     self.kc, self.vc, m["positions"], m["slots"], self.fwd.cos_sin, c.num_heads,
                                     c.num_kv_heads, self.fwd.cache.block_shift, c.hidden_size, kv_scale=self.kv_scale)
            return b.qkv
        self._into(qkv, b.qkv)
        self.k.rope_and_cache(self.st, b.qkv, self.kc, self.vc, m["positions"], m["slots"], self.fwd.cos_sin,
                              self.shape.tokens, c.num_heads, c.num_kv_heads, self.fwd.cache.block_shift, self.kv_scale)
        return b.qkv

    def attention(self, qkv: gpuarray.GPUArray) -> gpuarray.GPUArray:
        """Partial results per context partition, for decode rows (and the padding between
        the segments) from the decode kernel and for prompt rows from the prefill kernel,
        then the merge kernel over those rows; in a small decode step the decode kernel
        merges them itself (step_metadata.is_small_decode), and a whole-context prompt's
        rows get their output from the prefill kernel (step_metadata.is_whole_context_prompt)."""
        k, st, shape, a, b, kv_scale = self.k, self.st, self.shape, self.attention_inputs, self.b, self.kv_scale
        decode_rows = shape.tokens - shape.prompt
        if decode_rows:
            arrivals = self.fwd.arrivals if shape.small_decode else None
            k.paged_attention_partial(st, b.attn, arrivals, a, self.kc, self.vc, decode_rows,
                                      prefetch=shape.decode_prefetch, kv_scale=kv_scale)
        if shape.prompt_tiles:
            out = b.attn if shape.whole_context_prompt else None
            k.prefill_attention_partial(st, out, a, self.kc, self.vc, self.m["prompt_tiles"], shape.prompt_tiles,
                                        kv_scale)
        if not shape.small_decode and shape.partial_rows:
            k.paged_attention_merge(st, b.attn, a, shape.partial_rows, kv_scale)
        return b.attn

    def silu_and_mul(self, gate_up) -> gpuarray.GPUArray:
        c, b = self.c, self.b
        if self._fusible(gate_up):
            self.k.gemv_rmsnorm_silu(self.st, b.act, b.residual, self.w[gate_up.x.weight], self.eps,
                                     self.w[gate_up.weight], c.hidden_size, c.intermediate_size)
            return b.act
        self._into(gate_up, b.gate_up)
        self.k.silu_and_mul(self.st, b.act, b.gate_up, self.shape.tokens, c.intermediate_size)
        return b.act

    def add_to_residual(self, x) -> None:
        if self.fused and isinstance(x, _Linear) and not isinstance(x.x, _Normed):
            w = self.w[x.weight]
            self.k.gemv_add(self.st, self.b.residual, x.x, w, w.d_in, w.d_out)
        else:
            self.pending = ptr(self._into(x, self.b.delta))

    # -- computing lazy values --------------------------------------------------------
    def _fusible(self, value) -> bool:
        """Whether `value` is a GEMV of a norm that the consuming GEMV kernel can compute itself."""
        return self.fused and isinstance(value, _Linear) and isinstance(value.x, _Normed)

    def _add_rmsnorm(self, weight: str) -> gpuarray.GPUArray:
        """h = RMSNorm(residual + pending), the pending delta added into the residual."""
        b = self.b
        self.k.add_rmsnorm(self.st, b.residual, self.pending, self.w[weight], b.h, self.m["all_rows"], self.shape.tokens,
                           self.c.hidden_size, self.eps)
        self.pending = None
        return b.h

    def _into(self, value, out: gpuarray.GPUArray) -> gpuarray.GPUArray:
        """`value` computed, into `out` where it is a linear (an array is already computed)."""
        if not isinstance(value, _Linear):
            return value
        x = self._add_rmsnorm(value.x.weight) if isinstance(value.x, _Normed) else value.x
        self.fwd.linear(self.k, out, x, self.w[value.weight], self.tiles)
        return out

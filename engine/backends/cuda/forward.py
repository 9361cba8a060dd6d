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
from engine.backends.cuda.kernels import ROW_STASH_BYTES, STAGED_INPUT_BYTES, Kernels, PagedAttention, SumScales
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
            delta, delta_scales = ops.take_pending()
            k.add_rmsnorm(st, b.residual, delta, w.final_norm, b.final, m["sample_rows"], shape.samples,
                          c.hidden_size, c.rms_norm_eps, delta_scales)
            self.linear(k, b.logits, b.final, w.lm_head, shape.head_tiles())

    def _all_gemv(self, shape: StepShape) -> bool:
        """Whether every GEMM of the step is our GEMV (a step of one row), whose
        normalised input fits its shared memory: then norms, RoPE, SiLU and residual adds
        ride in the GEMVs where the layer's ops allow (gemv.cu, LayerLaunches)."""
        return not shape.invariant and shape.rows == 1 and 2 * self.config.hidden_size <= STAGED_INPUT_BYTES


@dataclass(frozen=True)
class _Normed:
    """The residual stream's RMSNorm with `weight` (and the pending delta added), not yet
    computed: its consumer computes it, in a GEMV or as a W8A8 product's codes if it can."""

    weight: str


@dataclass(frozen=True)
class _Sums:
    """A W8A8 product's output with its sums not yet scaled back (fp8_activations.cu):
    the kernel that reads it next does that, by `scales`."""

    y: gpuarray.GPUArray
    scales: SumScales


@dataclass(frozen=True)
class _Activated:
    """SiLU(gate) * up of the gate/up projection, not yet computed: a W8A8 product that
    reads it has it computed straight into e4m3 codes."""

    gate_up: "gpuarray.GPUArray | _Sums"


@dataclass(frozen=True)
class _Linear:
    """x @ weight^T, not yet computed: where it lands, and what rides with it, is up to its consumer."""

    x: "_Normed | _Activated | gpuarray.GPUArray"
    weight: str


class LayerLaunches:
    """The LayerOps of engine/models, each queued as our kernels for one step.

    Values between ops are StepBuffers' arrays, or the lazy _Normed and _Linear, which
    their consumer computes into the buffer it needs. That is where the single-token
    fusions (`fused`, a step of one row: gemv.cu) come in: rms_norm -> linear ->
    rope_and_cache is one gemv_rmsnorm_rope, rms_norm -> linear -> silu_and_mul one
    gemv_rmsnorm_silu, and linear -> add_to_residual one gemv_add, each in the weight's
    format (bfloat16, FP8 or INT4). Otherwise an add to the residual is left pending and rides
    in the next add_rmsnorm.

    Where a linear is one W8A8 product (Linear.w8a8_plan: FP8-dynamic weights, a step of
    many rows), its two ends ride in the kernels around it too: the norm or SiLU before it
    writes e4m3 codes a row with their scale (the attention's output alone takes
    quantize_rows_e4m3), and RoPE, SiLU or the next norm's residual add scales its sums
    back (_Sums). Codes take the place of the bfloat16 input they stand for: a norm's in
    h, the others in act (free from the down projection to the next SiLU, and 2 x
    intermediate_size bytes a row), or in gate_up where quantize_rows_e4m3 reads act
    itself (nothing reads gate_up again before the next gate/up product writes it). The
    row scales alternate between row_scales and other_row_scales, each read by the
    kernel after the product that wrote the other."""

    def __init__(self, forward: ForwardPass, kernels: Kernels, buffers: StepBuffers, shape: StepShape, fused: bool):
        self.fwd, self.k, self.b, self.shape, self.fused = forward, kernels, buffers, shape, fused
        c = forward.config
        self.c, self.st, self.m, self.eps = c, forward.stream, buffers.meta_ptr, c.rms_norm_eps
        self.tiles = shape.gemm_tiles()
        self.pending = None  # a delta not yet added into the residual (an array, or _Sums)
        self.row_scales = (buffers.row_scales, buffers.other_row_scales)  # the first for the next codes' scales
        m, b = self.m, buffers
        self.attention_inputs = PagedAttention(
            b.part_acc, b.part_max, b.part_sum, b.qkv, m["tables"], shape.max_blocks, m["token_seq"], m["positions"],
            c.num_heads, c.num_kv_heads, forward.cache.block_size, shape.partition, shape.partitions, c.head_dim ** -0.5)

    def at_layer(self, weights: dict[str, LinearWeight | gpuarray.GPUArray], k_cache: gpuarray.GPUArray,
                 v_cache: gpuarray.GPUArray, kv_scale: KvScale) -> None:
        self.w, self.kc, self.vc, self.kv_scale = weights, k_cache, v_cache, kv_scale

    # -- the ops ----------------------------------------------------------------------
    def rms_norm(self, weight: str) -> _Normed:
        return _Normed(weight)

    def linear(self, x, weight: str) -> _Linear:
        return _Linear(x, weight)

    def head_rms_norm(self, qkv, q_weight: str, k_weight: str) -> gpuarray.GPUArray:
        c, out = self.c, self._plain(self._product(qkv, self.b.qkv))
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
        qkv = self._product(qkv, b.qkv)
        self.k.rope_and_cache(self.st, b.qkv, self.kc, self.vc, m["positions"], m["slots"], self.fwd.cos_sin,
                              self.shape.tokens, c.num_heads, c.num_kv_heads, self.fwd.cache.block_shift, self.kv_scale,
                              qkv.scales if isinstance(qkv, _Sums) else None)
        return b.qkv

    def attention(self, qkv: gpuarray.GPUArray) -> gpuarray.GPUArray:
        """Partial results per context partition, for decode rows (and the padding between
        the segments) from the decode kernel and for prompt rows from the prefill kernel,
        then the merge kernel over those rows (StepShape.merge). A decode row whose context
        fits one partition gets its output from the decode kernel, in a step of decode
        rows alone the decode kernel merges the others itself (StepShape.decode_merges),
        and a whole-context prompt's rows get theirs from the prefill kernel
        (StepShape.whole_context_prompt)."""
        k, st, shape, a, b, kv_scale = self.k, self.st, self.shape, self.attention_inputs, self.b, self.kv_scale
        decode_rows = shape.tokens - shape.prompt
        if decode_rows:
            arrivals = self.fwd.arrivals if shape.decode_merges else None
            k.paged_attention_partial(st, b.attn, arrivals, a, self.kc, self.vc, decode_rows,
                                      prefetch=shape.decode_prefetch, kv_scale=kv_scale)
        if shape.prompt_tiles:
            out = b.attn if shape.whole_context_prompt else None
            k.prefill_attention_partial(st, out, a, self.kc, self.vc, self.m["prompt_tiles"], shape.prompt_tiles,
                                        kv_scale)
        if shape.merge:
            k.paged_attention_merge(st, b.attn, a, shape.partial_rows, decode_rows, kv_scale)
        return b.attn

    def silu_and_mul(self, gate_up) -> gpuarray.GPUArray:
        c, b = self.c, self.b
        if self._fusible(gate_up):
            self.k.gemv_rmsnorm_silu(self.st, b.act, b.residual, self.w[gate_up.x.weight], self.eps,
                                     self.w[gate_up.weight], c.hidden_size, c.intermediate_size)
            return b.act
        return _Activated(self._product(gate_up, b.gate_up))

    def add_to_residual(self, x) -> None:
        if self.fused and isinstance(x, _Linear) and not isinstance(x.x, _Normed):
            w = self.w[x.weight]
            self.k.gemv_add(self.st, self.b.residual, self._plain(x.x), w, w.d_in, w.d_out)
        else:
            self.pending = self._product(x, self.b.delta)

    def take_pending(self) -> tuple[gpuarray.GPUArray | None, SumScales | None]:
        """The delta not yet added into the residual, and its scales if a W8A8 product's sums; none left pending."""
        pending, self.pending = self.pending, None
        return (pending.y, pending.scales) if isinstance(pending, _Sums) else (pending, None)

    # -- computing lazy values --------------------------------------------------------
    def _fusible(self, value) -> bool:
        """Whether `value` is a GEMV of a norm that the consuming GEMV kernel can compute itself."""
        return self.fused and isinstance(value, _Linear) and isinstance(value.x, _Normed)

    def _add_rmsnorm(self, weight: str, out_scales: gpuarray.GPUArray | None = None) -> gpuarray.GPUArray:
        """h = RMSNorm(residual + pending), the pending delta added into the residual; as
        e4m3 codes with their scales in `out_scales` where given."""
        b = self.b
        delta, delta_scales = self.take_pending()
        self.k.add_rmsnorm(self.st, b.residual, delta, self.w[weight], b.h, self.m["all_rows"], self.shape.tokens,
                           self.c.hidden_size, self.eps, delta_scales, out_scales)
        return b.h

    def _product(self, value, out: gpuarray.GPUArray) -> "gpuarray.GPUArray | _Sums":
        """`value` computed, into `out` where it is a linear: as _Sums where that is one
        W8A8 product (its input quantized by the kernel that computes it: _codes)."""
        if not isinstance(value, _Linear):
            return value
        w = self.w[value.weight]
        plan = self.fwd.linear.w8a8_plan(self.k, w, self.tiles)
        if plan is None:
            self.fwd.linear(self.k, out, self._plain(value.x), w, self.tiles)
            return out
        codes, scales = self._codes(value.x)
        self.fwd.linear.w8a8_codes(plan, out, codes, w)
        return _Sums(out, SumScales(scales, w.scale))

    def _plain(self, value) -> gpuarray.GPUArray:
        """A linear's input, or a value its consumer cannot scale itself, as bfloat16."""
        c, st, tokens = self.c, self.st, self.shape.tokens
        if isinstance(value, _Normed):
            return self._add_rmsnorm(value.weight)
        if isinstance(value, _Activated):
            self.k.silu_and_mul(st, self.b.act, self._plain(value.gate_up), tokens, c.intermediate_size)
            return self.b.act
        if isinstance(value, _Sums):
            self.k.scale_rows_and_cols(st, value.y, value.scales.rows, value.scales.cols, tokens, value.y.shape[1])
            return value.y
        return value

    def _codes(self, x) -> tuple[gpuarray.GPUArray, gpuarray.GPUArray]:
        """x as a W8A8 product's input: e4m3 codes a row, and the rows' scales."""
        c, st, tokens, b = self.c, self.st, self.shape.tokens, self.b
        scales, other = self.row_scales
        self.row_scales = other, scales
        # (the fused kernels hold a row in shared memory: wider rows are quantized on their own)
        if isinstance(x, _Normed) and 2 * c.hidden_size <= ROW_STASH_BYTES:
            return self._add_rmsnorm(x.weight, scales), scales
        if isinstance(x, _Activated) and 2 * c.intermediate_size <= ROW_STASH_BYTES:
            gate_up = x.gate_up
            sum_scales = gate_up.scales if isinstance(gate_up, _Sums) else None
            self.k.silu_and_mul_e4m3(st, b.act, scales, gate_up.y if sum_scales else gate_up, tokens,
                                     c.intermediate_size, sum_scales)
            return b.act, scales
        x = self._plain(x)
        codes = b.gate_up if x is b.act else b.act  # (not over the rows it reads)
        self.k.quantize_rows_e4m3(st, codes, scales, x, tokens, x.shape[1])
        return codes, scales

"""The CPU backend: the numpy backend's step (its scheduling, sampling and paged cache
bookkeeping) with each op of a layer run by a compiled kernel of cpu_src/, and the
weights kept in their stored format (weights.py) rather than widened to float32.

A step runs on `threads` cores, the calling thread among them. The paged KV cache is
as on the numpy backend (float32, or e4m3 codes with --kv-cache-dtype fp8), so
attention is computed as exactly as there. Ops
pass Buffers (float32 arrays with their addresses), a step's own, reused by each layer
and by the next step of as many tokens: a layer's ops then cost a C call each.
"""

from __future__ import annotations

import os

import numpy as np
from gguf import dequantize

from engine.backends.base import CPU_ACTIVATIONS
from engine.backends.cpu.kernels import CpuKernels, addr
from engine.backends.cpu.weights import CpuLinear, PackedCall, QuantizedRows, repack
from engine.backends.numpy_backend import NumpyBackend, _StepOps, head_rms_norm
from engine.config import ModelConfig
from engine.quantization.gguf import GgufWeight
from engine.scheduler import ScheduledSeq
from engine.weights import ModelWeights, Tensor, bf16_bits_to_f32


def available_cores() -> int:
    """The cores this process may run on (its affinity, as a container's CPU set limits it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def embedding_rows(table: GgufWeight | Tensor, ids: np.ndarray) -> np.ndarray:
    """The embedding's rows `ids` in float32, dequantizing only those rows."""
    if isinstance(table, GgufWeight):
        return np.asarray(dequantize(table.blocks[ids], table.kind), np.float32).reshape(len(ids), -1)
    return bf16_bits_to_f32(table.data[ids]) if table.format == "bf16" else table.data[ids]


def row_readable(table) -> GgufWeight | Tensor:
    """The embedding as embedding_rows reads it: GGUF blocks, bfloat16 or float32 as they
    are, any other format (an FP8 one) widened to float32 once, at load."""
    if isinstance(table, GgufWeight) or (isinstance(table, Tensor) and table.format in ("bf16", "f32")):
        return table
    return Tensor.of(table.float32())


class Buffer:
    """A float32 array and its address."""

    __slots__ = ("array", "ptr")

    def __init__(self, array: np.ndarray):
        self.array = np.ascontiguousarray(array, np.float32)
        self.ptr = addr(self.array)


class _Scratch:
    """One step's buffers, by the value they hold, for steps of `tokens` tokens."""

    def __init__(self, tokens: int, columns: int):
        self.tokens = tokens
        self.quantized = QuantizedRows(tokens, columns)
        self._buffers: dict[str, Buffer] = {}
        self._products: dict[tuple[int, int, int], PackedCall] = {}

    def product(self, kernels: CpuKernels, w: CpuLinear, x: Buffer, out: Buffer) -> PackedCall:
        """out = x @ w^T, as a call made once for these buffers and kept."""
        key = (id(w), x.ptr, out.ptr)
        call = self._products.get(key)
        if call is None:
            call = self._products[key] = w.product(kernels, out.ptr, x.ptr, x.array.shape[1], self.tokens,
                                                   self.quantized)
        return call

    def buffer(self, name: str, columns: int) -> Buffer:
        b = self._buffers.get(name)
        if b is None or b.array.shape[1] != columns:
            b = self._buffers[name] = Buffer(np.empty((self.tokens, columns), np.float32))
        return b


class _CpuStepOps(_StepOps):
    """LayerOps over one step's tokens by cpu_src/'s kernels; values are Buffers."""

    def __init__(self, backend: "CpuBackend", batch: list[ScheduledSeq], residual: np.ndarray, scratch: _Scratch):
        super().__init__(backend, batch, residual)
        self.kernels, self.scratch, self.tokens = backend.kernels, scratch, len(residual)
        self.pending: Buffer | None = None  # added to the residual stream by the next RMSNorm
        self.kept = [np.ascontiguousarray(a, dtype) for a, dtype in (
            (self.cos, np.float32), (self.sin, np.float32), (self.new_slots, np.int64), (self.bounds[:-1], np.int32),
            ([s.num_tokens for s in batch], np.int32), ([s.start for s in batch], np.int32),
            (np.concatenate(self.seq_slots), np.int64),
            (np.cumsum([0] + [len(s) for s in self.seq_slots[:-1]]), np.int64))]
        (self.cos_ptr, self.sin_ptr, self.new_slots_ptr, self.q_rows, self.num_tokens, self.starts, self.slots,
         self.slot_at) = (addr(a) for a in self.kept)

    def _add_pending(self) -> None:
        if self.pending is not None:
            self.kernels.add_to(self.stream.ptr, self.pending.ptr, self.pending.array.size)
            self.pending = None

    @property
    def residual(self) -> np.ndarray:
        self._add_pending()
        return self.stream.array

    @residual.setter
    def residual(self, value: np.ndarray) -> None:
        self.stream = Buffer(value)  # (the residual stream, added to in place)

    def at_layer(self, i: int) -> None:
        self.weights, self.kv_scale = self.backend.layers[i], self.backend.kv_scales[i]
        self.k_cache, self.v_cache = self.backend.kv_pointers[i]

    def rms_norm(self, weight: str) -> Buffer:
        out = self.scratch.buffer("normed", self.config.hidden_size)
        delta, self.pending = self.pending, None
        self.kernels.rms_norm(out.ptr, self.stream.ptr, None if delta is None else delta.ptr, self.weights[weight].ptr, self.tokens,
                              self.config.hidden_size, self.config.rms_norm_eps)
        return out

    def linear(self, x: Buffer, weight: str) -> Buffer:
        w: CpuLinear = self.weights[weight]
        out = self.scratch.buffer(weight, w.n)
        self.scratch.product(self.kernels, w, x, out)()
        return out

    def head_rms_norm(self, qkv: Buffer, q_weight: str, k_weight: str) -> Buffer:
        c = self.config
        return Buffer(head_rms_norm(qkv.array, self.weights[q_weight].array, self.weights[k_weight].array, c.num_heads,
                                    c.num_kv_heads, c.head_dim, c.rms_norm_eps))

    def rope_and_cache(self, qkv: Buffer) -> Buffer:
        c = self.config
        self.kernels.rope_and_cache(qkv.ptr, self.tokens, c.num_heads, c.num_kv_heads, c.head_dim, self.cos_ptr,
                                    self.sin_ptr, self.new_slots_ptr, self.k_cache, self.v_cache, self.backend.fp8_kv,
                                    *self.kv_scale.inverses)
        return qkv

    def attention(self, qkv: Buffer) -> Buffer:
        c = self.config
        out = self.scratch.buffer("attention", c.q_size)
        self.kernels.attention(out.ptr, qkv.ptr, c.num_heads, c.num_kv_heads, c.head_dim, len(self.batch), self.q_rows,
                               self.num_tokens, self.starts, self.slots, self.slot_at, self.k_cache, self.v_cache,
                               c.head_dim ** -0.5 * self.kv_scale.k, self.backend.fp8_kv, self.kv_scale.v)
        return out

    def silu_and_mul(self, gate_up: Buffer) -> Buffer:
        inter = gate_up.array.shape[1] // 2
        out = self.scratch.buffer("activation", inter)
        self.kernels.silu_and_mul(out.ptr, gate_up.ptr, self.tokens, inter)
        return out

    def add_to_residual(self, x: Buffer) -> None:
        self._add_pending()
        self.pending = x


class CpuBackend(NumpyBackend):
    name = "cpu"

    def __init__(self, config: ModelConfig, weights: ModelWeights, threads: int | None = None,
                 kv_cache_dtype: str = "auto", activations: str = "int16"):
        if config.hidden_size % 8 or config.head_dim % 8:
            raise ValueError(f"the CPU kernels need the hidden size and head dimension to be multiples of 8 (this "
                             f"model's are {config.hidden_size} and {config.head_dim}): use --device numpy")
        if activations not in CPU_ACTIVATIONS:
            raise ValueError(f"--cpu-activations must be one of {', '.join(CPU_ACTIVATIONS)}, not {activations!r}")
        self.kernels = CpuKernels(threads or available_cores())
        self.activations = activations
        self.kv_pointers: list[tuple[int, int]] = []
        self._scratch: _Scratch | None = None
        super().__init__(config, weights, kv_cache_dtype)

    def _hold_weights(self, weights: ModelWeights) -> None:
        self.embed = row_readable(weights.embed)  # (rows dequantized as a step reads them)
        self.lm_head = repack(weights.lm_head, self.activations)
        self.final_norm = weights.final_norm.float32()
        self.layers = [{name: repack(t, self.activations) if len(t.shape) == 2 else Buffer(t.float32())
                        for name, t in layer.items()} for layer in weights.layers]
        linears = [self.lm_head] + [w for layer in self.layers for w in layer.values() if isinstance(w, CpuLinear)]
        norms = [self.final_norm] + [w.array for layer in self.layers for w in layer.values() if isinstance(w, Buffer)]
        embed_bytes = 0 if self.embed is weights.lm_head else self.embed.nbytes  # (a tied head is the embedding)
        self.weight_bytes = sum(w.nbytes for w in linears + norms) + embed_bytes
        self._widest = max(w.kp for w in linears)
        by_dtype: dict[str, int] = {}
        for w in linears:
            by_dtype[w.dtype] = by_dtype.get(w.dtype, 0) + w.nbytes
        self.weight_dtype = "+".join(sorted(by_dtype, key=by_dtype.get, reverse=True))  # (most bytes first)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_batch: int, max_context: int) -> None:
        super().allocate_kv_cache(num_blocks, block_size, max_batch, max_context)
        self.kv_pointers = [(addr(k), addr(v)) for k, v in zip(self.k_cache, self.v_cache)]

    def _step_ops(self, batch: list[ScheduledSeq], ids: np.ndarray) -> _CpuStepOps:
        if self._scratch is None or self._scratch.tokens != len(ids):
            self._scratch = _Scratch(len(ids), self._widest)
        return _CpuStepOps(self, batch, embedding_rows(self.embed, ids), self._scratch)

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        hidden = np.ascontiguousarray(hidden)
        normed = np.empty_like(hidden)
        self.kernels.rms_norm(addr(normed), addr(hidden), None, addr(self.final_norm), len(hidden),
                              self.config.hidden_size, self.config.rms_norm_eps)
        return self.lm_head(self.kernels, normed)

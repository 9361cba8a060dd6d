"""The reference backend: the model's forward pass in float32 numpy over a paged KV cache,
each architecture's layer (engine/models) run op by op.

It is what runs where there is no GPU, and the oracle the CUDA kernels are tested
against, so it favours plain, checkable code over speed.

A token's result depends on nothing else in its step, to the bit: BLAS rounds a row's
sums differently with the number of rows it multiplies at once, and numpy's sums round
differently with their length, so every product takes tiles of ROW_TILE rows and each
query attends to exactly the keys it sees. A request then computes the same alone or
batched, in one prompt step or in chunks, and past a cached prefix or through it.
"""

from __future__ import annotations

import numpy as np

from engine.backends.base import SampleLater, Wait, is_fp8_kv_cache
from engine.config import ModelConfig
from engine.models import architecture_of
from engine.quantization.kv_cache import cache_scales, load_e4m3, store_e4m3
from engine.sampler import SampleOutput, sample
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.structured import FillingMasks
from engine.weights import ModelWeights


ROW_TILE = 8  # rows of every product (matmul_rows)


def matmul_rows(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x @ w.T, ROW_TILE rows of x at a time (the last tile padded with zeros), so that
    every product has the same shape and a row's result depends on that row alone."""
    rows, dtype = len(x), np.result_type(x, w)
    tiles = np.zeros((-(-rows // ROW_TILE) * ROW_TILE, x.shape[1]), dtype)
    tiles[:rows] = x
    out = np.empty((len(tiles), len(w)), dtype)
    for r in range(0, len(tiles), ROW_TILE):  # (w @ tile.T: BLAS takes half the time it takes for tile @ w.T here)
        out[r : r + ROW_TILE] = (w @ tiles[r : r + ROW_TILE].T).T
    return out[:rows]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps), over the last axis."""
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of position * inv_freq, each [tokens, head_dim / 2]."""
    angles = positions[:, None].astype(np.float32) * inv_freq[None, :]
    return np.cos(angles), np.sin(angles)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate [tokens, heads, head_dim] with the "rotate half" layout transformers uses:
    the pair (x[i], x[i + head_dim/2]) turns by angle i."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def silu_and_mul(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate) * up for the fused [tokens, 2 * intermediate] projection."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return gate / (1.0 + np.exp(-gate)) * up


def paged_attention(
    q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray, start: int, scale: float
) -> np.ndarray:
    """Causal grouped-query attention of the queries at positions start.. over cached K/V.

    q: [n, heads, head_dim]; k_cache, v_cache: [slots, kv_heads, head_dim];
    slots: the cache slots of positions 0 .. start + n - 1. Returns [n, heads * head_dim].
    """
    return causal_attention(q, k_cache[slots], v_cache[slots], start, scale)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, scale: float) -> np.ndarray:
    """paged_attention over a sequence's K and V, [ctx, kv_heads, head_dim] each: each
    query over exactly the keys up to its position, one query at a time (its sums then
    never depend on the other queries of the step or on the keys past it)."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = np.empty((n, heads * dim), np.result_type(q, k, v))
    for i in range(n):
        seen = start + i + 1
        qg = q[i].reshape(kv_heads, heads // kv_heads, dim)  # [kv_heads, group, dim]
        scores = (qg @ k[:seen].transpose(1, 2, 0)) * scale  # [kv_heads, group, seen]
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out[i] = (probs @ v[:seen].transpose(1, 0, 2)).reshape(-1)  # [kv_heads, group, dim]
    return out


def head_rms_norm(qkv: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, heads: int, kv_heads: int,
                  head_dim: int, eps: float) -> np.ndarray:
    """RMSNorm over each query and key head of [tokens, (heads + 2 kv_heads) * head_dim]; V as it is."""
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    q = rms_norm(qkv[:, :q_end].reshape(-1, heads, head_dim), q_weight, eps).reshape(len(qkv), -1)
    k = rms_norm(qkv[:, q_end:k_end].reshape(-1, kv_heads, head_dim), k_weight, eps).reshape(len(qkv), -1)
    return np.concatenate([q, k, qkv[:, k_end:]], axis=1)


class _StepOps:
    """LayerOps over one step's tokens in float32 (engine.models.base.LayerOps), one
    layer at a time: `at_layer` points them at its weights and cache."""

    def __init__(self, backend: "NumpyBackend", batch: list[ScheduledSeq], residual: np.ndarray):
        c = self.config = backend.config
        self.backend, self.batch, self.residual = backend, batch, residual
        positions = np.concatenate([np.arange(s.start, s.start + s.num_tokens) for s in batch])
        self.cos, self.sin = rope_cos_sin(positions, backend.inv_freq)
        self.seq_slots = [backend._slots(s.seq.block_table, s.start + s.num_tokens) for s in batch]
        self.new_slots = np.concatenate([slots[s.start :] for s, slots in zip(batch, self.seq_slots)])
        self.bounds = np.cumsum([0] + [s.num_tokens for s in batch])
        self.q_end, self.k_end = c.q_size, c.q_size + c.kv_size

    def at_layer(self, i: int) -> None:
        self.weights, self.k_cache, self.v_cache = self.backend.layers[i], self.backend.k_cache[i], self.backend.v_cache[i]
        self.kv_scale = self.backend.kv_scales[i]

    def rms_norm(self, weight: str) -> np.ndarray:
        return rms_norm(self.residual, self.weights[weight], self.config.rms_norm_eps)

    def linear(self, x: np.ndarray, weight: str) -> np.ndarray:
        return matmul_rows(x, self.weights[weight])

    def head_rms_norm(self, qkv: np.ndarray, q_weight: str, k_weight: str) -> np.ndarray:
        c = self.config
        return head_rms_norm(qkv, self.weights[q_weight], self.weights[k_weight], c.num_heads, c.num_kv_heads,
                             c.head_dim, c.rms_norm_eps)

    def rope_and_cache(self, qkv: np.ndarray) -> np.ndarray:
        c = self.config
        q = apply_rope(qkv[:, : self.q_end].reshape(-1, c.num_heads, c.head_dim), self.cos, self.sin)
        k = apply_rope(qkv[:, self.q_end : self.k_end].reshape(-1, c.num_kv_heads, c.head_dim), self.cos, self.sin)
        v = qkv[:, self.k_end :].reshape(-1, c.num_kv_heads, c.head_dim)
        self.k_cache[self.new_slots] = self.backend.kv_store(k, self.kv_scale.k)
        self.v_cache[self.new_slots] = self.backend.kv_store(v, self.kv_scale.v)
        return np.concatenate([q.reshape(len(qkv), -1), k.reshape(len(qkv), -1), qkv[:, self.k_end :]], axis=1)

    def attention(self, qkv: np.ndarray) -> np.ndarray:
        c, b = self.config, self.bounds
        q = qkv[:, : self.q_end].reshape(-1, c.num_heads, c.head_dim)
        load, kv_scale = self.backend.kv_load, self.kv_scale
        return np.concatenate([
            causal_attention(q[b[i] : b[i + 1]], load(self.k_cache[slots], kv_scale.k),
                             load(self.v_cache[slots], kv_scale.v), s.start, c.head_dim ** -0.5)
            for i, (s, slots) in enumerate(zip(self.batch, self.seq_slots))
        ])

    def silu_and_mul(self, gate_up: np.ndarray) -> np.ndarray:
        return silu_and_mul(gate_up)

    def add_to_residual(self, x: np.ndarray) -> None:
        self.residual = self.residual + x


class NumpyBackend:
    name = "numpy"
    weight_dtype = "float32"  # (every format dequantized: the exact reference)

    def __init__(self, config: ModelConfig, weights: ModelWeights, kv_cache_dtype: str = "auto"):
        # K and V as computed (float32), or as e4m3 bit patterns of them over each layer's
        # scales (engine/quantization/kv_cache.py): a quarter of the bytes, the values
        # rounded to 3 mantissa bits and saturating at 448 times the scale
        self.fp8_kv = is_fp8_kv_cache(kv_cache_dtype)
        self.kv_scales = cache_scales(weights.kv_scales, self.fp8_kv)
        self.kv_cache_dtype = "fp8_e4m3" if self.fp8_kv else "float32"
        self._kv_type = np.dtype(np.uint8 if self.fp8_kv else np.float32)
        self.config = config
        self.architecture = architecture_of(config)
        self.inv_freq = config.rope_inv_freq()
        self.block_size = 0
        self.k_cache: list[np.ndarray] = []
        self.v_cache: list[np.ndarray] = []
        self._sampled: dict[Sequence, int] = {}  # the last step's tokens, for the pending ones
        self._hold_weights(weights)

    def _hold_weights(self, weights: ModelWeights) -> None:
        self.embed = weights.embed.float32()
        self.lm_head = weights.lm_head.float32()
        self.final_norm = weights.final_norm.float32()
        self.layers = [{name: t.float32() for name, t in layer.items()} for layer in weights.layers]
        held = [self.embed, self.lm_head, self.final_norm] + [a for layer in self.layers for a in layer.values()]
        self.weight_bytes = sum({id(a): a.nbytes for a in held}.values())  # (a tied head is the embedding)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        return 2 * c.num_layers * block_size * c.kv_size * self._kv_type.itemsize

    def kv_store(self, x: np.ndarray, scale: float) -> np.ndarray:
        """K or V (float32) as the cache holds them, over the layer's scale for it."""
        return store_e4m3(x, scale) if self.fp8_kv else x

    def kv_load(self, stored: np.ndarray, scale: float) -> np.ndarray:
        """K or V from the cache, in float32."""
        return load_e4m3(stored, scale) if self.fp8_kv else stored

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_batch: int, max_context: int) -> None:
        c = self.config
        shape = (num_blocks * block_size, c.num_kv_heads, c.head_dim)
        self.block_size = block_size
        self.k_cache = [np.zeros(shape, self._kv_type) for _ in range(c.num_layers)]
        self.v_cache = [np.zeros(shape, self._kv_type) for _ in range(c.num_layers)]

    def _slots(self, block_table: np.ndarray, length: int) -> np.ndarray:
        blocks = np.asarray(block_table, dtype=np.int64)
        return (blocks[:, None] * self.block_size + np.arange(self.block_size)).ravel()[:length]

    def forward(self, batch: list[ScheduledSeq], every_token: bool = False) -> np.ndarray:
        """Run the scheduled tokens; return logits [sampling sequences, vocab] (or of
        every token of the batch: perplexity)."""
        ids = np.concatenate([self._tokens(s) for s in batch])
        ops = self._step_ops(batch, ids)
        for i in range(self.config.num_layers):
            ops.at_layer(i)
            self.architecture.layer(ops)
        rows = (slice(None) if every_token else
                [ops.bounds[i + 1] - 1 for i, s in enumerate(batch) if s.samples])
        return self._logits(ops.residual[rows])

    def _step_ops(self, batch: list[ScheduledSeq], ids: np.ndarray) -> _StepOps:
        return _StepOps(self, batch, self.embed[ids])

    def _logits(self, hidden: np.ndarray) -> np.ndarray:
        """The head's logits of the final hidden states [rows, hidden]."""
        return matmul_rows(rms_norm(hidden, self.final_norm, self.config.rms_norm_eps), self.lm_head)

    def _tokens(self, s: ScheduledSeq) -> list[int]:
        """The step's input tokens; a pending one is the one this backend sampled last step."""
        tokens, pending = s.seq.step_tokens(s.start, s.start + s.num_tokens)
        return tokens + [self._sampled[s.seq]] if pending else tokens

    def execute(self, batch: list[ScheduledSeq], masks: np.ndarray | None = None) -> list[SampleOutput | None]:
        return self.launch(batch, masks)()

    def host_array(self, shape: tuple[int, ...], dtype: type) -> np.ndarray:
        return np.empty(shape, dtype)

    def launch(self, batch: list[ScheduledSeq], masks: np.ndarray | None = None) -> Wait:
        """The CPU computes as it is asked: the step is done when this returns."""
        return self.launch_forward(batch)(masks)

    def launch_forward(self, batch: list[ScheduledSeq]) -> SampleLater:
        logits = self.forward(batch)

        def sample(masks: np.ndarray | FillingMasks | None) -> Wait:
            if isinstance(masks, FillingMasks):
                masks = masks.result()
            rows, guided = iter(logits), iter(masks if masks is not None else ())
            samples = []
            for s in batch:
                if not s.samples:
                    samples.append(None)
                    continue
                mask = next(guided) if s.seq.guide is not None and masks is not None else None
                samples.append(self._sample(s, next(rows), mask))
            self._sampled = {s.seq: out.token_id for s, out in zip(batch, samples) if out is not None}
            return lambda: samples
        return sample

    def is_fatal(self, error: BaseException) -> bool:
        return False  # (numpy leaves nothing in a bad state: a failed step fails its requests only)

    def _sample(self, s: ScheduledSeq, logits: np.ndarray, mask: np.ndarray | None) -> SampleOutput:
        seq = s.seq
        return sample(logits, seq.params, seq.prompt_ids, seq.output_ids, seq.rng, seq.banned_token_ids(), mask)

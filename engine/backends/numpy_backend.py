"""The reference backend: the Llama forward pass in float32 numpy over a paged KV cache.

It is what runs where there is no GPU, and the oracle the CUDA kernels are tested
against, so it favours plain, checkable code over speed.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from engine.config import ModelConfig
from engine.sampler import SampleOutput, sample
from engine.scheduler import ScheduledSeq
from engine.sequence import PENDING, Sequence
from engine.weights import Weights


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
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    k = k_cache[slots].transpose(1, 2, 0)  # [kv_heads, dim, ctx]
    v = v_cache[slots].transpose(1, 0, 2)  # [kv_heads, ctx, dim]
    qg = q.reshape(n, kv_heads, group, dim).transpose(1, 2, 0, 3)  # [kv_heads, group, n, dim]
    scores = (qg @ k[:, None]) * scale  # [kv_heads, group, n, ctx]
    ctx = len(slots)
    visible = np.arange(ctx)[None, :] <= (start + np.arange(n))[:, None]
    scores = np.where(visible, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = probs @ v[:, None]  # [kv_heads, group, n, dim]
    return out.transpose(2, 0, 1, 3).reshape(n, heads * dim)


class NumpyBackend:
    name = "numpy"

    def __init__(self, config: ModelConfig, weights: Weights):
        self.config = config
        c = config
        self.embed = np.ascontiguousarray(weights["model.embed_tokens.weight"], dtype=np.float32)
        self.lm_head = self.embed if c.tie_word_embeddings else np.ascontiguousarray(weights["lm_head.weight"])
        self.final_norm = weights["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            w = lambda name: weights[p + name]  # noqa: E731
            self.layers.append({
                "attn_norm": w("input_layernorm.weight"),
                "qkv": np.concatenate([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]),
                "o": np.ascontiguousarray(w("self_attn.o_proj.weight")),
                "mlp_norm": w("post_attention_layernorm.weight"),
                "gate_up": np.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
                "down": np.ascontiguousarray(w("mlp.down_proj.weight")),
            })
        self.inv_freq = c.rope_inv_freq()
        self.block_size = 0
        self.k_cache: list[np.ndarray] = []
        self.v_cache: list[np.ndarray] = []
        self._sampled: dict[Sequence, int] = {}  # the last step's tokens, for its PENDING ones

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        c = self.config
        return 2 * c.num_layers * block_size * c.kv_size * 4

    def allocate_kv_cache(self, num_blocks: int, block_size: int, max_batch: int) -> None:
        c = self.config
        shape = (num_blocks * block_size, c.num_kv_heads, c.head_dim)
        self.block_size = block_size
        self.k_cache = [np.zeros(shape, np.float32) for _ in range(c.num_layers)]
        self.v_cache = [np.zeros(shape, np.float32) for _ in range(c.num_layers)]

    def _slots(self, block_table: np.ndarray, length: int) -> np.ndarray:
        blocks = np.asarray(block_table, dtype=np.int64)
        return (blocks[:, None] * self.block_size + np.arange(self.block_size)).ravel()[:length]

    def forward(self, batch: list[ScheduledSeq]) -> np.ndarray:
        """Run the scheduled tokens; return logits [sampling sequences, vocab]."""
        c = self.config
        ids = np.concatenate([self._tokens(s) for s in batch])
        positions = np.concatenate([np.arange(s.start, s.start + s.num_tokens) for s in batch])
        seq_slots = [self._slots(s.seq.block_table, s.start + s.num_tokens) for s in batch]
        new_slots = np.concatenate([slots[s.start :] for s, slots in zip(batch, seq_slots)])
        bounds = np.cumsum([0] + [s.num_tokens for s in batch])
        cos, sin = rope_cos_sin(positions, self.inv_freq)
        scale = c.head_dim ** -0.5

        x = self.embed[ids]
        for layer, k_cache, v_cache in zip(self.layers, self.k_cache, self.v_cache):
            h = rms_norm(x, layer["attn_norm"], c.rms_norm_eps)
            qkv = h @ layer["qkv"].T
            q = apply_rope(qkv[:, : c.q_size].reshape(-1, c.num_heads, c.head_dim), cos, sin)
            k = apply_rope(qkv[:, c.q_size : c.q_size + c.kv_size].reshape(-1, c.num_kv_heads, c.head_dim), cos, sin)
            k_cache[new_slots] = k
            v_cache[new_slots] = qkv[:, c.q_size + c.kv_size :].reshape(-1, c.num_kv_heads, c.head_dim)
            attn = np.concatenate([
                paged_attention(q[bounds[i] : bounds[i + 1]], k_cache, v_cache, seq_slots[i], s.start, scale)
                for i, s in enumerate(batch)
            ])
            x = x + attn @ layer["o"].T
            h = rms_norm(x, layer["mlp_norm"], c.rms_norm_eps)
            x = x + silu_and_mul(h @ layer["gate_up"].T) @ layer["down"].T
        last = [bounds[i + 1] - 1 for i, s in enumerate(batch) if s.samples]
        return rms_norm(x[last], self.final_norm, c.rms_norm_eps) @ self.lm_head.T

    def _tokens(self, s: ScheduledSeq) -> list[int]:
        """The step's input tokens; a PENDING one is the one this backend sampled last step."""
        tokens = s.seq.tokens(s.start, s.start + s.num_tokens)
        if tokens[-1] == PENDING:
            tokens[-1] = self._sampled[s.seq]
        return tokens

    def execute(self, batch: list[ScheduledSeq]) -> list[SampleOutput | None]:
        logits = iter(self.forward(batch))
        samples = [self._sample(s, next(logits)) if s.samples else None for s in batch]
        self._sampled = {s.seq: out.token_id for s, out in zip(batch, samples) if out is not None}
        return samples

    def launch(self, batch: list[ScheduledSeq]) -> Callable[[], list[SampleOutput | None]]:
        """The CPU computes as it is asked: the step is done when this returns."""
        samples = self.execute(batch)
        return lambda: samples

    def _sample(self, s: ScheduledSeq, logits: np.ndarray) -> SampleOutput:
        seq = s.seq
        return sample(logits, seq.params, seq.prompt_ids, seq.output_ids, seq.rng, seq.banned_token_ids())

"""The H200's rates the GPU benchmarks' floors use, and what a decode step costs at
least: bytes over the measured bandwidth, FLOPs over the measured peak."""

from __future__ import annotations

BANDWIDTH, PEAK = 4.27e12, 790e12  # bytes/s of a device-to-device copy, bfloat16 FLOP/s of a large GEMM (H200)


def decode_costs(config) -> tuple[float, float, float]:
    """(weight bytes a decode step reads, K/V bytes a token, FLOPs a token) in bfloat16."""
    c = config
    layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    linear = c.num_layers * layer + c.vocab_size * c.hidden_size  # (the head; tied, it is the embedding read again)
    weight_bytes = 2 * (linear + c.vocab_size * c.hidden_size * (not c.tie_word_embeddings))
    return weight_bytes, 2 * 2 * c.num_layers * c.kv_size, 2 * linear


def decode_floor_tokens_per_s(config, batch: int, context: float) -> float:
    """Output tokens/s of decode steps of `batch` sequences at a mean `context`: each step
    reads the weights once and every sequence's K/V, or does its FLOPs, whichever is longer."""
    weight_bytes, kv_bytes_per_token, flops_per_token = decode_costs(config)
    return batch / max((weight_bytes + batch * context * kv_bytes_per_token) / BANDWIDTH, batch * flops_per_token / PEAK)

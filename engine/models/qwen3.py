"""Qwen3 (dense): Llama's layer with an RMSNorm over each query and key head before
RoPE, no QKV bias, and a head_dim of its own (not hidden / heads)."""

from __future__ import annotations

from typing import Any

from engine.config import ModelConfig
from engine.models.base import LayerOps
from engine.models.llama import Llama


class Qwen3(Llama):
    name = "qwen3"
    model_types = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
    gguf_architecture = None
    layer_weights = Llama.layer_weights + ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    gguf_layer_names = {}
    permuted_for_gguf_rope = {}

    def layer(self, ops: LayerOps) -> None:
        qkv = ops.linear(ops.rms_norm("input_layernorm.weight"), "qkv")
        qkv = ops.rope_and_cache(ops.head_rms_norm(qkv, "self_attn.q_norm.weight", "self_attn.k_norm.weight"))
        ops.add_to_residual(ops.linear(ops.attention(qkv), "self_attn.o_proj.weight"))
        gate_up = ops.linear(ops.rms_norm("post_attention_layernorm.weight"), "gate_up")
        ops.add_to_residual(ops.linear(ops.silu_and_mul(gate_up), "mlp.down_proj.weight"))

    def layer_shapes(self, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {**super().layer_shapes(c), "self_attn.q_norm.weight": (c.head_dim,),
                "self_attn.k_norm.weight": (c.head_dim,)}

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        if cfg.get("attention_bias"):
            raise ValueError("this Qwen3 checkpoint has attention biases, which llamastream does not implement")
        if cfg.get("use_sliding_window"):
            raise ValueError("this Qwen3 checkpoint uses sliding-window attention, which llamastream does not implement")
        return ModelConfig.from_hf_dict(cfg, self.name)

"""Llama (Llama 3.x, SmolLM2, ...): pre-norm decoder layers of grouped-query attention
with RoPE (llama3 scaling optional) and a SwiGLU MLP; no biases."""

from __future__ import annotations

from typing import Any

from engine.config import ModelConfig, RopeScaling
from engine.models.base import Architecture, Fused, LayerOps


class Llama(Architecture):
    name = "llama"
    model_types = ("llama",)
    hf_architectures = ("LlamaForCausalLM",)
    gguf_architecture = "llama"
    layer_weights = (
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    )
    fused = (
        Fused("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
        Fused("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    )
    gguf_layer_names = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    permuted_for_gguf_rope = {"self_attn.q_proj.weight": "num_heads", "self_attn.k_proj.weight": "num_kv_heads"}

    def layer(self, ops: LayerOps) -> None:
        qkv = ops.rope_and_cache(ops.linear(ops.rms_norm("input_layernorm.weight"), "qkv"))
        ops.add_to_residual(ops.linear(ops.attention(qkv), "self_attn.o_proj.weight"))
        gate_up = ops.linear(ops.rms_norm("post_attention_layernorm.weight"), "gate_up")
        ops.add_to_residual(ops.linear(ops.silu_and_mul(gate_up), "mlp.down_proj.weight"))

    def layer_shapes(self, c: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, inter = c.hidden_size, c.intermediate_size
        return {
            "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (c.q_size, h), "self_attn.k_proj.weight": (c.kv_size, h),
            "self_attn.v_proj.weight": (c.kv_size, h), "self_attn.o_proj.weight": (h, c.q_size),
            "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
        }

    def config_from_hf(self, cfg: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf_dict(cfg, self.name)

    def config_from_gguf(self, field, vocab_size: int, tied: bool) -> ModelConfig:
        """From GGUF metadata: `field(key, default)` reads `llama.{key}`."""
        hidden = int(field("embedding_length"))
        heads = int(field("attention.head_count"))
        scaling = None
        if field("rope.scaling.type") == "llama3" or field("rope.scaling.factor"):
            scaling = RopeScaling(
                factor=float(field("rope.scaling.factor")),
                low_freq_factor=float(field("rope.scaling.low_freq_factor", 1.0)),
                high_freq_factor=float(field("rope.scaling.high_freq_factor", 4.0)),
                original_max_position_embeddings=int(field("rope.scaling.original_context_length", 8192)),
            )
        return ModelConfig(
            hidden_size=hidden,
            num_layers=int(field("block_count")),
            num_heads=heads,
            num_kv_heads=int(field("attention.head_count_kv", heads)),
            head_dim=int(field("attention.key_length", hidden // heads)),
            intermediate_size=int(field("feed_forward_length")),
            vocab_size=vocab_size,
            max_position_embeddings=int(field("context_length", 2048)),
            rms_norm_eps=float(field("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(field("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings=tied,
            architecture=self.name,
        )

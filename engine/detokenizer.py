"""Incremental detokenization: stream text that never splits a UTF-8 character.

Decoding token by token loses spaces (a token's leading space depends on what came
before it) and can cut a multi-byte character in half. The tokenizers library's
DecodeStream does it the way vLLM does, in Rust: it decodes a short window of earlier
tokens with and without the new one, emits the difference, and holds back while the
text would end in an incomplete character. What it still holds when the sequence
ends is flushed here, incomplete or not. The context it starts from must end on a
whole character (DecodeStream would emit a prompt's dangling bytes as text).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # earlier tokens decoded with the new ones, for spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        while self.ids and tokenizer.decode(self.ids, skip_special_tokens).endswith("\ufffd"):
            self.ids.pop()
        self.emitted = len(self.ids)  # tokens before this are in the text already
        self.stream = DecodeStream(ids=list(self.ids), skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (maybe none yet)."""
        self.ids.append(token_id)
        text = self.stream.step(self.tokenizer.backend, token_id)
        if text is None:
            return ""
        self.emitted = len(self.ids)
        return text

    def flush(self) -> str:
        """Whatever is still held back, at the end of the sequence."""
        if self.emitted == len(self.ids):
            return ""
        window = self.ids[max(0, self.emitted - _CONTEXT_TOKENS) :]
        before = self.tokenizer.decode(window[: len(window) - (len(self.ids) - self.emitted)], self.skip_special_tokens)
        after = self.tokenizer.decode(window, self.skip_special_tokens)
        self.emitted = len(self.ids)
        return after[len(before) :]

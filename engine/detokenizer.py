"""Incremental detokenization: stream text that never splits a UTF-8 character.

Decoding token by token loses spaces (a token's leading space depends on what came
before it) and can cut a multi-byte character in half. So, as vLLM does, decode a
short window of earlier tokens with and without the new ones and emit the
difference, holding back while the text ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # earlier tokens decoded with the new ones, for spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _new_text(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return after[len(before) :]

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (maybe none yet)."""
        self.ids.append(token_id)
        return self._new_text(final=False)

    def flush(self) -> str:
        """Whatever is still held back, at the end of the sequence."""
        return self._new_text(final=True)

"""Streaming text equals the decode of all generated tokens, for any token sequence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.model_loader import load_model
from tests.conftest import TINY_MODEL

TOKENIZER = load_model(TINY_MODEL).tokenizer
SMOLLM2 = load_model().tokenizer  # byte-level BPE with a 49k vocabulary


def stream(ids: list[int], prompt: list[int], tokenizer=TOKENIZER) -> list[str]:
    d = IncrementalDetokenizer(tokenizer, prompt)
    return [d.add(t) for t in ids] + [d.flush()]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(5, TOKENIZER.vocab_size - 1), max_size=40), st.text(max_size=20))
def test_concatenated_deltas_equal_the_full_decode(ids, prompt_text):
    pieces = stream(ids, TOKENIZER.encode(prompt_text, add_special_tokens=False))
    full = TOKENIZER.decode(ids)
    assert "".join(pieces) == full
    if "\ufffd" not in full:  # (random bytes can be invalid UTF-8 for good)
        assert all("\ufffd" not in p for p in pieces), "a delta split a character"


def test_multibyte_characters_arrive_whole():
    ids = TOKENIZER.encode("東京 🦙 naïve", add_special_tokens=False)
    pieces = stream(ids, [])
    assert "".join(pieces) == "東京 🦙 naïve"
    assert all("\ufffd" not in p for p in pieces)
    assert len([p for p in pieces if p]) < len(ids), "byte tokens of one character were held back together"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, SMOLLM2.vocab_size - 1), max_size=30),
       st.lists(st.integers(0, SMOLLM2.vocab_size - 1), max_size=8))
def test_random_prompts_and_tokens_of_a_real_tokenizer(ids, prompt):
    """Prompts may end inside a character: none of it leaks into the generated text."""
    assert "".join(stream(ids, prompt, SMOLLM2)) == SMOLLM2.decode(ids)

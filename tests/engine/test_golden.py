"""The numpy backend and the tokenizer against Hugging Face transformers.

Fixtures come from tests/golden/make_fixtures.py (transformers on torch, float32).
Measured: max |logit error| 2.4e-6 on the tiny Llama (logits ~1), 2.9e-6 on the tiny
Qwen3 (q/k norms, head_dim 24), 5.0e-5 on SmolLM2 (logits ~20); the bounds below leave headroom for other
BLAS builds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from devtools.probes import our_logits
from tests.conftest import FIXTURES, greedy, make_engine, run, tokens

GOLDEN = json.loads((FIXTURES / "tokenizer_golden.json").read_text())
CASES = [("tiny_model", "tiny_llama_golden.npz", 1e-4), ("tiny_qwen3", "tiny_qwen3_golden.npz", 1e-4),
         ("smollm2", "smollm2_golden.npz", 1e-3)]


@pytest.mark.parametrize("model_name, fixture, tolerance", CASES)
def test_logits_match_transformers(model_name, fixture, tolerance, request):
    model = request.getfixturevalue(model_name)
    engine = make_engine(model)
    golden = np.load(FIXTURES / fixture)
    for i, name in enumerate(golden["names"]):
        ids = golden[f"ids_{i}"].tolist()
        ref = golden[f"logits_{i}"]  # every position (tiny) or the last one (SmolLM2)
        got = np.stack([our_logits(engine, ids[:n]) for n in range(len(ids) - len(ref) + 1, len(ids) + 1)])
        err = np.abs(got - ref).max()
        assert err < tolerance, f"{name}: max logit error {err:.2e}"


@pytest.mark.parametrize("model_name, fixture, tolerance", CASES)
def test_greedy_tokens_match_transformers(model_name, fixture, tolerance, request):
    model = request.getfixturevalue(model_name)
    golden = np.load(FIXTURES / fixture)
    engine = make_engine(model)
    n = len(golden["names"])
    steps = len(golden["greedy_0"])
    assert steps >= 32
    seqs = [engine.make_sequence(f"r{i}", golden[f"ids_{i}"].tolist(), greedy(steps)) for i in range(n)]
    outputs = run(engine, seqs)
    for i in range(n):
        assert tokens(outputs[f"r{i}"]) == golden[f"greedy_{i}"].tolist(), golden["names"][i]


@pytest.mark.parametrize("model_name, key", [("tiny_model", "tiny-llama"), ("tiny_qwen3", "tiny-qwen3"),
                                             ("smollm2", "smollm2")])
def test_tokenizer_and_chat_template_match_transformers(model_name, key, request):
    tok = request.getfixturevalue(model_name).tokenizer
    for case in GOLDEN[key]["encode"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    for case in GOLDEN[key]["chat"]:
        rendered = tok.render_chat(case["messages"], case["add_generation_prompt"])
        assert rendered == case["rendered"]
        assert tok.encode_chat(case["messages"], case["add_generation_prompt"])[0] == case["ids"]


def test_chat_prompts_are_among_the_golden_prompts():
    names = [str(n) for n in np.load(FIXTURES / "smollm2_golden.npz")["names"]]
    assert any(n.startswith("chat:") for n in names) and any(n.startswith("text:") for n in names)

"""Paged, continuously batched generation gives the same greedy tokens as running alone,
and on the numpy backend the same log-probs, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from engine.output import RequestOutput
from engine.sampling_params import SamplingParams
from tests.conftest import greedy, logprobs, make_engine, run, tokens

LENGTHS = [1, 5, 16, 17, 33, 64, 90]


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(5, vocab, size=n).tolist() for n in LENGTHS]


def alone(model, ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    engine = make_engine(model)
    return run(engine, [engine.make_sequence("x", ids, params)])["x"]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Each prompt's greedy tokens and their log-probs, run alone."""
    outputs = [alone(tiny_model, ids, greedy(24, top_logprobs=2)) for ids in prompts(tiny_model.config.vocab_size)]
    return [(tokens(o), logprobs(o)) for o in outputs]


@pytest.mark.parametrize("label, config, late", [
    ("one batch", dict(), False),
    ("arrivals mid-decode", dict(), True),
    ("chunked prefill", dict(max_num_batched_tokens=7), True),
    ("preemption by a tiny cache", dict(num_kv_blocks=30, block_size=4, output_reserve=0.0), True),
    ("few sequences at a time", dict(max_num_seqs=2, block_size=1, num_kv_blocks=400), True),
])
def test_batched_equals_alone(tiny_model, reference, label, config, late):
    engine = make_engine(tiny_model, **config)
    seqs = [engine.make_sequence(f"r{i}", ids, greedy(24, top_logprobs=2))
            for i, ids in enumerate(prompts(tiny_model.config.vocab_size))]
    arrivals = {3 * i: [s] for i, s in enumerate(seqs[1:], 1)} if late else {}
    outputs = run(engine, seqs[:1] if late else seqs, arrivals)
    for i, (expected, expected_logprobs) in enumerate(reference):
        assert tokens(outputs[f"r{i}"]) == expected, f"{label}: request {i}"
        assert np.array_equal(logprobs(outputs[f"r{i}"]), expected_logprobs), f"{label}: request {i}"
    if "preemption" in label:
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to force preemption"


def test_smollm2_batched_equals_alone(smollm2):
    tok = smollm2.tokenizer
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "Count to five."]
    ids = [tok.encode_chat([{"role": "user", "content": c}])[0] for c in chats] + [tok.encode("The weather today")]
    expected = [tokens(alone(smollm2, p, greedy(12))) for p in ids]
    engine = make_engine(smollm2, num_kv_blocks=6, max_num_batched_tokens=24, output_reserve=0.0)  # chunked and preempting
    seqs = [engine.make_sequence(f"r{i}", p, greedy(12)) for i, p in enumerate(ids)]
    outputs = run(engine, seqs[:2], {2: seqs[2:]})
    assert [tokens(outputs[f"r{i}"]) for i in range(len(ids))] == expected
    assert engine.scheduler.num_preemptions > 0

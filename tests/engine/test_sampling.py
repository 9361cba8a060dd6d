"""The sampler and the stop rules, on the tiny model and on hand-made logits."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampler import apply_penalties, log_softmax, sample, top_k_top_p_min_p
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.sequence import FinishReason
from tests.conftest import greedy, make_engine, run, text, tokens


def draws(params: SamplingParams, logits: np.ndarray, n: int = 2000, seed: int = 0) -> np.ndarray:
    rng = np.random.Generator(np.random.Philox(seed))
    return np.array([sample(logits.copy(), params, [], [], rng, []).token_id for _ in range(n)])


LOGITS = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], dtype=np.float32))


def test_temperature_sampling_follows_the_distribution():
    counts = np.bincount(draws(SamplingParams(temperature=1.0), LOGITS, 5000), minlength=5) / 5000
    assert np.allclose(counts, [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.03)


@pytest.mark.parametrize("params, support", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),  # 0.4 + 0.3 reaches 0.7
    (SamplingParams(top_p=0.71), {0, 1, 2}),
    (SamplingParams(min_p=0.5), {0, 1}),  # at least half the best token's probability
    (SamplingParams(temperature=0.0), {0}),
])
def test_filters_restrict_the_support(params, support):
    assert set(draws(params, LOGITS).tolist()) == support


def test_filtered_probabilities_are_renormalised():
    probs = top_k_top_p_min_p(np.exp(LOGITS.astype(np.float64)), SamplingParams(top_k=2))
    assert probs.sum() == pytest.approx(1.0) and probs[0] == pytest.approx(0.4 / 0.7)


def test_penalties():
    logits = np.array([2.0, -2.0, 1.0, 1.0])
    out = apply_penalties(logits.copy(), SamplingParams(repetition_penalty=2.0), [0], [1])
    assert out.tolist() == [1.0, -4.0, 1.0, 1.0]  # positive logits divided, negative multiplied
    out = apply_penalties(logits.copy(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [2], [3, 3])
    assert out.tolist() == [2.0, -2.0, 1.0, 1.0 - 0.5 - 0.5]  # output tokens only, counted


def test_banned_tokens_are_never_sampled():
    rng = np.random.Generator(np.random.Philox(1))
    assert all(sample(LOGITS.copy(), SamplingParams(), [], [], rng, [0, 1]).token_id not in (0, 1) for _ in range(200))


def test_logprobs_are_the_raw_distribution():
    rng = np.random.Generator(np.random.Philox(0))
    out = sample(LOGITS.copy(), SamplingParams(temperature=0.5, top_logprobs=3), [], [], rng, [])
    ref = log_softmax(LOGITS.astype(np.float64))
    assert out.logprob.logprob == pytest.approx(ref[out.token_id])
    assert [t for t, _ in out.logprob.top] == [0, 1, 2]
    assert [p for _, p in out.logprob.top] == pytest.approx(ref[:3].tolist())


def test_seeded_requests_repeat_whatever_shares_the_batch(tiny_model):
    params = dict(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True)
    engine = make_engine(tiny_model)
    alone = run(engine, [engine.make_sequence("a", [3, 4, 5], SamplingParams(seed=42, **params))])
    engine = make_engine(tiny_model)
    seqs = [engine.make_sequence("a", [3, 4, 5], SamplingParams(seed=42, **params))]
    seqs += [engine.make_sequence(f"o{i}", [7] * (i + 2), SamplingParams(seed=i, **params)) for i in range(4)]
    batched = run(engine, seqs)
    assert tokens(batched["a"]) == tokens(alone["a"])
    different = run(engine, [engine.make_sequence("b", [3, 4, 5], SamplingParams(seed=43, **params))])
    assert tokens(different["b"]) != tokens(alone["a"])


def test_max_tokens_and_min_tokens(tiny_model):
    eos = tiny_model.tokenizer.eos_token_ids[0]
    engine = make_engine(tiny_model)
    out = run(engine, [engine.make_sequence("a", [3, 4], greedy(5))])["a"]
    assert len(tokens(out)) == 5 and out[-1].finish_reason is FinishReason.LENGTH
    # Make eos the model's favourite by banning everything else... via stop_token_ids on the greedy path:
    first = tokens(out)[0]
    out = run(engine, [engine.make_sequence("b", [3, 4], greedy(5, stop_token_ids=[first]))])["b"]
    assert tokens(out) == [first] and out[-1].finish_reason is FinishReason.STOP and out[-1].stop_token_id == first
    out = run(engine, [engine.make_sequence("c", [3, 4], greedy(5, stop_token_ids=[first], min_tokens=3))])["c"]
    assert first not in tokens(out)[:3]
    assert eos not in tokens(out)[:3]


def test_eos_stops_unless_ignored(tiny_model):
    tok = tiny_model.tokenizer
    engine = make_engine(tiny_model)
    free = tokens(run(engine, [engine.make_sequence("a", [3, 4], greedy(40))])["a"])
    # Declare the model's own 4th greedy token to be eos: generation must stop there.
    engine = make_engine(tiny_model)
    tok_eos = tok.eos_token_ids
    tok.eos_token_ids = [free[3]]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40)
        out = run(engine, [engine.make_sequence("b", [3, 4], params)])["b"]
    finally:
        tok.eos_token_ids = tok_eos
    stop_at = free.index(free[3])
    assert tokens(out) == free[: stop_at + 1] and out[-1].stop_token_id == free[3]


def test_stop_strings_are_never_emitted(tiny_model):
    engine = make_engine(tiny_model)
    full = run(engine, [engine.make_sequence("a", [3, 4, 5], greedy(30))])["a"]
    full_text = text(full)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    out = run(engine, [engine.make_sequence("b", [3, 4, 5], greedy(30, stop=["never-there", stop]))])["b"]
    assert text(out) == full_text[: full_text.index(stop)]
    assert out[-1].finish_reason is FinishReason.STOP and out[-1].stop_string == stop
    for o in out:  # no delta ever showed the stop string's start early
        assert stop not in o.text


def test_deltas_concatenate_to_the_decoded_tokens(smollm2):
    engine = make_engine(smollm2)
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": "Écris une phrase en français avec des accents 🦙."}])[0]
    out = run(engine, [engine.make_sequence("a", prompt, SamplingParams(temperature=0.8, seed=3, max_tokens=60))])["a"]
    generated = [t for t in tokens(out) if t not in smollm2.tokenizer.eos_token_ids]
    assert text(out) == smollm2.tokenizer.decode(generated)
    assert all("\ufffd" not in o.text for o in out)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(min_p=1.5), "min_p"),
    (SamplingParams(repetition_penalty=0), "repetition_penalty"),
    (SamplingParams(presence_penalty=3), "presence_penalty"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(stop=[""]), "stop"),
    (SamplingParams(top_logprobs=100), "top_logprobs"),
])
def test_invalid_params_name_the_field(params, field):
    with pytest.raises(InvalidRequest, match=field):
        params.validate(vocab_size=100)

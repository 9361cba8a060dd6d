"""devtools.gguf_models writes the GGUF files the CPU benchmark runs (llama.cpp reads
them too: bench/cpu_decode.py loads them in both): here a small shape of them reads back
in our loader in the type asked, within the type's rounding of the source weights, and
the numpy backend's logits on it are finite and spread."""

from __future__ import annotations

import numpy as np
import pytest

from devtools.checkpoints import SMOLLM2
from devtools.gguf_models import TYPES, random_weights, write_gguf
from engine.backends.numpy_backend import NumpyBackend
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import load_model
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq

SHAPE = dict(SMOLLM2, vocab_size=600, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # (600: the tiny tokenizer, padded)
# A block's step (its scale) from its source values, and the largest error in steps: half
# a step from rounding, a whole one for Q4_0 (its scale is fitted to the signed extreme, so
# the other end may clip), plus the float16 scale's rounding (2^-11) times the codes' range.
STEP = {
    "q8_0": (lambda b: np.abs(b).max(axis=-1) / 127, 0.5 + 127 / 2048),
    "q4_0": (lambda b: np.abs(b).max(axis=-1) / 8, 1 + 8 / 2048),
    "q4_1": (lambda b: (b.max(axis=-1) - b.min(axis=-1)) / 15, 0.5 + 15 / 2048),
}


@pytest.mark.parametrize("kind", TYPES)
def test_written_gguf_reads_back_within_its_rounding(kind, tmp_path):
    model = load_model(write_gguf(tmp_path / f"small.{kind}.gguf", SHAPE, TYPES[kind], seed=3))
    assert model.config.vocab_size == 600 and model.config.num_layers == 2 and model.config.tie_word_embeddings
    step, steps = STEP[kind]
    source = dict(random_weights(SHAPE, seed=3))
    assert sorted(model.weights) == sorted(source)
    for name, want in source.items():
        got = model.weights[name]
        if want.ndim == 1:  # norms: float32, exact
            np.testing.assert_array_equal(got.float32(), want, err_msg=name)
            continue
        assert got.format == kind, name
        blocks = want.reshape(want.shape[0], -1, 32)
        error = np.abs(got.float32().reshape(blocks.shape) - blocks).max(axis=-1)
        # (the float16 minimum of Q4_1 rounds too: 2^-11 of its magnitude)
        bound = steps * step(blocks) + (np.abs(blocks.min(axis=-1)) / 2048 if kind == "q4_1" else 0)
        assert np.all(error <= bound * (1 + 1e-5) + 1e-9), f"{name}: {np.max(error / bound):.3f} of the bound"
    assert model.tokenizer.decode(model.tokenizer.encode("The sky is blue.")).endswith("The sky is blue.")


def test_numpy_backend_logits_on_a_written_gguf_are_finite_and_spread(tmp_path):
    model = load_model(write_gguf(tmp_path / "small.q4_0.gguf", SHAPE, TYPES["q4_0"]))
    engine = LLMEngine(model, NumpyBackend(model.config, model.model_weights()), EngineConfig(num_kv_blocks=16))
    ids = model.tokenizer.encode("The history of astronomy is long")
    seq = engine.make_sequence("p", ids, SamplingParams(max_tokens=1))
    engine.block_manager.allocate(seq, len(ids))
    logits = engine.backend.forward([ScheduledSeq(seq, 0, len(ids))], every_token=True)
    assert logits.shape == (len(ids), 600) and np.isfinite(logits).all()
    assert 0.1 < logits.std(axis=-1).min() and logits.std(axis=-1).max() < 10  # neither flat nor blown up

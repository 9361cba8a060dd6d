"""The GPU step's metadata (engine/backends/step_metadata.py) against a per-token loop."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends.step_metadata import FIELDS, StepShape, build_metadata, field_sizes, step_shape
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

BLOCK, DUMMY = 4, 999


def naive(batch: list[ScheduledSeq], shape: StepShape) -> dict[str, list[int]]:
    """One token at a time, straight from the definitions."""
    f = {name: [] for name in FIELDS}
    for i, s in enumerate(batch):
        for p in range(s.start, s.start + s.num_tokens):
            f["ids"].append((s.seq.prompt_ids + s.seq.output_ids)[p])
            f["positions"].append(p)
            f["slots"].append(s.seq.block_table[p // BLOCK] * BLOCK + p % BLOCK)
            f["token_seq"].append(i)
        if s.samples:
            f["sample_rows"].append(len(f["ids"]) - 1)
    real = len(f["ids"])
    for t in range(real, shape.tokens):  # padding rows of a graph
        f["ids"].append(0), f["positions"].append(0), f["slots"].append(DUMMY * BLOCK), f["token_seq"].append(t % shape.seqs)
    f["sample_rows"] += list(range(real, real + shape.samples - len(f["sample_rows"])))
    f["all_rows"] = list(range(shape.tokens))
    for i in range(shape.seqs):
        table = batch[i].seq.block_table if i < len(batch) else []
        f["tables"] += table + [DUMMY] * (shape.max_blocks - len(table))
    return f


@st.composite
def batches(draw):
    free = list(range(200))
    batch = []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(0, 500), min_size=1, max_size=30))
        output = draw(st.lists(st.integers(0, 500), max_size=10))
        seq = Sequence(f"r{i}", prompt, SamplingParams(seed=0), 50)
        seq.output_ids = output
        start = draw(st.integers(0, seq.num_tokens - 1))
        n = draw(st.integers(1, seq.num_tokens - start))
        seq.block_table = [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(-(-(start + n) // BLOCK))]
        batch.append(ScheduledSeq(seq, start, n))
    return batch


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(0, 5))
def test_metadata_matches_the_per_token_definition(batch, padding):
    shape = step_shape(batch, partition=512)
    if padding and all(s.num_tokens == 1 and s.samples for s in batch):  # a graph's padded decode step
        size = len(batch) + padding
        shape = StepShape(tokens=size, samples=size, seqs=size, max_blocks=shape.max_blocks + 2, partitions=8)
    got = build_metadata(batch, shape, BLOCK, DUMMY)
    expected = naive(batch, shape)
    offsets = np.cumsum([0] + field_sizes(shape))
    assert len(got) == offsets[-1]
    for name, a, b in zip(FIELDS, offsets, offsets[1:]):
        assert got[a:b].tolist() == expected[name], name


def test_sequence_token_slices():
    seq = Sequence("s", [1, 2, 3], SamplingParams(), 5)
    seq.output_ids = [4, 5]
    full = [1, 2, 3, 4, 5]
    for a in range(5):
        for b in range(a, 6):
            assert seq.tokens(a, b) == full[a:b]


def test_an_empty_batch_is_all_padding():
    """(what a graph is captured with)"""
    shape = StepShape(tokens=3, samples=3, seqs=3, max_blocks=2, partitions=8)
    f = naive([], shape)
    assert build_metadata([], shape, BLOCK, DUMMY).tolist() == [v for name in FIELDS for v in f[name]]

"""The GPU step's metadata (engine/backends/cuda/step_metadata.py) against a per-token loop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.backends.cuda.step_metadata import (
    FIELDS, GENERATED_TILE, LARGE_PARTITION, PARTITION, PROMPT_TILE, SHORT_CONTEXT, SHORT_PARTITION,
    SMALL_DECODE, SMALL_PROMPT, WHOLE_CONTEXT_PROMPT, StepShape, attention_partition, is_whole_context_prompt,
    build_metadata, decode_shape, field_sizes, prompt_shape, step_shape,
)
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

BLOCK, DUMMY, QUERY_ROWS = 4, 999, 3


def naive(batch: list[ScheduledSeq], shape: StepShape, previous: dict[Sequence, int] | None = None) -> dict[str, list[int]]:
    """One token at a time, straight from the definitions: generated tokens from row 0,
    prompt tokens from row shape.generated_rows, padding rows everywhere else; a
    pending token as -(its index in the previous step's samples + 1)."""
    T, n = shape.tokens, len(batch)
    padding_seq = [n + t % (shape.seqs - n) if shape.seqs > n else t % shape.seqs for t in range(T)]
    f = {"ids": [0] * T, "positions": [0] * T, "slots": [DUMMY * BLOCK] * T, "token_seq": padding_seq}
    next_row = {True: 0, False: shape.generated_rows}
    f["sample_rows"], f["tables"], f["prompt_tiles"] = [], [], []
    for i, s in enumerate(batch):
        for p in range(s.start, s.start + s.num_tokens):
            generated = p >= len(s.seq.prompt_ids)
            r = next_row[generated]
            if not generated:  # a new query tile every QUERY_ROWS prompt rows of a sequence
                first_of_seq = p == s.start
                if first_of_seq or f["prompt_tiles"][-1] == QUERY_ROWS:
                    f["prompt_tiles"] += [r, 0]
                f["prompt_tiles"][-1] += 1
            next_row[generated] += 1
            known = s.seq.prompt_ids + s.seq.output_ids
            f["ids"][r] = known[p] if p < len(known) else -1 - previous[s.seq]
            f["positions"][r] = p
            f["slots"][r] = s.seq.block_table[p // BLOCK] * BLOCK + p % BLOCK
            f["token_seq"][r] = i
        if s.samples:
            f["sample_rows"].append(r)
    assert next_row[True] <= shape.generated and next_row[False] - shape.generated_rows <= shape.prompt
    used = set(range(next_row[True])) | set(range(shape.generated_rows, next_row[False]))
    padding = [t for t in range(T) if t not in used]
    f["sample_rows"] += padding[: shape.samples - len(f["sample_rows"])]
    # a graph's spare query tiles: over its padding prompt rows, then the last tile again
    spare = [t for t in padding if t >= shape.generated_rows]
    while len(f["prompt_tiles"]) < 2 * shape.prompt_tiles:
        f["prompt_tiles"] += [spare[0], min(QUERY_ROWS, len(spare))] if spare else f["prompt_tiles"][-2:]
        spare = spare[QUERY_ROWS:]
    f["all_rows"] = list(range(T))
    for i in range(shape.seqs):
        table = batch[i].seq.block_table.tolist() if i < len(batch) else []
        f["tables"] += table + [DUMMY] * (shape.max_blocks - len(table))
    return f


@st.composite
def batches(draw):
    """A batch; some sequences end in a pending token, sampled by the previous step."""
    free = list(range(200))
    batch = []
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(0, 500), min_size=1, max_size=30))
        output = draw(st.lists(st.integers(0, 500), max_size=10))
        pending = bool(output) and draw(st.booleans())
        seq = Sequence(f"r{i}", prompt, SamplingParams(seed=0), 50)
        seq.output_ids, seq.num_pending = output[:-1] if pending else output, int(pending)
        start = draw(st.integers(0, seq.num_tokens - 1))
        n = draw(st.integers(1, seq.num_tokens - start))
        blocks = [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(-(-(start + n) // BLOCK))]
        seq.block_table = np.array(blocks, np.int32)
        batch.append(ScheduledSeq(seq, start, n))
    return batch


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(0, 5), st.booleans())
def test_metadata_matches_the_per_token_definition(batch, padding, invariant):
    shape = step_shape(batch, query_rows=QUERY_ROWS, invariant=invariant)
    if padding and all(s.num_tokens == 1 and s.samples and s.start >= len(s.seq.prompt_ids) for s in batch):
        shape = decode_shape(len(batch) + padding, max_blocks=shape.max_blocks + 2, max_context=4096, invariant=invariant)  # a graph's
    elif len(batch) == 1 and batch[0].samples and shape.prompt == batch[0].num_tokens:  # a prompt graph's
        shape = prompt_shape(shape.prompt + padding, shape.max_blocks + 2, 4096, QUERY_ROWS, invariant)
    previous = {s.seq: 7 * i + 2 for i, s in enumerate(batch)}  # (any distinct places)
    got = build_metadata(batch, shape, BLOCK, DUMMY, QUERY_ROWS, previous)
    expected = naive(batch, shape, previous)
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


@pytest.mark.parametrize("shape", [decode_shape(3, max_blocks=2, max_context=4096, invariant=True),
                                   prompt_shape(8, max_blocks=2, max_context=4096, query_rows=QUERY_ROWS, invariant=False)],
                         ids=["decode", "prompt"])
def test_an_empty_batch_is_all_padding(shape):
    """(what a graph is captured with)"""
    f = naive([], shape)
    assert build_metadata([], shape, BLOCK, DUMMY, QUERY_ROWS).tolist() == [v for name in FIELDS for v in f[name]]


@given(batches())
def test_invariant_gemm_tiles_cover_the_rows_by_class(batch):
    shape = step_shape(batch, query_rows=QUERY_ROWS, invariant=True)
    tiles = shape.gemm_tiles()
    assert [r for r, _ in tiles] == sorted(r for r, _ in tiles)
    assert sum(n for _, n in tiles) == shape.rows >= shape.tokens
    assert all(n == (GENERATED_TILE if r < shape.generated_rows else PROMPT_TILE) for r, n in tiles)
    assert shape.head_tiles() == [(r, GENERATED_TILE) for r in range(0, shape.head_rows, GENERATED_TILE)]
    assert shape.head_rows >= shape.samples


@given(batches())
def test_one_gemm_over_unpadded_rows_by_default(batch):
    shape = step_shape(batch, query_rows=QUERY_ROWS, invariant=False)
    assert shape.rows == shape.tokens == sum(s.num_tokens for s in batch)
    assert shape.gemm_tiles() == [(0, shape.tokens)]
    assert shape.head_tiles() == ([(0, shape.samples)] if shape.samples else [])


@given(batches(), st.booleans())
def test_attention_partitions_cover_the_longest_context(batch, invariant):
    shape = step_shape(batch, query_rows=QUERY_ROWS, invariant=invariant)
    longest = max(s.start + s.num_tokens for s in batch)
    assert (shape.partitions - 1) * shape.partition < longest <= shape.partitions * shape.partition


def test_steps_bound_by_latency_take_short_partitions_and_large_ones_long_unless_invariant():
    """More blocks for a decode step of a few tokens (whose decode kernel merges them
    itself) and for a short prompt step (a prompt's tail past a cached prefix), in a
    short context; fewer partitions to merge in a large decode step; one size where a
    token's sums must not depend on its batch, and for the other steps."""
    assert attention_partition(1, 0, 100, invariant=False) == attention_partition(SMALL_DECODE, 0, 100, False) == SHORT_PARTITION
    assert attention_partition(SMALL_DECODE + 1, 0, 100, invariant=False) == LARGE_PARTITION
    assert attention_partition(SMALL_DECODE + 1, 0, 32768, invariant=False) == LARGE_PARTITION
    assert attention_partition(SMALL_DECODE + 1, 0, 100, invariant=True) == PARTITION
    assert attention_partition(1, 0, 100, invariant=True) == PARTITION
    assert attention_partition(0, SMALL_PROMPT, SHORT_CONTEXT, invariant=False) == SHORT_PARTITION
    assert attention_partition(0, SMALL_PROMPT + 1, 100, invariant=False) == PARTITION
    assert attention_partition(0, 2048, 2048, invariant=False) == PARTITION  # (a prompt's sums as they were)
    assert attention_partition(SMALL_DECODE + 1, 2048, 2048, invariant=False) == LARGE_PARTITION
    assert attention_partition(0, 5, SHORT_CONTEXT + 1, invariant=False) == PARTITION
    assert attention_partition(1, 0, SHORT_CONTEXT + 1, invariant=False) == PARTITION  # (a long context's decode)
    assert attention_partition(1, 5, 100, invariant=False) == PARTITION  # (a mixed step)
    assert attention_partition(0, 5, 100, invariant=True) == PARTITION
    graph = decode_shape(1, max_blocks=256, max_context=4096, invariant=False)
    assert (graph.partition, graph.partitions) == (SHORT_PARTITION, 4096 // SHORT_PARTITION)
    tail = prompt_shape(SMALL_PROMPT, max_blocks=256, max_context=4096, query_rows=QUERY_ROWS, invariant=False)
    assert (tail.partition, tail.partitions) == (SHORT_PARTITION, 4096 // SHORT_PARTITION)
    assert prompt_shape(2 * SMALL_PROMPT, 256, 4096, QUERY_ROWS, invariant=False).partition == PARTITION
    assert decode_shape(SMALL_DECODE + 1, 256, 4096, invariant=False).partition == LARGE_PARTITION


def test_a_step_whose_contexts_fit_one_partition_merges_nothing():
    """Where one partition holds every context, the decode kernel stores each decode
    row's output, the prefill kernel each prompt row's (as for a whole-context prompt),
    and no merge kernel runs; past it, the merge kernel runs over the partial rows."""
    one = decode_shape(SMALL_DECODE + 1, 256, LARGE_PARTITION, invariant=False)
    assert one.partitions == 1 and not one.merge
    mixed = dataclasses.replace(one, prompt=5, prompt_tiles=2)
    assert mixed.partitions == 1 and not mixed.merge
    two = dataclasses.replace(mixed, partitions=2)
    assert two.merge and two.partial_rows == SMALL_DECODE + 1 + 5
    prompt = prompt_shape(2 * SMALL_PROMPT, 256, PARTITION, QUERY_ROWS, invariant=False)
    assert prompt.whole_context_prompt and not prompt.merge
    longer = prompt_shape(2 * SMALL_PROMPT, 256, PARTITION + 1, QUERY_ROWS, invariant=False)
    assert not longer.whole_context_prompt and longer.merge


@pytest.mark.parametrize("generated", [1, SMALL_DECODE, SMALL_DECODE + 1, 256])
def test_the_decode_kernel_merges_a_step_of_decodes_alone_unless_invariant(generated):
    """In a step of decode rows alone, of any size, the decode kernel merges the
    partitions itself and no merge kernel runs; with batch invariance, or beside prompt
    rows, the merge kernel does."""
    shape = decode_shape(generated, 256, 4096, invariant=False)
    assert shape.partitions > 1 and shape.decode_merges and not shape.merge
    assert not dataclasses.replace(shape, prompt=5, prompt_tiles=2).decode_merges
    invariant = decode_shape(generated, 256, 4096, invariant=True)
    assert not invariant.decode_merges and invariant.merge


def test_only_steps_of_thousands_of_prompt_tokens_take_whole_contexts():
    assert is_whole_context_prompt(WHOLE_CONTEXT_PROMPT, invariant=False)
    assert not is_whole_context_prompt(WHOLE_CONTEXT_PROMPT - 1, invariant=False)
    assert not is_whole_context_prompt(WHOLE_CONTEXT_PROMPT, invariant=True)

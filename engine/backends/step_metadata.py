"""What a GPU step needs to know about its batch, as one int32 array (pure numpy, so it
is tested without a GPU): token ids, positions, KV-cache slots, the sequence of each
token, row indices, the rows that reach the head, and the block tables."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.scheduler import ScheduledSeq


@dataclass(frozen=True)
class StepShape:
    tokens: int  # rows the kernels run over
    samples: int  # rows that reach the head (the last token of each finishing sequence)
    seqs: int  # block-table rows
    max_blocks: int  # block-table width
    partitions: int  # attention partitions


FIELDS = ("ids", "positions", "slots", "token_seq", "all_rows", "sample_rows", "tables")


def field_sizes(shape: StepShape) -> list[int]:
    t = shape.tokens
    return [t, t, t, t, t, shape.samples, shape.seqs * shape.max_blocks]


def step_shape(batch: list[ScheduledSeq], partition: int) -> StepShape:
    return StepShape(
        tokens=sum(s.num_tokens for s in batch),
        samples=sum(s.samples for s in batch),
        seqs=len(batch),
        max_blocks=max(len(s.seq.block_table) for s in batch),
        partitions=math.ceil(max(s.start + s.num_tokens for s in batch) / partition),
    )


def build_metadata(batch: list[ScheduledSeq], shape: StepShape, block_size: int, dummy_block: int) -> np.ndarray:
    """The fields of FIELDS, concatenated. Rows past the batch (a graph's padding) read
    and write only `dummy_block`, and sample themselves."""
    T, bs = shape.tokens, block_size
    counts = np.array([s.num_tokens for s in batch], dtype=np.int64)
    real = int(counts.sum())
    ends = np.cumsum(counts)
    seq_of_row = np.repeat(np.arange(len(batch)), counts)
    positions = np.zeros(T, np.int64)
    positions[:real] = np.repeat([s.start for s in batch], counts) + np.arange(real) - np.repeat(ends - counts, counts)
    ids = np.zeros(T, np.int64)
    ids[:real] = [t for s in batch for t in s.seq.tokens(s.start, s.start + s.num_tokens)]
    tables = np.full((shape.seqs, shape.max_blocks), dummy_block, np.int64)
    for i, s in enumerate(batch):
        tables[i, : len(s.seq.block_table)] = s.seq.block_table
    token_seq = np.arange(T) % shape.seqs
    token_seq[:real] = seq_of_row
    slots = np.full(T, dummy_block * bs, np.int64)
    slots[:real] = tables[seq_of_row, positions[:real] // bs] * bs + positions[:real] % bs
    sample_rows = (ends - 1)[[s.samples for s in batch]].tolist()
    sample_rows += range(real, real + shape.samples - len(sample_rows))
    return np.concatenate([ids, positions, slots, token_seq, np.arange(T), sample_rows, tables.ravel()]).astype(np.int32)

"""What a GPU step needs to know about its batch, as one int32 array (pure numpy, so it
is tested without a GPU): token ids, positions, KV-cache slots, the sequence of each
row, row indices, the rows that reach the head, and the block tables.

By default each GEMM runs once over all of a step's rows, and cuBLAS picks its best
algorithm for that row count. cuBLAS picks by shape, so a token's result can then
differ by an ulp with the batch it runs in. With batch invariance on, rows are laid
out for GEMMs of fixed shapes instead, and a row's result depends only on its tile
size, never on the other rows. Tokens the model generated (decode) come first, in
tiles of GENERATED_TILE rows; prompt tokens (prefill) follow in tiles of PROMPT_TILE
rows, so that a long prompt reads the weights once per PROMPT_TILE tokens instead of
once per GENERATED_TILE. A token's class depends on its position only, so it is
computed the same way alone, batched or recomputed after preemption. Rows that pad a
tile are dummy tokens that read and write only the dummy KV block.

In either layout, generated rows go through the decode attention kernel
(paged_attention_partial) and prompt rows through the prefill one
(prefill_attention_partial), in query tiles of up to `query_rows` consecutive rows of
one sequence; both split contexts into partitions whose partial results a merge
kernel combines, except in a step of thousands of prompt tokens, whose prompt rows
take their whole contexts at once (is_whole_context_prompt), and for the tokens whose
context fits one partition, whose output the kernels store (StepShape.merge).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

GENERATED_TILE = 64  # at 64 rows a bf16 GEMM is still bound by reading the weights
PROMPT_TILE = 256
PARTITION = 512  # context positions per attention partition (a thread block of the attention kernels each)
LARGE_PARTITION = 1024  # the partitions of large decode steps: fewer to merge, and most contexts in one
SHORT_PARTITION = 128  # the partitions of steps bound by latency: 4 times the blocks
SMALL_DECODE = 8  # decode steps of up to this many tokens take short partitions,
SMALL_PROMPT = 64  # and so do prompt steps of up to this many (a prompt's tail past a cached prefix),
# in contexts of up to SHORT_CONTEXT. Past it, whole partitions already give the SMs
# blocks enough, and short ones would multiply the partial results to write and merge.
SHORT_CONTEXT = 4096
WHOLE_CONTEXT_PROMPT = 4096  # prompt steps of at least this many tokens: one partition a context (is_whole_context_prompt)


@dataclass(frozen=True)
class StepShape:
    generated: int  # generated tokens: rows 0.. of the decode kernel
    generated_rows: int  # the generated segment, a multiple of GENERATED_TILE
    prompt: int  # prompt tokens: rows generated_rows..
    prompt_tiles: int  # prefill attention query tiles
    samples: int  # rows that reach the head (the last token of each finishing sequence)
    seqs: int  # block-table rows
    max_blocks: int  # block-table width
    partition: int  # context positions per attention partition (attention_partition)
    partitions: int  # attention partitions of the longest context
    invariant: bool  # GEMMs in fixed tiles (batch invariance), not one over all rows

    @property
    def decode_merges(self) -> bool:
        """Whether the decode kernel merges its tokens' partitions itself: in a step of
        decode tokens alone. A small one saves the merge kernel's launch so; in a large
        one, whose 1,024-position partitions leave few tokens to merge, the last block
        of those few merging them costs less than a kernel that visits every token
        (bench/decode_attention.py's "in kernel" rows). Batch-invariant steps keep the
        merge kernel, whose sums a token gets in any step."""
        return not self.invariant and not self.prompt

    @property
    def decode_prefetch(self) -> bool:
        """A step of a few decode tokens in contexts past SHORT_CONTEXT: its attention has
        few blocks, each walking a long partition, whose warps load a chunk ahead
        (attention.cu's PREFETCH)."""
        long_context = self.partitions * self.partition > SHORT_CONTEXT
        return long_context and is_small_decode(self.generated, self.prompt, invariant=False)  # (the same sums either way)

    @property
    def tokens(self) -> int:
        """Rows the per-token kernels run over (the padding between the segments included)."""
        return self.generated_rows + self.prompt if self.prompt else self.generated

    @property
    def whole_context_prompt(self) -> bool:
        """Prompt rows whose attention takes whole contexts, with no merge: in a step of
        thousands of prompt tokens (is_whole_context_prompt), or where one partition holds
        every context (the same sums)."""
        return self.partitions == 1 or is_whole_context_prompt(self.prompt, self.invariant)

    @property
    def merge(self) -> bool:
        """Whether the merge kernel runs: not where the decode kernel merges itself
        (decode_merges), nor where one partition holds every context (nothing to merge)."""
        return not self.decode_merges and self.partitions > 1 and self.partial_rows > 0

    @property
    def partial_rows(self) -> int:
        """Rows whose attention leaves partial results to merge: the first ones, all but a
        whole-context prompt's."""
        return self.tokens - self.prompt if self.whole_context_prompt else self.tokens

    @property
    def rows(self) -> int:
        """Rows of the activation buffers: whole GEMM tiles."""
        return self.generated_rows + _round_up(self.prompt, PROMPT_TILE if self.invariant else 1)

    @property
    def head_rows(self) -> int:
        """Rows of the head's buffers: whole tiles of the sampled rows."""
        return sum(n for _, n in self.head_tiles())

    def gemm_tiles(self) -> list[tuple[int, int]]:
        """(first row, rows) of each GEMM over the step's tokens."""
        if not self.invariant:
            return [(0, self.rows)]
        return ([(r, GENERATED_TILE) for r in range(0, self.generated_rows, GENERATED_TILE)]
                + [(r, PROMPT_TILE) for r in range(self.generated_rows, self.rows, PROMPT_TILE)])

    def head_tiles(self) -> list[tuple[int, int]]:
        """(first row, rows) of each GEMM of the head, over the sampled rows."""
        if not self.invariant:
            return [(0, self.samples)] if self.samples else []
        return [(r, GENERATED_TILE) for r in range(0, max(1, self.samples), GENERATED_TILE)]


FIELDS = ("ids", "positions", "slots", "token_seq", "all_rows", "sample_rows", "tables", "prompt_tiles")


def field_sizes(shape: StepShape) -> list[int]:
    t = shape.tokens
    return [t, t, t, t, t, shape.samples, shape.seqs * shape.max_blocks, 2 * shape.prompt_tiles]


def _round_up(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def _columns(batch: list[ScheduledSeq]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each scheduled sequence's first position in this step, its tokens in this step and its prompt length."""
    n = len(batch)
    return (np.fromiter((s.start for s in batch), np.int64, n), np.fromiter((s.num_tokens for s in batch), np.int64, n),
            np.fromiter((len(s.seq.prompt_ids) for s in batch), np.int64, n))


def _prompt_counts(starts: np.ndarray, counts: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray:
    """Prompt tokens of each scheduled sequence in this step."""
    return np.maximum(0, np.minimum(starts + counts, prompt_lens) - starts)


def is_small_decode(generated: int, prompt: int, invariant: bool) -> bool:
    """Whether a step is a decode step of a few tokens, bound by latency: its attention
    takes short partitions (attention_partition)."""
    return not invariant and not prompt and generated <= SMALL_DECODE


def attention_partition(generated: int, prompt: int, context: int, invariant: bool) -> int:
    """Context positions per attention partition of a step whose longest context is
    `context`. A step of more than a small decode's generated tokens takes long ones:
    its blocks fill the GPU anyway, and the offline workload's contexts then mostly fit
    one, whose output the decode kernel stores with nothing to merge
    (bench/decode_attention.py). (Prompt steps alone keep PARTITION: a prompt's sums,
    which bench/whole_context_accuracy.py and the Qwen3 test weigh, stay as they are,
    and a 256-token prompt after 1,024 cached positions is faster so:
    bench/prefill_attention.py.) A step bound by latency (a small decode or a short
    prompt step) in a short context takes short ones, so that its attention spreads
    over more thread blocks, each with a shorter chain of loads. With batch invariance
    every step takes the same size, since a token's sums depend on its partitions."""
    if invariant:
        return PARTITION
    if generated > SMALL_DECODE:
        return LARGE_PARTITION
    small_prompt = not generated and prompt <= SMALL_PROMPT
    if context <= SHORT_CONTEXT and (is_small_decode(generated, prompt, invariant) or small_prompt):
        return SHORT_PARTITION
    return PARTITION


def is_whole_context_prompt(prompt: int, invariant: bool) -> bool:
    """Whether a step's prompt rows take each query tile's whole context in one
    partition, whose block stores their output (attention.cu). A step of this many
    prompt tokens has query tiles enough to fill the GPU several times over unsplit, and
    its partial results would cost more than the split gains: at 32,768 positions, 4 GB
    a layer to write and read again for an 8,192-token chunk at 512-position partitions.
    With batch invariance every step splits contexts alike."""
    return not invariant and prompt >= WHOLE_CONTEXT_PROMPT


def step_shape(batch: list[ScheduledSeq], query_rows: int, invariant: bool) -> StepShape:
    starts, counts, prompt_lens = _columns(batch)
    prompt = _prompt_counts(starts, counts, prompt_lens)
    generated, longest = int(counts.sum() - prompt.sum()), int((starts + counts).max())
    partition = attention_partition(generated, int(prompt.sum()), longest, invariant)
    return StepShape(
        generated=generated,
        generated_rows=_round_up(generated, GENERATED_TILE if invariant else 1),
        prompt=int(prompt.sum()),
        prompt_tiles=int((-(-prompt // query_rows)).sum()),
        samples=sum(s.samples for s in batch),
        seqs=len(batch),
        max_blocks=max(len(s.seq.block_table) for s in batch),
        partition=partition,
        partitions=math.ceil(longest / partition),
        invariant=invariant,
    )


def decode_shape(batch_size: int, max_blocks: int, max_context: int, invariant: bool) -> StepShape:
    """The shape of a CUDA graph's decode step: `batch_size` sampling decodes of
    contexts up to `max_context`."""
    partition = attention_partition(batch_size, 0, max_context, invariant)
    return StepShape(generated=batch_size, generated_rows=_round_up(batch_size, GENERATED_TILE if invariant else 1),
                     prompt=0, prompt_tiles=0, samples=batch_size, seqs=batch_size, max_blocks=max_blocks,
                     partition=partition, partitions=math.ceil(max_context / partition), invariant=invariant)


def prompt_shape(tokens: int, max_blocks: int, max_context: int, query_rows: int, invariant: bool) -> StepShape:
    """The shape of a CUDA graph's prompt step: one sequence's last `tokens` (at most)
    prompt tokens, past a computed (or cached) prefix, in a context of up to
    `max_context`. Its padding rows are the prompt of a second, dummy sequence, in query
    tiles of their own (one tile more than the bucket needs, so that they always fit)."""
    partition = attention_partition(0, tokens, max_context, invariant)
    return StepShape(generated=0, generated_rows=0, prompt=tokens, prompt_tiles=-(-tokens // query_rows) + 1, samples=1,
                     seqs=2, max_blocks=max_blocks, partition=partition, partitions=math.ceil(max_context / partition),
                     invariant=invariant)


def _input_ids(batch: list[ScheduledSeq], previous_samples: dict[Sequence, int] | None) -> list[int]:
    """The step's input tokens, a pending last one of a sequence as -(its index in the
    previous step's samples + 1)."""
    ids: list[int] = []
    for s in batch:
        tokens, pending = s.seq.step_tokens(s.start, s.start + s.num_tokens)
        ids += tokens
        if pending:
            ids.append(-1 - previous_samples[s.seq])
    return ids


def build_metadata(batch: list[ScheduledSeq], shape: StepShape, block_size: int, dummy_block: int,
                   query_rows: int, previous_samples: dict[Sequence, int] | None = None) -> np.ndarray:
    """The fields of FIELDS, concatenated. Padding rows (and rows past the batch, in a
    graph) read and write only `dummy_block`; samples past the batch sample padding rows.
    A pending token has id -(i + 1), i = previous_samples[its sequence]: the embedding
    reads it from the previous step's i-th sample, on the device. (One pass over the
    batch, then numpy: it is on the host's side of every step.)"""
    T, bs, n = shape.tokens, block_size, len(batch)
    starts, counts, prompt_lens = _columns(batch)
    table_lens = np.fromiter((len(s.seq.block_table) for s in batch), np.int64, n)
    sampling = np.fromiter((s.samples for s in batch), bool, n)
    ends = counts.cumsum()
    seq_of_token = np.arange(n).repeat(counts)
    positions = np.arange(int(counts.sum())) + (starts - (ends - counts)).repeat(counts)
    generated = positions >= prompt_lens[seq_of_token]
    row = np.where(generated, generated.cumsum() - 1, shape.generated_rows + (~generated).cumsum() - 1)

    offsets = list(itertools.accumulate(field_sizes(shape), initial=0))
    out = np.empty(offsets[-1], np.int32)
    f = {name: out[a:b] for name, a, b in zip(FIELDS, offsets, offsets[1:])}
    tables = f["tables"].reshape(shape.seqs, shape.max_blocks)
    tables[:] = dummy_block
    if n:  # (masked as wide as the longest table: a graph's are 256 blocks wide, for 4,096 positions)
        width = int(table_lens.max())
        tables[:n, :width][np.arange(width) < table_lens[:, None]] = np.concatenate([s.seq.block_table for s in batch])
    f["ids"][:] = 0
    f["ids"][row] = _input_ids(batch, previous_samples)
    f["positions"][:] = 0
    f["positions"][row] = positions
    f["slots"][:] = dummy_block * bs
    f["slots"][row] = tables[seq_of_token, positions // bs] * bs + positions % bs
    # padding rows belong to the sequences past the batch where a graph has some, so that
    # each query tile is of one sequence
    f["token_seq"][:] = n + np.arange(T) % (shape.seqs - n) if shape.seqs > n else np.arange(T) % shape.seqs
    f["token_seq"][row] = seq_of_token
    f["all_rows"][:] = np.arange(T)
    padding = np.ones(T, bool)
    padding[row] = False
    sample_rows = row[(ends - 1)[sampling]]
    f["sample_rows"][: len(sample_rows)] = sample_rows
    f["sample_rows"][len(sample_rows) :] = np.flatnonzero(padding)[: shape.samples - len(sample_rows)]
    prompt_counts = _prompt_counts(starts, counts, prompt_lens)
    first_rows = shape.generated_rows + prompt_counts.cumsum() - prompt_counts
    tiles = [(r, min(query_rows, first + m - r)) for first, m in zip(first_rows.tolist(), prompt_counts.tolist()) if m
             for r in range(first, first + m, query_rows)]
    if len(tiles) < shape.prompt_tiles:  # a graph's: its padding rows' tiles, then the last one again (same writes)
        pad = np.flatnonzero(padding[shape.generated_rows:]) + shape.generated_rows
        tiles += [(int(pad[i]), min(query_rows, len(pad) - i)) for i in range(0, len(pad), query_rows)]
        tiles += tiles[-1:] * (shape.prompt_tiles - len(tiles))
    f["prompt_tiles"][:] = [x for tile in tiles[: shape.prompt_tiles] for x in tile]
    return out

"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence owns.

Token i of a sequence lives in block `block_table[i // block_size]`, at offset
`i % block_size`. Blocks come from one free pool and all go back when the sequence
finishes, is aborted or is preempted. A block table is an int32 array, replaced (never
changed in place) when it grows, so that every step's metadata reads it without
converting Python ints.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from engine.sequence import NO_BLOCKS, Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks to hold the first `num_tokens` tokens of `seq`."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def room(self, seq: Sequence) -> int:
        """Tokens `seq` could hold: its blocks and every free one."""
        return (len(seq.block_table) + len(self._free)) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"allocate {needed} blocks with {len(self._free)} free: check can_allocate first")
        if needed:
            new = np.fromiter((self._free.popleft() for _ in range(needed)), np.int32, needed)
            seq.block_table = np.concatenate((seq.block_table, new))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table.tolist())
        seq.block_table = NO_BLOCKS

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat cache slot of token `position` of `seq`."""
        return int(seq.block_table[position // self.block_size]) * self.block_size + position % self.block_size

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is free or owned by exactly one live sequence; raises if not."""
        owned = [b for s in live for b in s.block_table.tolist()]
        assert len(owned) == len(set(owned)), "a block is in two block tables"
        assert not set(owned) & set(self._free), "a block is both free and owned"
        assert len(owned) + len(self._free) == self.num_blocks, "a block was lost"
        assert len(set(self._free)) == len(self._free), "a block is free twice"

"""The paged KV cache's bookkeeping: which fixed-size blocks each sequence holds, and
which full blocks hold a known prefix (automatic prefix caching).

Token i of a sequence lives in block `block_table[i // block_size]`, at offset
`i % block_size`. A block table is an int32 array, replaced (never changed in place)
when it grows, so that every step's metadata reads it without converting Python ints.

A full block whose keys and values are computed is identified by a hash of (the
previous block's hash, its token ids), xxh3 of the ids seeded with that hash: equal
hashes mean equal prefixes, and the token ids are compared on a hit, against collisions. Such a block can be in several block
tables (a reference count says how many). When the last one lets go it keeps its
contents, in an evictable pool that new allocations take from, least recently used
first, once the free blocks run out; until then a later request with the same prefix
claims it instead of computing it again. Only full blocks are shared, and a sequence
only ever writes past its cached prefix, so no block is written while shared.

With `record_events`, every block that becomes findable and every one that stops
being findable is recorded (BlocksStored, BlocksRemoved), for a gateway that routes
requests to where their prefix is cached (server/kv_events.py publishes them).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np
import xxhash

from engine.sequence import NO_BLOCKS, Sequence


TOKEN_BYTES = 8  # a token id's, as hashed and compared


def token_bytes(tokens: list[int]) -> bytes:
    """Token ids as a block's hash and the prefix cache's comparison read them: int64, little-endian."""
    return np.asarray(tokens, "<i8").tobytes()


def block_hash(previous: int, data: bytes) -> int:
    """The hash of a full block (its token_bytes) given its predecessor's (0 for the first block)."""
    return xxhash.xxh3_64_intdigest(data, seed=previous)


@dataclass(frozen=True)
class BlocksStored:
    """Consecutive full blocks of one prefix became findable: their hashes, the hash of
    the block before the first (None at the start of a prompt) and their tokens."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]


@dataclass(frozen=True)
class BlocksRemoved:
    """Cached blocks that are no longer findable (evicted or flushed)."""

    block_hashes: list[int]


KvEvent = BlocksStored | BlocksRemoved


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of those, found cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, record_events: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # no contents worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: least recently used first
        self._refs = [0] * num_blocks
        self._by_hash: dict[int, int] = {}  # hash -> the block that holds it
        self._hash_of: dict[int, tuple[int, bytes]] = {}  # block -> (its hash, its token_bytes)
        self.stats = PrefixCacheStats()
        self.events: list[KvEvent] | None = [] if record_events else None  # since take_events()

    def take_events(self) -> list[KvEvent]:
        """The events recorded since the last call, oldest first."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks to hold the first `num_tokens` tokens of `seq`."""
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(seq.block_table))

    def holds(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq`'s blocks hold its first `num_tokens` tokens (no blocks_needed: a
        decode asks this of every running sequence every step)."""
        return num_tokens <= len(seq.block_table) * self.block_size

    def room(self, seq: Sequence) -> int:
        """Tokens `seq` could hold: its blocks and every one an allocation can take."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq`'s block table to hold `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"allocate {needed} blocks with {self.num_free_blocks} free: check can_allocate first")
        if needed:
            new = np.fromiter((self._take() for _ in range(needed)), np.int32, needed)
            seq.block_table = np.concatenate((seq.block_table, new))

    def _take(self) -> int:
        """A free block, or else the least recently used evictable one, its hash dropped."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        h, _ = self._hash_of.pop(block)
        del self._by_hash[h]  # (a block is registered only under a hash no other block holds)
        if self.events is not None:
            if self.events and isinstance(self.events[-1], BlocksRemoved):
                self.events[-1].block_hashes.append(h)
            else:
                self.events.append(BlocksRemoved([h]))

    # -- the prefix cache -----------------------------------------------------------
    def _known_hashes(self, seq: Sequence, num_blocks: int, data: bytes | None = None) -> list[int]:
        """The hashes of `seq`'s first `num_blocks` full blocks of known tokens (kept on
        the sequence, which never changes a known token); `data`, where given, is the
        token_bytes of those blocks."""
        hashes, bs, size = seq.block_hashes, self.block_size, self.block_size * TOKEN_BYTES
        first = len(hashes)
        if first < num_blocks:
            if data is None:
                view = memoryview(token_bytes(seq.tokens(first * bs, num_blocks * bs)))
            else:
                view = memoryview(data)[first * size :]
            for i in range(num_blocks - first):
                hashes.append(block_hash(hashes[-1] if hashes else 0, view[i * size : (i + 1) * size]))
        return hashes[:num_blocks]

    def claim_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence that holds no blocks: take the cached blocks of the longest
        cached prefix of its known tokens, leaving at least its last token to compute
        (its logits are needed), and mark them computed. Returns the tokens claimed."""
        assert not len(seq.block_table) and seq.num_computed_tokens == 0
        if not self.prefix_caching:
            return 0
        known = len(seq.prompt_ids) + len(seq.output_ids)
        eligible = min(known, seq.num_tokens - 1) // self.block_size
        size = self.block_size * TOKEN_BYTES
        data = token_bytes(seq.tokens(0, eligible * self.block_size))
        blocks = []
        for i, h in enumerate(self._known_hashes(seq, eligible, data)):
            block = self._by_hash.get(h)
            if block is None or self._hash_of[block][1] != data[i * size : (i + 1) * size]:
                break
            blocks.append(block)
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
        if blocks:
            seq.block_table = np.asarray(blocks, np.int32)
        seq.num_registered_blocks = len(blocks)  # (cache_full_blocks need not look at them again)
        claimed = len(blocks) * self.block_size
        seq.num_computed_tokens = claimed
        return claimed

    def admitted(self, seq: Sequence) -> None:
        """Count a sequence's first admission in the prefix cache's statistics."""
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.stats.queries += len(seq.prompt_ids)
            self.stats.hits += seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s full blocks whose keys and values are computed (or queued to be:
        any step that reads them runs after) and whose tokens are all known."""
        registered = seq.num_registered_blocks
        # (the common case, checked first: every running sequence comes here every step,
        # and one fills a block every block_size steps)
        if not self.prefix_caching or seq.num_computed_tokens // self.block_size <= registered:
            return
        known = len(seq.prompt_ids) + len(seq.output_ids)
        full = min(min(seq.num_computed_tokens, known) // self.block_size, len(seq.block_table))
        if full <= registered:
            return
        hashes = self._known_hashes(seq, full)
        bs = self.block_size
        stored: list[int] = []  # indices of the blocks registered now
        for i in range(registered, full):
            block, h = int(seq.block_table[i]), hashes[i]
            if block not in self._hash_of and h not in self._by_hash:  # (another block may hold it already)
                self._by_hash[h] = block
                self._hash_of[block] = (h, token_bytes(seq.tokens(i * bs, (i + 1) * bs)))
                stored.append(i)
        seq.num_registered_blocks = full
        if self.events is not None:
            self._record_stored(stored, hashes, seq)

    def _record_stored(self, indices: list[int], hashes: list[int], seq: Sequence) -> None:
        """One BlocksStored for each run of consecutive block indices of `seq`."""
        bs, runs = self.block_size, []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            self.events.append(BlocksStored([hashes[i] for i in run], hashes[run[0] - 1] if run[0] else None,
                                            seq.tokens(run[0] * bs, (run[-1] + 1) * bs)))

    def free(self, seq: Sequence, keep_cached: bool = True) -> None:
        """Let go of `seq`'s blocks: each that nobody else holds becomes evictable if it
        is cached, else free. Last blocks first, so that a prefix's tail is evicted
        before its head. Without `keep_cached` (the sequence's step failed, so its
        blocks may not hold what they should) the blocks it alone held are forgotten."""
        if keep_cached:
            self.cache_full_blocks(seq)
        for block in reversed(seq.block_table.tolist()):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of and not keep_cached:
                self._forget(block)
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        seq.block_table = NO_BLOCKS
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Forget the cached blocks that no sequence holds (they become free); those still
        held stay cached. Returns the blocks freed."""
        dropped = len(self._evictable)
        for block in self._evictable:
            self._forget(block)
        self._free.extend(self._evictable)
        self._evictable.clear()
        return dropped

    def slot(self, seq: Sequence, position: int) -> int:
        """The flat cache slot of token `position` of `seq`."""
        return int(seq.block_table[position // self.block_size]) * self.block_size + position % self.block_size

    def check_invariants(self, live: list[Sequence]) -> None:
        """Reference counts equal the block tables that hold each block; every block is
        held, evictable or free, and only one of them; raises if not."""
        held = [b for s in live for b in s.block_table.tolist()]
        counts = np.bincount(np.asarray(held, np.int64), minlength=self.num_blocks) if held else np.zeros(self.num_blocks)
        assert counts.tolist() == self._refs, "a reference count is off"
        for s in live:
            assert len(set(s.block_table.tolist())) == len(s.block_table), "a block is twice in one block table"
        for s in live:  # a block still being written (or to be) is held by its writer alone
            written = s.block_table[s.num_computed_tokens // self.block_size:].tolist()
            assert all(self._refs[b] == 1 for b in written), "a block being written is shared"
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not (free & evictable) and not (set(held) & (free | evictable)), "a held block is free or evictable"
        assert len(set(held)) + len(free) + len(evictable) == self.num_blocks, "a block was lost"
        assert evictable <= set(self._hash_of), "an evictable block is not cached"
        assert all(self._hash_of[b][0] in self._by_hash for b in evictable), "an evictable block cannot be found"

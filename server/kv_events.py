"""The prefix cache's events for gateways that route requests to where their prefix is
cached (VllmEngine's SubscribeKvEvents, smg-grpc-proto's KvEventBatch): each step's
blocks stored and removed become one numbered batch, sent to every subscriber.

A subscriber that resumes (start_sequence_number > 0) within the recent batches kept
here gets them from there on; any other gets a snapshot first, numbered as the
protocol has it (its chunks carry consecutive sequence numbers ending at the batch the
state was taken at, chunk 0 opening with a cleared event), then the live batches.
Block hashes are our 64-bit block hashes as signed int64 (the gateway derives its own
content hashes from the token ids, and uses ours as identities and parent links).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from smg_grpc_proto.generated import common_pb2 as common

from engine.block_manager import BlocksRemoved, BlocksStored, KvEvent

HISTORY_BATCHES = 4096  # batches kept for subscribers that resume
SNAPSHOT_CHUNK_BLOCKS = 1024
MAX_SUBSCRIBER_BACKLOG = 8192  # batches a subscriber may leave unread before it is cut off


class SubscriberTooSlow(Exception):
    """A subscriber left more than MAX_SUBSCRIBER_BACKLOG batches unread."""


def int64(h: int) -> int:
    """A 64-bit unsigned hash as the proto's int64."""
    return h - (1 << 64) if h >= 1 << 63 else h


@dataclass(frozen=True)
class _Block:
    parent: int | None
    token_ids: tuple[int, ...]
    depth: int  # blocks before it in its prefix: a snapshot lists parents first


class KvEventPublisher:
    def __init__(self, loop: asyncio.AbstractEventLoop, block_size: int):
        self._loop, self.block_size = loop, block_size
        self._lock = threading.Lock()  # the routing thread publishes, subscribers on the loop read
        self._sequence = 0  # of the last batch
        self._event_ids = 0
        self._history: collections.deque[common.KvEventBatch] = collections.deque(maxlen=HISTORY_BATCHES)
        self._live: dict[int, _Block] = {}  # the findable blocks, by hash
        self._subscribers: set[asyncio.Queue] = set()

    def publish(self, events: list[KvEvent]) -> None:
        """One step's events (called on the thread that routes the engine's outputs)."""
        with self._lock:
            self._sequence += 1
            batch = common.KvEventBatch(sequence_number=self._sequence, timestamp=time.time(),
                                        events=[self._apply(e) for e in events])
            self._history.append(batch)
            subscribers = list(self._subscribers)
        if subscribers:
            self._loop.call_soon_threadsafe(self._deliver, batch, subscribers)

    def _apply(self, event: KvEvent) -> common.KvCacheEvent:
        """`event` as the proto's, its blocks added to or removed from the live set."""
        self._event_ids += 1
        if isinstance(event, BlocksRemoved):
            for h in event.block_hashes:
                self._live.pop(h, None)
            return common.KvCacheEvent(event_id=self._event_ids, removed=common.KvBlocksRemoved(
                block_hashes=[int64(h) for h in event.block_hashes]))
        bs = self.block_size
        depth = self._live[event.parent_hash].depth + 1 if event.parent_hash in self._live else 0
        for i, h in enumerate(event.block_hashes):
            self._live[h] = _Block(event.block_hashes[i - 1] if i else event.parent_hash,
                                   tuple(event.token_ids[i * bs : (i + 1) * bs]), depth + i)
        return common.KvCacheEvent(event_id=self._event_ids, stored=self._stored(event.block_hashes, event.parent_hash))

    def _stored(self, hashes: list[int], parent: int | None) -> common.KvBlocksStored:
        stored = common.KvBlocksStored(blocks=[
            common.KvBlock(block_hash=int64(h), token_ids=self._live[h].token_ids, block_size=self.block_size)
            for h in hashes])
        if parent is not None:
            stored.parent_block_hash = int64(parent)
        return stored

    @staticmethod
    def _deliver(batch: common.KvEventBatch, subscribers: list[asyncio.Queue]) -> None:  # the loop
        for queue in subscribers:
            queue.put_nowait(batch if queue.qsize() < MAX_SUBSCRIBER_BACKLOG else SubscriberTooSlow())

    async def subscribe(self, start_sequence_number: int) -> AsyncIterator[common.KvEventBatch]:
        """The batches from `start_sequence_number` on (or a snapshot, then the live
        ones), until the caller stops iterating. Raises SubscriberTooSlow."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._subscribers.add(queue)
            kept = self._history[0].sequence_number if self._history else self._sequence + 1
            if start_sequence_number and kept <= start_sequence_number <= self._sequence + 1:
                backlog = [b for b in self._history if b.sequence_number >= start_sequence_number]
            else:
                backlog = self._snapshot()
        try:
            last = 0
            for batch in backlog:
                last = batch.sequence_number
                yield batch
            while True:
                batch = await queue.get()
                if isinstance(batch, SubscriberTooSlow):
                    raise batch
                if batch.sequence_number > last:  # (published while the backlog was taken: it is there)
                    last = batch.sequence_number
                    yield batch
        finally:
            with self._lock:
                self._subscribers.discard(queue)

    def _snapshot(self) -> list[common.KvEventBatch]:
        """The live blocks as the protocol's snapshot chunks (under the lock); none before
        the first batch."""
        if not self._sequence:
            return []
        blocks = sorted(self._live.items(), key=lambda item: item[1].depth)
        per_chunk = max(SNAPSHOT_CHUNK_BLOCKS, -(-len(blocks) // self._sequence))
        count = max(1, -(-len(blocks) // per_chunk))
        chunks = []
        for i in range(count):
            events = [common.KvCacheEvent(event_id=0, cleared=common.KvCacheCleared())] if i == 0 else []
            events += [common.KvCacheEvent(event_id=0, stored=self._stored([h], block.parent))
                       for h, block in blocks[i * per_chunk : (i + 1) * per_chunk]]
            chunks.append(common.KvEventBatch(
                sequence_number=self._sequence - count + 1 + i, timestamp=time.time(), events=events,
                snapshot=common.KvSnapshotChunk(index=i, count=count, blocks=len(blocks), unknown_before=0)))
        return chunks

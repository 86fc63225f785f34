"""One tier's index: key → entry, in LRU order, capped in entries (pages).

Keys are chained page hashes (`block_pool.hash_page`). An entry is pinned while something
reads its bytes (a load reading it out, a write to a lower tier reading it); neither a pinned
entry nor one whose bytes are still arriving is evicted, so its slot (CPU) or file (disk) is
never handed to another key under a copy in flight. Not thread-safe: the engine core owns it.

The CPU tier's entries have slots (rows of the host buffer). One store's pages take their slots
as few runs of consecutive slots as the free space allows (`insert_many`, in the keys' order),
so that a conversation stored together is copied back up with one host→device copy per run
instead of one per page. Free slots are kept as maximal runs: an evicted entry's slot merges
with its free neighbours, so pages stored together and evicted together free a run again.

A prefix's pages are used front to back, so the tiers keep a chain's tail older than its head
(`touch_chain`, after each store and each lookup): eviction takes a conversation's last pages
first and leaves its prefix whole, as vLLM frees a request's blocks tail first. Evicting the
head first would make every page after it unreachable.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class TierEntry:
    key: bytes
    slot: int  # the CPU tier's slot index; -1 where a tier has no slots (disk)
    ready: bool = False  # its bytes have arrived: it may be loaded
    pins: int = 0
    announced: bool = False  # published as stored (KV events): its removal is published too


class FreeRuns:
    """Free slots as maximal runs `[start, start + length)`. `take(n)` hands out n slots from the
    longest runs first (one run when one is long enough, carved from its start, so an empty
    tier fills up in order); `give(slot)` merges a slot back with its free neighbours."""

    def __init__(self, capacity: int):
        self.by_start: dict[int, int] = {0: capacity} if capacity else {}  # start -> length
        self.by_end: dict[int, int] = {capacity: 0} if capacity else {}  # end -> start
        self._longest: list[tuple[int, int]] = [(-capacity, 0)] if capacity else []  # (-length, start), lazy
        self.num_free = capacity

    def __len__(self) -> int:
        return self.num_free

    def take(self, n: int) -> list[tuple[int, int]]:
        """(start, length) runs holding `n` slots in all (n <= num_free)."""
        assert 0 <= n <= self.num_free, (n, self.num_free)
        runs = []
        while n:
            length, start = heapq.heappop(self._longest)
            length = -length
            if self.by_start.get(start) != length:
                continue  # a run merged or carved since it was pushed
            k = min(n, length)
            self._drop(start, length)
            if k < length:
                self._add(start + k, length - k)
            runs.append((start, k))
            n -= k
        self.num_free -= sum(k for _, k in runs)
        return runs

    def give(self, slot: int) -> None:
        start, end = slot, slot + 1
        before = self.by_end.get(start)
        if before is not None:
            self._drop(before, start - before)
            start = before
        after = self.by_start.get(end)
        if after is not None:
            self._drop(end, after)
            end += after
        self._add(start, end - start)
        self.num_free += 1

    def _add(self, start: int, length: int) -> None:
        self.by_start[start] = length
        self.by_end[start + length] = start
        heapq.heappush(self._longest, (-length, start))
        if len(self._longest) > 2 * len(self.by_start) + 64:  # too many stale entries: rebuild
            self._longest = [(-n, s) for s, n in self.by_start.items()]
            heapq.heapify(self._longest)

    def _drop(self, start: int, length: int) -> None:
        del self.by_start[start]
        del self.by_end[start + length]


class TierIndex:
    """`capacity` entries at most; inserting evicts the least recently used unpinned entries to
    make room and returns what it evicted (the caller deletes their bytes, e.g. disk files)."""

    def __init__(self, capacity: int, with_slots: bool = False):
        if capacity < 0:
            raise ValueError(f"a tier's capacity must be >= 0 pages, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()  # head = least recently used
        self.free_slots = FreeRuns(capacity) if with_slots else None

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def get(self, key: bytes) -> TierEntry | None:
        """A ready entry, marked most recently used; None when absent or still arriving."""
        entry = self.entries.get(key)
        if entry is None or not entry.ready:
            return None
        self.entries.move_to_end(key)
        return entry

    def touch_chain(self, keys: list[bytes]) -> None:
        """Mark a chain's pages (in prefix order) most recently used, its head the most recent."""
        for key in reversed(keys):
            if key in self.entries:
                self.entries.move_to_end(key)

    def insert(self, key: bytes, ready: bool = False) -> tuple[TierEntry | None, list[TierEntry]]:
        """A new entry for `key` (not present), making room by LRU eviction; (None, evicted)
        when what is left is pinned or still arriving (or the capacity is 0): the tier skips
        this page."""
        (entry,), evicted = self.insert_many([key], ready)
        return entry, evicted

    def insert_many(self, keys: list[bytes], ready: bool = False) -> tuple[list[TierEntry | None], list[TierEntry]]:
        """New entries for `keys` (distinct, none present), in order, their slots in as few runs
        as the free space allows; LRU entries are evicted to make room. Where what is left is
        pinned or still arriving, the last keys get None (the tier skips those pages)."""
        evicted = self._evict_down_to(self.capacity - len(keys))
        room = max(0, min(len(keys), self.capacity - len(self.entries)))
        slots = ([start + i for start, n in self.free_slots.take(room) for i in range(n)]
                 if self.free_slots is not None else [-1] * room)
        entries: list[TierEntry | None] = []
        for key, slot in zip(keys, slots):
            assert key not in self.entries, key
            entry = TierEntry(key, slot, ready=ready)
            self.entries[key] = entry
            entries.append(entry)
        return entries + [None] * (len(keys) - room), evicted

    def evict_over_capacity(self) -> list[TierEntry]:
        """After the capacity shrank: evict LRU entries down to it (as far as they are evictable)."""
        return self._evict_down_to(self.capacity)

    def _evict_down_to(self, size: int) -> list[TierEntry]:
        evicted = []
        while len(self.entries) > max(size, 0):
            victim = next((e for e in self.entries.values() if e.ready and not e.pins), None)  # LRU first
            if victim is None:
                break
            self._remove(victim)
            evicted.append(victim)
        return evicted

    def _remove(self, entry: TierEntry) -> None:
        del self.entries[entry.key]
        if self.free_slots is not None:
            self.free_slots.give(entry.slot)

    def discard(self, key: bytes) -> TierEntry | None:
        """Drop `key` (a failed write, a corrupt entry); its slot goes back."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self._remove(entry)
        return entry

    def pin(self, entry: TierEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: TierEntry) -> None:
        assert entry.pins > 0, entry.key
        entry.pins -= 1

    @property
    def num_pinned(self) -> int:
        return sum(1 for e in self.entries.values() if e.pins)

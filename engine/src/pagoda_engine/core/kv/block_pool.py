"""The fixed pool of KV pages: free queue in LRU order, prefix hash → page, reference counts.

A page whose last user lets go keeps its hash and stays findable by prefix lookup until the free
queue hands it out again (it is taken from the queue's head, so the least recently freed page is
reused first). Page 0 is the null page: reserved, never handed out (padding in page tables).

With KV events on (`--kv-events-config`), the pool records what enters and leaves its prefix
cache as vLLM's events (`kv_events`): the manager reports each run of pages it registers
(`record_stored`), the pool the hashes it evicts and a reset; the engine core takes them
(`take_events`) at the end of each step and publishes them. The KV offload tiers report into
the same list (`record_pages_stored`, `record_removed`, with their medium), so that one step's
events keep the order in which they happened.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from pagoda_engine.lora import LoRARequest
from pagoda_engine.kv_event_wire import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent,
                                         block_hash_int)

NULL_PAGE_ID = 0


def hash_page(parent_hash: bytes | None, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Chained page hash: H(parent hash, this page's token ids, extra keys such as a cache salt).

    Stable across processes and machines (blake2b of the token bytes), so a remote KV tier can be
    shared by every replica of a service."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\0" * 16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_key:
        h.update(extra_key)
    return h.digest()


def hash_pages(token_ids: Sequence[int], page_size: int, extra_key: bytes = b"",
               hashes: list[bytes] | None = None) -> list[bytes]:
    """The chained hashes of every full page of `token_ids`: `hashes` (those of its first pages,
    made already) extended in place, or a new list."""
    hashes = [] if hashes is None else hashes
    for i in range(len(hashes), len(token_ids) // page_size):
        hashes.append(hash_page(hashes[i - 1] if i else None, token_ids[i * page_size:(i + 1) * page_size], extra_key))
    return hashes


@dataclass(frozen=True, slots=True)
class PageTokens:
    """What a KV event tells of a page besides its hash, kept while the request is at hand for
    the events that follow it (a tier's store, a load back into the pool): the hash of the page
    before it (None at a prompt's start), its token ids, and the LoRA adapter whose name its
    hash took as its extra key."""

    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora: LoRARequest | None = None


@dataclass(eq=False)
class Page:
    page_id: int
    ref_cnt: int = 0
    page_hash: bytes | None = None  # set once the page is full and registered in the prefix cache


class BlockPool:
    """All pages of one KV cache. Not thread-safe: the engine core owns it."""

    def __init__(self, num_pages: int, enable_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is the null page), got {num_pages}")
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self.null_page = self.pages[NULL_PAGE_ID]
        self.null_page.ref_cnt = 1  # never freed
        # page_id -> Page, in LRU order: head = next to hand out.
        self.free_queue: OrderedDict[int, Page] = OrderedDict((p.page_id, p) for p in self.pages[1:])
        self.cached: dict[bytes, Page] = {}
        self.events: list[KVCacheEvent] | None = None  # None: KV events off

    def record_events(self) -> None:
        self.events = []

    def take_events(self) -> list[KVCacheEvent]:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def record_stored(self, hashes: Sequence[bytes], parent_hash: bytes | None, token_ids: list[int],
                      page_size: int, lora: LoRARequest | None = None, medium: str = MEDIUM_GPU) -> None:
        """A run of consecutive full pages just registered (vLLM's `cache_full_blocks` event), or
        stored in an offload tier (`medium`): their hashes, the hash of the page before the first
        (None at the prompt's start), their tokens, and the LoRA adapter whose name each page's
        hash took as its extra key."""
        if self.events is not None and hashes:
            self.events.append(BlockStored(
                block_hashes=[block_hash_int(h) for h in hashes],
                parent_block_hash=None if parent_hash is None else block_hash_int(parent_hash),
                token_ids=token_ids, block_size=page_size, lora_id=lora.lora_int_id if lora else None,
                medium=medium, lora_name=lora.lora_name if lora else None,
                extra_keys=[(lora.lora_name,) if lora else None] * len(hashes), group_idx=0,
                kv_cache_spec_kind="full_attention"))

    def record_pages_stored(self, hashes: Sequence[bytes], pages: Sequence[PageTokens], medium: str) -> None:
        """Pages stored in `medium` (or loaded back into the pool: `MEDIUM_GPU`), in prefix
        order as far as they chain: each run of pages whose parent is the page before it, of one
        adapter, is one `BlockStored`, as the pool's own runs are."""
        if self.events is None:
            return
        start = 0
        for i in range(1, len(hashes) + 1):
            if (i < len(hashes) and pages[i].parent_hash == hashes[i - 1] and pages[i].lora == pages[start].lora
                    and len(pages[i].token_ids) == len(pages[start].token_ids)):
                continue
            first = pages[start]
            self.record_stored(hashes[start:i], first.parent_hash, [t for p in pages[start:i] for t in p.token_ids],
                               len(first.token_ids), first.lora, medium)
            start = i

    def record_removed(self, hashes: Sequence[bytes], medium: str) -> None:
        """Pages an offload tier (`medium`) no longer holds: one `BlockRemoved`."""
        if self.events is not None and hashes:
            self.events.append(BlockRemoved(block_hashes=[block_hash_int(h) for h in hashes], medium=medium,
                                            group_idx=0))

    @property
    def num_free_pages(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of usable pages held by requests (0..1); cached-but-free pages count as free."""
        return 1.0 - self.num_free_pages / (self.num_pages - 1)

    def get_cached_page(self, page_hash: bytes) -> Page | None:
        return self.cached.get(page_hash) if self.enable_caching else None

    def has_room(self, hits: Sequence[Page], num_new: int) -> bool:
        """Whether `num_new` new pages can be handed out once `hits` are taken: hits sitting in
        the free queue stop being free when taken."""
        return num_new <= self.num_free_pages - sum(1 for p in hits if p.ref_cnt == 0)

    def touch(self, pages: Iterable[Page]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free queue."""
        for page in pages:
            if page.ref_cnt == 0:
                del self.free_queue[page.page_id]
            page.ref_cnt += 1

    def get_new_pages(self, n: int) -> list[Page]:
        if n > self.num_free_pages:
            raise RuntimeError(f"asked for {n} pages with only {self.num_free_pages} free")
        pages = []
        for _ in range(n):
            _, page = self.free_queue.popitem(last=False)
            self._evict(page)
            page.ref_cnt = 1
            pages.append(page)
        return pages

    def cache_page(self, page: Page, page_hash: bytes) -> bool:
        """Register a full page under its chained hash. A hash already cached keeps its first page.
        Whether `page` was registered now."""
        if not self.enable_caching or page.page_hash is not None:
            return False
        if page_hash in self.cached:
            return False
        page.page_hash = page_hash
        self.cached[page_hash] = page
        return True

    def free_pages(self, pages: Iterable[Page]) -> None:
        """Drop one reference each. Pass them tail first: a request's last pages are the least
        likely to be shared, so they should be reused before its prefix."""
        for page in pages:
            if page.page_id == NULL_PAGE_ID:
                continue
            assert page.ref_cnt > 0, f"double free of page {page.page_id}"
            page.ref_cnt -= 1
            if page.ref_cnt == 0:
                self.free_queue[page.page_id] = page

    def _evict(self, page: Page) -> None:
        if page.page_hash is not None:
            if self.cached.get(page.page_hash) is page:
                del self.cached[page.page_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved(block_hashes=[block_hash_int(page.page_hash)], medium=MEDIUM_GPU,
                                                    group_idx=0))
            page.page_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights). Only when no page is in use."""
        if self.num_free_pages != self.num_pages - 1:
            return False
        for page in self.pages:
            page.page_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

"""Per-request page tables on top of the block pool: prefix lookup, `allocate_slots`, free.

With KV offload tiers (`offload`, set by the engine core) every page registered in the prefix
cache is queued to go down, and a waiting request whose prefix continues below the device is
loaded before it is admitted (`load_from_tiers`): from host memory within the step that admits
it (or before the next one, when the copies would hold up other requests' step), from disk or
Redis before a later one."""

from __future__ import annotations

from pagoda_engine.core.request import Request
from pagoda_engine.core.kv.block_pool import BlockPool, Page, PageTokens, hash_pages
from pagoda_engine.core.kv.offload.manager import Lookup, OffloadManager


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True):
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_pages, enable_caching)
        self.req_pages: dict[str, list[Page]] = {}
        self.req_page_ids: dict[str, list[int]] = {}  # the same pages as ids, for the runner, every step
        self.req_hashes: dict[str, list[bytes]] = {}  # chained hashes of the request's full pages so far
        self.num_registered: dict[str, int] = {}  # how many of its pages are registered in the cache
        self.offload: OffloadManager | None = None
        self.tier_misses: dict[str, Lookup] = {}  # request id -> what its last look in the tiers found and did not load
        # Prometheus-style counters, in tokens.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # --- lookup -------------------------------------------------------------------------------
    def _page_hashes(self, req: Request) -> list[bytes]:
        """Hashes of every full page of the request's known tokens, extended incrementally."""
        hashes = self.req_hashes.setdefault(req.request_id, [])
        num_full = req.num_tokens // self.page_size
        if len(hashes) == num_full:
            return hashes  # the common decode step: no new full page, no token list to build
        return hash_pages(req.all_token_ids, self.page_size, req.page_hash_key, hashes)

    def _page_tokens(self, req: Request, start: int, end: int) -> list[PageTokens] | None:
        """What the KV events say of the request's pages `start:end` (None: events off, or no
        page): the offload tiers keep it with their stores and loads, which outlive the step at hand."""
        if self.pool.events is None or start >= end:
            return None
        hashes, tokens, size = self._page_hashes(req), req.all_token_ids, self.page_size
        return [PageTokens(hashes[i - 1] if i else None, tuple(tokens[i * size:(i + 1) * size]), req.lora_request)
                for i in range(start, end)]

    def get_computed_pages(self, req: Request) -> tuple[list[Page], int]:
        """Longest cached prefix of the request, in whole pages. The last token is always left to
        compute: the step needs its logits."""
        if not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: compute them all.
            return [], 0
        hashes = self._page_hashes(req)
        max_pages = (req.num_tokens - 1) // self.page_size
        hits: list[Page] = []
        for page_hash in hashes[:max_pages]:
            page = self.pool.get_cached_page(page_hash)
            if page is None:
                break
            hits.append(page)
        return hits, len(hits) * self.page_size

    def count_admission(self, req: Request, num_cached_tokens: int) -> None:
        """The prefix cache's counters, once per admission (a request the scheduler looks at and
        passes over counts when it is admitted): its tokens queried, `num_cached_tokens` of them
        hits (on the device or landed from the tiers; a split's loaded pages count when it joins them)."""
        self.prefix_queries += req.num_tokens
        self.prefix_hits += num_cached_tokens
        missed = self.tier_misses.pop(req.request_id, None)
        if missed is not None:
            self.offload.record_lookup(missed)

    def load_from_tiers(self, req: Request, device_hits: list[Page], overlapped: bool = False) -> list[Page] | None:
        """Load the pages of `req`'s prefix that follow its device hits from the offload tiers.
        Returns the request's prefix hits on the device after it: `device_hits`, extended by the
        pages that landed at once (CPU tier: their copies finish on the device before the next
        step runs); None while a load from disk or Redis is under way: the request waits for
        it (`is_loading`), then is admitted with those pages as device hits. Once per load: the
        admission after it does not look below the device again. A prefix that starts on disk
        or in Redis is split instead where the pool holds it: the request is admitted at once,
        computes it up to a cut (`split_limit`, `compute_limit`) and joins there the pages that
        loaded meanwhile. `overlapped`: other requests run in the step being scheduled, so a
        host-memory load that would hold it up waits for a later one (`OffloadManager.start_load`)."""
        if self.offload is None or not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return device_hits
        if self.offload.has_loaded(req.request_id):
            return device_hits
        self.tier_misses.pop(req.request_id, None)  # an earlier look, passed over: this one counts instead
        max_pages = (req.num_tokens - 1) // self.page_size
        lookup = self.offload.lookup(self._page_hashes(req)[len(device_hits):max_pages])
        num_other_pages = -(-req.num_tokens // self.page_size) - len(device_hits) - len(lookup)
        tokens = self._page_tokens(req, len(device_hits), len(device_hits) + len(lookup))
        if len(lookup) and self.offload.start_split_load(req.request_id, device_hits, lookup, num_other_pages, tokens):
            return device_hits  # admitted now: it computes its prefix's front while the rest loads
        if not len(lookup) or not self.offload.start_load(req.request_id, device_hits, lookup, overlapped, tokens):
            # What was found but not loaded is recomputed: the tiers' misses, counted on admission.
            self.tier_misses[req.request_id] = lookup.missed()
            return device_hits
        if self.offload.has_loaded(req.request_id):
            return self.offload.held_pages(req.request_id)
        return None

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step's device time (at most), for where split loads cut (`OffloadManager.observe_step`)."""
        if self.offload is not None:
            self.offload.observe_step(num_tokens, seconds)

    def split_limit(self, req: Request) -> int | None:
        """Tokens a request admitted with a split load may compute before the cut (None: no split)."""
        limit = self.offload.split_limit(req.request_id) if self.offload is not None else None
        return None if limit is None else limit * self.page_size

    def compute_limit(self, req: Request) -> int | None:
        """A running request with a split load: before the cut, the tokens it may have computed
        after this step; at the cut, it waits for its pages while `split_ready` says so, then
        joins those that landed (computing the others itself), and has no limit from then on
        (None)."""
        cut = self.split_limit(req)
        if cut is None:
            return None
        if cut > req.num_computed_tokens or not self.offload.split_ready(req.request_id, req.num_steps_in_flight > 0):
            return cut  # before the cut, or waiting there for the pages to land
        self._join(req, self.offload.take_split(req.request_id))
        return None

    def give_up_split(self, req: Request) -> None:
        """The request was not admitted after all: its split's pages go back."""
        if self.offload is not None:
            self.offload.cancel_split(req.request_id)

    def _join(self, req: Request, pages: list[Page]) -> None:
        """Loaded pages (cached, one reference each, now the request's) follow its computed ones."""
        rid = req.request_id
        assert len(self.req_pages[rid]) * self.page_size == req.num_computed_tokens, rid
        self.req_pages[rid].extend(pages)
        self.req_page_ids[rid].extend(p.page_id for p in pages)
        self.num_registered[rid] = len(self.req_pages[rid])
        joined = len(pages) * self.page_size
        req.num_computed_tokens += joined
        req.num_cached_tokens += joined
        self.prefix_hits += joined

    def release_loaded_pages(self, but: Request | None = None) -> bool:
        """The pool ran short: give back the pages held for loaded requests not admitted yet
        (except `but`'s); they stay cached. Whether any were held."""
        return self.offload is not None and self.offload.release_held(but=but.request_id if but else None)

    def is_loading(self, req: Request) -> bool:
        return self.offload is not None and self.offload.is_loading(req.request_id)

    def poll_offload(self) -> None:
        """Finished offload copies give their pages back; finished loads become prefix hits."""
        if self.offload is not None:
            self.offload.poll()

    def launch_stores(self) -> None:
        """After a step is launched: its newly full pages go down to the tiers."""
        if self.offload is not None:
            self.offload.launch_stores()

    # --- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, computed_pages: list[Page] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        `computed_pages` are prefix-cache hits found for a request being scheduled from the
        waiting queue. Returns False (and changes nothing) when the pool is too small."""
        if not computed_pages:
            # The common decode step: the token fits in the last page and fills no page to cache.
            pages = self.req_pages.get(req.request_id)
            total = req.num_computed_tokens + num_new_tokens
            if (pages is not None and total <= len(pages) * self.page_size
                    and (not self.enable_caching or total // self.page_size <= self.num_registered.get(req.request_id, 0))):
                return True
        computed_pages = computed_pages or []
        pages = self.req_pages.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_pages) * self.page_size
        num_needed = -(-(num_computed + num_new_tokens) // self.page_size)
        num_to_allocate = num_needed - len(pages) - len(computed_pages)
        if not self.pool.has_room(computed_pages, num_to_allocate):
            return False
        self.pool.touch(computed_pages)
        pages = self.req_pages.setdefault(req.request_id, [])
        page_ids = self.req_page_ids.setdefault(req.request_id, [])
        pages.extend(computed_pages)
        if computed_pages:
            self.num_registered[req.request_id] = len(pages)
        if num_to_allocate > 0:
            pages.extend(self.pool.get_new_pages(num_to_allocate))
        page_ids.extend(p.page_id for p in pages[len(page_ids):])
        self._register_full_pages(req, num_computed + num_new_tokens)
        if computed_pages and self.offload is not None:
            self.offload.release_held(req.request_id)  # the request holds its loaded pages itself now
        return True

    def _register_full_pages(self, req: Request, num_tokens_after_step: int) -> None:
        if not self.enable_caching:
            return
        pages = self.req_pages[req.request_id]
        hashes = self._page_hashes(req)
        start = self.num_registered.get(req.request_id, 0)
        end = min(num_tokens_after_step // self.page_size, len(hashes))
        run = None  # the first page of the run of newly registered pages (KV events)
        # What the tiers' KV events will say of these pages (events on).
        tokens = self._page_tokens(req, start, end) if self.offload is not None else None
        for i in range(start, end + 1):
            if i < end and self.pool.cache_page(pages[i], hashes[i]):
                if self.offload is not None:
                    self.offload.queue_store(pages[i], hashes[i], tokens[i - start] if tokens else None)
                if run is None:
                    run = i
            elif run is not None and self.pool.events is not None:
                self.pool.record_stored(hashes[run:i], hashes[run - 1] if run else None,
                                        req.all_token_ids[run * self.page_size:i * self.page_size], self.page_size,
                                        req.lora_request)
                run = None
        self.num_registered[req.request_id] = max(start, end)

    def free(self, req: Request) -> None:
        if self.offload is not None:
            self.offload.release_held(req.request_id)
            self.offload.cancel_split(req.request_id)
        pages = self.req_pages.pop(req.request_id, [])
        self.req_page_ids.pop(req.request_id, None)
        self.pool.free_pages(reversed(pages))
        self.num_registered.pop(req.request_id, None)

    def trim(self, req: Request) -> None:
        """Free the request's pages past its computed tokens: those that only drafted tokens it
        refused took (speculative decoding). None of them is in the prefix cache, which holds
        only pages full of a request's known tokens."""
        pages = self.req_pages.get(req.request_id)
        keep = -(-req.num_computed_tokens // self.page_size)
        if pages is None or len(pages) <= keep:
            return
        assert self.num_registered.get(req.request_id, 0) <= keep, req.request_id
        surplus = pages[keep:]
        del pages[keep:]
        del self.req_page_ids[req.request_id][keep:]
        self.pool.free_pages(reversed(surplus))

    def forget(self, req: Request) -> None:
        """Drop a finished request's bookkeeping (its hashes) after `free`."""
        self.req_hashes.pop(req.request_id, None)
        self.tier_misses.pop(req.request_id, None)
        if self.offload is not None:
            self.offload.forget_request(req.request_id)

    # --- views --------------------------------------------------------------------------------
    def page_ids(self, request_id: str) -> list[int]:
        """The request's page ids in order (the manager's own list: read it, do not change it)."""
        return self.req_page_ids.get(request_id, [])

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

"""The engine core's side of the KV tiers: what goes down, what comes back up, and the counters.

Store: a page that becomes full and is registered in the prefix cache is queued (`queue_store`)
for every tier that lacks its key; after the step that writes it is launched, `launch_stores`
hands the batch to every rank (`Worker.kv_offload_store`). The page keeps one extra reference
until every rank has copied it off the device, so it cannot be handed out and overwritten under
the copy. Each key is written once per tier: the CPU and disk indexes know what they hold (and
what is on its way), and the remote tier remembers the keys this engine wrote or saw there.

Load: `lookup` walks a waiting request's pages after its device prefix hits, tier by tier (CPU,
disk, then Redis in one round trip), as far as the pages run unbroken; `start_load` takes device
pages for them and asks every rank to fill them (`Worker.kv_offload_load`). Pages that all come
from host memory land at once: they are registered in the prefix cache and the request is
admitted in the same schedule, while every rank's next step waits on the device for the copies
(a read from host memory cannot fail). Other loads make the request wait (other requests keep
running); once every rank has finished (`poll`), the leading pages that arrived intact on every
rank are registered in the prefix cache and the request is admitted on a later schedule like
any prefix hit. So does a host-memory load whose copies would hold up a step of other requests
(`_copy_outlasts_step`: they take half a decode step or more): the step in flight and the next
one run on beside the copies. Until then the request keeps its pages (and its device hits)
held, so that the requests admitted meanwhile cannot evict them; when the pool runs short, those
holds are the first thing given up (`release_held`), before any running request is preempted. A page
that failed (corrupt, truncated, another fingerprint, Redis gone) and all after it are
recomputed instead. Every page a load or store holds is given back when it finishes or is
released, whatever happened, so the pool never leaks. Pages that came up from disk or Redis
are then queued to go down like newly computed ones: promoted into the CPU tier (and a Redis
hit onto disk), so that their next reuse is a host-memory hit.

The CPU tier's slots are handed to one store's pages as runs of consecutive slots
(`TierIndex.insert_many`), so that a conversation's pages, stored together, come back up in a
few large host→device copies.

The tiers are inclusive and share the keys (chained page hashes), so a remote tier is shared by
every replica of a service whose fingerprint matches (same model, weights, dtype, page size, KV
layout and parallel rank).

With KV events on (`--kv-events-config`), the tiers report into the pool's events as vLLM's
offloading connector does: a page stored in host memory is a `BlockStored` of medium "CPU" once
every rank has copied it, one on disk a `BlockStored` of medium "STORAGE" once every rank has
written it, with the token ids, parent hash and adapter the request gave (`PageTokens`, carried
by the store); a page a tier evicts or finds corrupt is a `BlockRemoved` of that medium; a page
loaded back into the pool is a "GPU" `BlockStored`, its tokens from the request that loads it.
The remote tier reports nothing: Redis evicts on its own without telling, and every replica
reads it, so it is no pod's cache. Pages a previous run left on disk are not announced (their
tokens are not kept); they are once loaded.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from pagoda_engine.core.kv.block_pool import BlockPool, Page, PageTokens
from pagoda_engine.core.kv.offload.index import TierEntry, TierIndex
from pagoda_engine.kv_event_wire import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from pagoda_engine.kv_tiers import CPU, DISK, REMOTE, TIERS, OffloadEvents, OffloadSetup, OffloadStarted
from pagoda_engine.messages import KV_OFFLOAD_LOAD_BUCKETS, KVOffloadTierStats

logger = logging.getLogger(__name__)

_GiB = 1 << 30
# The remote tier remembers this many keys it wrote or saw, to write each once.
_REMOTE_KNOWN_KEYS = 1 << 20
# Where a split load cuts (`OffloadManager.start_split_load`) comes from two estimates, each a
# moving average (this weight for a new observation): a load's seconds per page from each tier,
# and a prefill's seconds per token (long steps, measured by the core).
_ESTIMATE_EMA = 0.3
_PREFILL_MIN_TOKENS = 1024  # steps at least this long estimate the prefill's cost per token
_SMALL_STEP_MAX_TOKENS = 64  # steps at most this long estimate what the step a split adds costs
_SMALL_STEP_SAMPLES = 8  # ... as the least of this many recent ones
# A split whose loaded pages would save less than this many of those steps, or would be less
# than this share of what the tiers hold, recomputes instead (the step the split adds, and a
# load that lands late, would cost more than it saves), except every `_PROBE_EVERY`th such
# time, which loads half of them to measure the tier again. On an H100 with Redis at 0.4-1 GB/s
# the cut loaded 7-10 % of a 4,096-token prefix, whose load landed after the cut more often than not.
_MIN_SAVED_STEPS = 2
_MIN_LOADED_SHARE = 0.2
_PROBE_EVERY = 4
# A tier's seconds per page: the median of its last `_LOAD_SAMPLES` loads of at least
# `_LOAD_SAMPLE_MIN_PAGES` pages. Smaller loads are mostly fixed cost, and one slow load (the
# first one's connections and pinned buffers, a busy moment) must not stop the splits that would
# measure it again; the least of them was too hopeful on an H100 with Redis on the same host
# (loads there vary 2 x, and a late one costs the wait at the cut, `split_ready`).
_LOAD_SAMPLES = 8
_LOAD_SAMPLE_MIN_PAGES = 16
# A host-memory load whose copies take at least this share of a small step is not awaited by the
# step it is started with (`_copy_outlasts_step`).
_DEFER_STEP_SHARE = 0.5
# Redis's INFO (capacity and usage of the remote tier) is read at most this often.
_REMOTE_INFO_EVERY_S = 10.0
# The KV-event medium of each tier that reports its pages (the remote tier reports none).
_MEDIUM = {CPU: MEDIUM_CPU, DISK: MEDIUM_STORAGE}


def kv_fingerprint(model_dir: str, load_format: str, seed: int, dtype: str, page_size: int, layout: str,
                   quantization: str | None = None) -> bytes:
    """What makes two engines' KV bytes interchangeable, before each rank's own coordinates:
    the model's config.json and weight files (names and sizes; dummy weights: their seed), the
    dtype, the weights' quantization on load (`--quantization fp8` computes other K and V from the
    same files), the page size and the KV layout."""
    h = hashlib.blake2b(b"pagoda-kv-v1", digest_size=16)
    root = Path(model_dir)
    config = root / "config.json"
    h.update(config.read_bytes() if config.is_file() else model_dir.encode())
    if load_format == "dummy":
        h.update(f"dummy weights, seed {seed}".encode())
    else:
        for path in sorted(root.glob("*.safetensors")):
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    h.update(f"{dtype} page {page_size} {layout}".encode())
    if quantization is not None:
        h.update(f"weights quantized to {quantization}".encode())
    return h.digest()


@dataclass
class TierCounters:
    hit_tokens: int = 0
    miss_tokens: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    errors: int = 0
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(KV_OFFLOAD_LOAD_BUCKETS) + 1))
    load_sum: float = 0.0

    def observe_load(self, seconds: float) -> None:
        for i, bound in enumerate(KV_OFFLOAD_LOAD_BUCKETS):
            if seconds <= bound:
                self.load_buckets[i] += 1
        self.load_buckets[-1] += 1
        self.load_sum += seconds


@dataclass(eq=False)
class _Store:
    pages: list[Page]  # one reference each, until every rank has copied them
    cpu: list[TierEntry | None]
    disk: list[TierEntry | None]
    remote: list[bytes | None]
    tokens: list[PageTokens | None]  # what the KV events say of each page (None: events off)
    copied: int = 0  # ranks done copying
    written: int = 0  # ranks done writing to disk / Redis
    failed_disk: set[bytes] = field(default_factory=set)
    remote_ok: bool = True


@dataclass(eq=False)
class Load:
    request_id: str
    held: list[Page]  # the request's device hits and the pages being filled: one reference each
    pages: list[Page]  # the pages being filled, in prefix order
    hashes: list[bytes]
    tiers: list[str]  # where each page comes from
    pinned: list[tuple[TierIndex, TierEntry]]
    started: float
    tokens: list[PageTokens] | None = None  # what the KV events say of each page (None: events off)
    ranks: int = 0
    ok: int = 1 << 62  # leading pages intact on every rank so far
    seconds: float = 0.0  # the slowest rank's reads and copies (what the split's cut estimates)
    landed: bool = False  # its pages are in the prefix cache (CPU-tier loads: as soon as they start)


@dataclass(eq=False)
class _Split:
    """A running request's prefix: computed up to `cut` while the pages after it load."""

    cut: int  # the request's page index where the loaded pages start
    load_id: int
    landed: list[Page] | None = None  # once landed: the pages that arrived, held for the request
    waiting_since: float | None = None  # when the request reached its cut with the load still running


@dataclass
class Lookup:
    """Where a request's pages after its device hits are: tiers[i] for page i, unbroken."""

    hashes: list[bytes]
    tiers: list[str]
    num_queried: int  # pages looked up below the device

    def __len__(self) -> int:
        return len(self.tiers)

    def missed(self) -> "Lookup":
        """The same lookup with nothing found (its hits were not used)."""
        return Lookup([], [], self.num_queried)


class OffloadManager:
    def __init__(self, pool: BlockPool, page_size: int, executor, setup: OffloadSetup, disk_pages: int,
                 page_bytes: int, split_loads: bool = True, open_remote: Callable | None = None):
        """`page_bytes`: one page's bytes over every rank. `setup` goes to every rank.
        `split_loads`: `start_split_load` may split a load (--kv-offload-split-loads).
        `open_remote(url, fingerprint)`: the remote tier's store (`worker.kv_stores.remote_store`),
        handed in by whoever builds the manager, which owns no store of its own; needed when
        `setup.remote_url` is set."""
        self.pool = pool
        self.page_size = page_size
        self.executor = executor
        self.page_bytes = page_bytes
        self.split_loads = split_loads
        self.cpu = TierIndex(setup.num_cpu_slots, with_slots=True) if setup.num_cpu_slots else None
        self.disk = TierIndex(disk_pages) if setup.disk_path else None
        self.remote_url = setup.remote_url
        started: list[OffloadStarted] = executor.collective_rpc("init_kv_offload", setup)
        self.remote = open_remote(setup.remote_url, started[0].fingerprint) if setup.remote_url else None
        self.remote_known: dict[bytes, None] = {}  # insertion-ordered: the oldest go first
        self._remote_memory: tuple[int, int] = (0, 0)
        self._remote_memory_at = -1e9
        self.counters = {tier: TierCounters() for tier in self.tiers}
        self._rank_errors: list[dict[str, int]] = [{} for _ in started]
        self._rank_copies: list[list[float]] = [[] for _ in started]
        self._queued: list[tuple[Page, bytes, PageTokens | None]] = []
        self._stores: dict[int, _Store] = {}
        self._loads: dict[int, Load] = {}
        self._loading: dict[str, int] = {}  # request id -> load id
        self._held: dict[str, list[Page]] = {}  # requests whose load finished: their pages, held until admitted
        self._splits: dict[str, _Split] = {}  # running requests computing a prefix up to a cut while the rest loads
        self._page_load_s: dict[str, float] = {}  # deepest tier read -> a load's seconds per page
        self._load_samples: dict[str, deque[float]] = {}  # deepest tier read -> recent seconds per page
        self._token_prefill_s: float | None = None  # a prefill's seconds per token
        self._small_step_s: float | None = None  # a step of a few tokens' seconds: the least of the last few
        self._small_steps: deque[float] = deque(maxlen=_SMALL_STEP_SAMPLES)
        self._not_worth = 0  # splits that recomputed all because loading would not pay
        self._ids = 0
        self._disk_deletes: list[bytes] = []
        self.world_size = len(started)
        if self.disk is not None:
            self._reopen_disk(started)
        logger.info("KV offload tiers: %s", ", ".join(f"{t} {self.capacity_bytes(t) / _GiB:.2f} GiB"
                                                      if t != REMOTE else f"remote {self.remote.label}"
                                                      for t in self.tiers))

    @property
    def tiers(self) -> list[str]:
        return [t for t, on in ((CPU, self.cpu), (DISK, self.disk), (REMOTE, self.remote_url)) if on is not None]

    def _reopen_disk(self, started: list[OffloadStarted]) -> None:
        """Index the entries a previous run left on every rank's disk (oldest first, as LRU)."""
        on_every_rank = set.intersection(*({k for k, _ in s.disk_entries} for s in started))
        for key, _ in started[0].disk_entries:
            if key not in on_every_rank:
                continue
            entry, evicted = self.disk.insert(key, ready=True)
            self._disk_deletes += [e.key for e in evicted]
        for s in started:
            self._disk_deletes += [k for k, _ in s.disk_entries if k not in on_every_rank]
        if len(self.disk):
            logger.info("KV offload: reopened %d pages on disk", len(self.disk))

    # --- store ------------------------------------------------------------------------------------

    def queue_store(self, page: Page, page_hash: bytes, tokens: PageTokens | None = None) -> None:
        """A page just registered in the prefix cache: it goes down after this step is launched.
        `tokens`: what the tiers' KV events say of it (None: events off)."""
        self._queued.append((page, page_hash, tokens))

    def launch_stores(self) -> None:
        if not self._queued and not self._disk_deletes:
            return
        queued, self._queued = self._queued, []
        # Pages freed and handed out again before this step was launched have another hash now.
        live = list({key: (page, tokens) for page, key, tokens in queued if page.page_hash == key}.items())
        chain = [key for key, _ in live]  # in prefix order
        cpu: dict[bytes, TierEntry | None] = {}
        if self.cpu is not None:
            new = [key for key in chain if key not in self.cpu]
            entries, evicted = self.cpu.insert_many(new)  # one store's pages: as few slot runs as fit
            cpu = dict(zip(new, entries))
            self._removed(CPU, evicted)
            self.cpu.touch_chain(chain)
        pages, cpu_entries, disk, remote, page_tokens, evicted_files = [], [], [], [], [], []
        for key, (page, tokens) in live:
            c = cpu.get(key)
            d = r = None
            if self.disk is not None and key not in self.disk:
                d, evicted = self.disk.insert(key)
                self._removed(DISK, evicted)
                evicted_files += [e.key for e in evicted]
            if self.remote is not None and key not in self.remote_known:
                r = key
                self._remember_remote(key)
            if c is None and d is None and r is None:
                continue
            if c is not None and (d is not None or r is not None):
                self.cpu.pin(c)  # the slot is read by the writes below it
            pages.append(page)
            cpu_entries.append(c)
            disk.append(d)
            remote.append(r)
            page_tokens.append(tokens)
        if self.disk is not None:
            self.disk.touch_chain(chain)
        deletes, self._disk_deletes = self._disk_deletes + evicted_files, []
        if not pages and not deletes:
            return
        self._ids += 1
        self.pool.touch(pages)
        self._stores[self._ids] = _Store(pages, cpu_entries, disk, remote, page_tokens)
        self.executor.call("kv_offload_store", self._ids, [p.page_id for p in pages],
                           [e.slot if e is not None else -1 for e in cpu_entries],
                           [e.key if e is not None else None for e in disk], remote, deletes)

    def _announce(self, tier: str, entries: list[TierEntry], tokens: list[PageTokens | None]) -> None:
        """Tier entries whose bytes every rank now holds: a `BlockStored` of the tier's medium
        for those whose tokens are known (KV events on)."""
        known = [(e, t) for e, t in zip(entries, tokens) if t is not None]
        if known and self.pool.events is not None:
            for entry, _ in known:
                entry.announced = True
            self.pool.record_pages_stored([e.key for e, _ in known], [t for _, t in known], _MEDIUM[tier])

    def _removed(self, tier: str, entries: list[TierEntry]) -> None:
        """Tier entries evicted or dropped: a `BlockRemoved` of the tier's medium for those announced."""
        gone = [e.key for e in entries if e.announced]
        if gone:
            self.pool.record_removed(gone, _MEDIUM[tier])

    def _remember_remote(self, key: bytes) -> None:
        self.remote_known[key] = None
        if len(self.remote_known) > _REMOTE_KNOWN_KEYS:
            del self.remote_known[next(iter(self.remote_known))]

    # --- lookup and load --------------------------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> Lookup:
        """The unbroken run of `hashes` (a request's pages after its device hits) the tiers hold."""
        tiers: list[str] = []
        for key in hashes:
            if self.cpu is not None and self.cpu.get(key) is not None:
                tiers.append(CPU)
            elif self.disk is not None and self.disk.get(key) is not None:
                tiers.append(DISK)
            else:
                break
        for index in (self.cpu, self.disk):
            if index is not None:
                index.touch_chain(hashes[:len(tiers)])
        rest = hashes[len(tiers):]
        if rest and self.remote is not None:
            for key, found in zip(rest, self.remote.exists(rest)):
                if not found:
                    break
                tiers.append(REMOTE)
                self._remember_remote(key)
        return Lookup(hashes[:len(tiers)], tiers, len(hashes))

    def record_lookup(self, lookup: Lookup) -> None:
        """Count a lookup's hits and misses per tier, in tokens (once per admission or load)."""
        queried = lookup.num_queried
        for tier in self.tiers:
            hits = lookup.tiers.count(tier)
            self.counters[tier].hit_tokens += hits * self.page_size
            self.counters[tier].miss_tokens += (queried - hits) * self.page_size
            queried -= hits

    def start_load(self, request_id: str, device_hits: list[Page], lookup: Lookup, overlapped: bool = False,
                   tokens: list[PageTokens] | None = None) -> bool:
        """Take device pages for `lookup`'s pages and start filling them; False (nothing taken)
        when the pool has too few free pages.

        Pages that all come from the CPU tier land at once as far as the core is concerned:
        they are registered in the prefix cache and held for the request now (`has_loaded`),
        and every rank's next step waits on the device for their copies (`KVOffloader.load`
        with `awaited`), so the request is admitted in this very schedule instead of a step or
        two after its copies are seen done. Host memory cannot fail a read, so all of them
        arrive. Pages from disk or Redis are read by threads that may fail: the request waits
        for them (`is_loading`) and is admitted on a later schedule. So does a CPU-tier load
        `overlapped` by other requests' work in this step whose copies would hold that step up
        (`_copy_outlasts_step`): its copies run beside the step in flight and the next one,
        the first poll after them lands it, and the step after that poll waits for what is left.
        `tokens`: what the KV events say of each of the lookup's pages (None: events off)."""
        if not self.pool.has_room(device_hits, len(lookup)):
            return False
        self.pool.touch(device_hits)
        self.record_lookup(lookup)
        at_once = (all(tier == CPU for tier in lookup.tiers)
                   and not (overlapped and self._copy_outlasts_step(len(lookup))))
        load_id, load = self._load(request_id, lookup.hashes, lookup.tiers, at_once, tokens)
        load.held[:0] = device_hits
        if at_once:
            self._held[request_id] = self._land(load, len(load.pages), claimed=True)
        else:
            self._loading[request_id] = load_id
        return True

    def _copy_outlasts_step(self, num_pages: int) -> bool:
        """Whether copying `num_pages` up from host memory, at the speed the ranks timed on the
        device so far, takes `_DEFER_STEP_SHARE` of a small step or more (False before either
        was measured, and without CUDA). Awaited by the step it is started with, such a load
        holds up every running request: it starts while the step in flight has part of its
        time left, and the copies outlast that."""
        copies = self.copy_stats()
        if not copies or not copies[0] or self._small_step_s is None:
            return False
        seconds = num_pages * self.page_bytes / self.world_size * copies[1] / copies[0]
        return seconds >= _DEFER_STEP_SHARE * self._small_step_s

    def start_split_load(self, request_id: str, device_hits: list[Page], lookup: Lookup, num_new_pages: int,
                         tokens: list[PageTokens] | None = None) -> bool:
        """Compute the front of `lookup`'s pages while the rest loads: the request is admitted
        now and computes up to a cut while the pages after it load (`split_limit`); at the cut
        it joins them if they have landed, else it computes them too (`compute_limit`), so a
        prefix costs at most about its recompute. The cut balances the two from what was
        measured: a load's seconds per page from the deepest tier the lookup reads and the
        prefill's seconds per token, so that both end together (half and half before either
        was measured). When what would load saves less compute than the step the split adds
        (`_worth_loading`), the request computes everything, but every `_PROBE_EVERY`th time it
        loads half anyway, which measures the tier again. As in Cake ("Compute or load KV cache? Why not
        both?", 2024), with one cut instead of chunks from both ends: a prefill cut in small
        chunks costs far more than in one step.
        False (nothing taken, nothing decided) unless split loads are on, the lookup starts
        below host memory and spans two pages or more, and the pool holds its pages and
        `num_new_pages` more for the request's other tokens. `tokens`: as for `start_load`."""
        if (not self.split_loads or len(lookup) < 2 or lookup.tiers[0] == CPU
                or not self.pool.has_room(device_hits, len(lookup) + num_new_pages)):
            return False
        cut = self._split_cut(lookup)
        self.record_lookup(lookup)  # what the tiers held, whether loaded or computed in the end
        if not self._worth_loading(len(lookup) - cut, len(lookup)):
            self._not_worth += 1
            if self._not_worth % _PROBE_EVERY:
                return True  # the request computes it all, as if nothing had been found
            cut = len(lookup) // 2  # a probe: a load this size measures the tier's speed
        self.pool.touch(device_hits)  # free hits must not be handed out as the loading pages
        load_id, _ = self._load(request_id, lookup.hashes[cut:], lookup.tiers[cut:], False,
                                tokens[cut:] if tokens is not None else None)
        self.pool.free_pages(reversed(device_hits))  # still cached: the admission takes them next
        self._splits[request_id] = _Split(len(device_hits) + cut, load_id)
        return True

    def _split_cut(self, lookup: Lookup) -> int:
        """How many of the lookup's pages to compute before the loaded ones (`start_split_load`)."""
        n = len(lookup)
        load_s = self._page_load_s.get(max(lookup.tiers, key=TIERS.index))
        if load_s is None or self._token_prefill_s is None:
            return n // 2
        t_load, t_compute = n * load_s, n * self.page_size * self._token_prefill_s
        return min(max(1, round(n * t_load / (t_load + t_compute))), n - 1)

    def _worth_loading(self, num_pages: int, num_found: int) -> bool:
        """Whether loading the last `num_pages` of the `num_found` a split's lookup found saves
        more than the step the split adds (the request stops at the cut and joins them on the
        next schedule)."""
        return (num_pages >= _MIN_LOADED_SHARE * num_found
                and (self._token_prefill_s is None or self._small_step_s is None
                     or num_pages * self.page_size * self._token_prefill_s >= _MIN_SAVED_STEPS * self._small_step_s))

    def observe_load_speed(self, tier: str, num_pages: int, seconds: float) -> None:
        """A load from `tier` brought `num_pages` in `seconds` of the ranks' own time (the core
        polls between steps, which would add up to a step): the tier's seconds per page."""
        if num_pages >= _LOAD_SAMPLE_MIN_PAGES:
            samples = self._load_samples.setdefault(tier, deque(maxlen=_LOAD_SAMPLES))
            samples.append(seconds / num_pages)
            self._page_load_s[tier] = statistics.median(samples)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` took at most `seconds` on the device: long ones estimate the
        prefill's cost per token, short ones what a step costs at least."""
        if seconds <= 0:
            return
        if num_tokens >= _PREFILL_MIN_TOKENS:
            self._token_prefill_s = _ema(self._token_prefill_s, seconds / num_tokens)
        elif num_tokens <= _SMALL_STEP_MAX_TOKENS:
            # The least: the step after a split's join waits for the load's copies on the device.
            self._small_steps.append(seconds)
            self._small_step_s = min(self._small_steps)

    def _load(self, request_id: str, hashes: list[bytes], tiers: list[str], at_once: bool,
              tokens: list[PageTokens] | None) -> tuple[int, Load]:
        """Take device pages for these keys and ask every rank to fill them from `tiers`."""
        pages = self.pool.get_new_pages(len(hashes))
        pinned, sources = [], []
        for key, tier in zip(hashes, tiers):
            if tier == REMOTE:
                sources.append((REMOTE, key))
                continue
            index = self.cpu if tier == CPU else self.disk
            entry = index.get(key)
            index.pin(entry)
            pinned.append((index, entry))
            sources.append((tier, entry.slot if tier == CPU else key))
        self._ids += 1
        load = Load(request_id, list(pages), pages, hashes, tiers, pinned, time.monotonic(), tokens)
        self._loads[self._ids] = load
        self.executor.call("kv_offload_load", self._ids, [p.page_id for p in pages], sources, at_once)
        return self._ids, load

    # --- split loads (`start_split_load`) ---------------------------------------------------------

    def split_limit(self, request_id: str) -> int | None:
        """The request's page index up to which it may compute before its split's cut (None: no split)."""
        split = self._splits.get(request_id)
        return None if split is None else split.cut

    def split_ready(self, request_id: str, cut_in_flight: bool) -> bool:
        """Whether the request, at its cut, takes its split now (`take_split`). While its pages
        still load it waits: through the step that computes up to the cut (`cut_in_flight`), and
        after it for as long as computing those pages would take (then it computes them)."""
        split = self._splits[request_id]
        if split.landed is not None:
            return True
        if cut_in_flight:
            return False
        now = time.monotonic()
        if split.waiting_since is None:
            split.waiting_since = now
        loading = len(self._loads[split.load_id].pages)  # not landed: its load is still under way
        compute_s = loading * self.page_size * (self._token_prefill_s or 0.0)
        return now - split.waiting_since >= compute_s

    def take_split(self, request_id: str) -> list[Page] | None:
        """At its cut, the request takes its split's pages that landed (the caller owns their
        references from now on): none while they are still loading (it computes them itself,
        and they land unclaimed: given back, cached). None: the request has no split."""
        split = self._splits.pop(request_id, None)
        if split is None:
            return None
        return split.landed or []

    def cancel_split(self, request_id: str) -> None:
        """The request stopped running (finished, aborted, preempted) or was not admitted: pages
        that landed for it are given back (cached); a load still running lands unclaimed."""
        split = self._splits.pop(request_id, None)
        if split is not None and split.landed:
            self.pool.free_pages(reversed(split.landed))

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    def has_loaded(self, request_id: str) -> bool:
        """Whether the request's load finished and its pages are held for its admission."""
        return request_id in self._held

    def held_pages(self, request_id: str) -> list[Page]:
        """The pages held for a loaded request: its device hits, then the pages loaded after them."""
        return list(self._held[request_id])

    def release_held(self, request_id: str | None = None, but: str | None = None) -> bool:
        """Give back the pages held for `request_id` (None: for every request except `but`);
        they stay in the prefix cache. Whether any were held."""
        ids = [request_id] if request_id is not None else [r for r in self._held if r != but]
        released = False
        for rid in ids:
            pages = self._held.pop(rid, None)
            if pages is not None:
                self.pool.free_pages(reversed(pages))
                released = True
        return released

    def forget_request(self, request_id: str) -> None:
        """A request that finished or was aborted: a load in flight for it completes unclaimed."""
        self._loading.pop(request_id, None)
        self.release_held(request_id)

    # --- completion -------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Copies or loads in flight (pages held for admissions do not count)."""
        return bool(self._stores or self._loads)

    def poll(self) -> None:
        """Collect what every rank finished; give back the pages it held."""
        if not self.busy:
            return
        for rank, events in enumerate(self.executor.collective_rpc("kv_offload_poll")):
            self._apply(rank, events)

    def _apply(self, rank: int, events: OffloadEvents) -> None:
        self._rank_errors[rank] = events.errors
        self._rank_copies[rank] = events.copy
        for tier, key in events.bad:
            if tier == REMOTE:
                self.remote_known.pop(key, None)  # written again by the next engine that computes it
            else:
                entry = (self.cpu if tier == CPU else self.disk).discard(key)
                if entry is not None:
                    self._removed(tier, [entry])
        for store_id in events.copied:
            store = self._stores[store_id]
            store.copied += 1
            if store.copied == self.world_size:
                self.pool.free_pages(reversed(store.pages))
                store.pages = []
                for entry in store.cpu:
                    if entry is not None:
                        entry.ready = True
                        self.counters[CPU].stored_bytes += self.page_bytes
                self._announce(CPU, *_present(store.cpu, store.tokens))
        for store_id, failed_disk, remote_ok in events.written:
            store = self._stores[store_id]
            store.written += 1
            store.failed_disk.update(failed_disk)
            store.remote_ok &= remote_ok
            if store.written == self.world_size:
                self._finish_store(store_id, store)
        for load_id, ok, seconds in events.loaded:
            load = self._loads[load_id]
            load.ranks += 1
            load.ok = min(load.ok, ok)
            load.seconds = max(load.seconds, seconds)
            if load.ranks == self.world_size:
                self._finish_load(load_id, load)

    def _finish_store(self, store_id: int, store: _Store) -> None:
        del self._stores[store_id]
        if store.failed_disk:
            self._disk_full(len(store.failed_disk))
        written, written_tokens = [], []
        for c, d, r, tokens in zip(store.cpu, store.disk, store.remote, store.tokens):
            if c is not None and (d is not None or r is not None):
                self.cpu.unpin(c)
            if d is not None:
                if d.key in store.failed_disk:
                    self.disk.discard(d.key)
                else:
                    d.ready = True
                    self.counters[DISK].stored_bytes += self.page_bytes
                    written.append(d)
                    written_tokens.append(tokens)
            if r is not None:
                if store.remote_ok:
                    self.counters[REMOTE].stored_bytes += self.page_bytes
                else:
                    self.remote_known.pop(r, None)
        if written:
            self._announce(DISK, written, written_tokens)
        if self.disk is not None and len(self.disk) > self.disk.capacity:
            # The tier shrank while some of its entries were still arriving (they could not be evicted then).
            evicted = self.disk.evict_over_capacity()
            self._removed(DISK, evicted)
            self._disk_deletes += [e.key for e in evicted]

    def _disk_full(self, num_failed: int) -> None:
        """Disk writes failed (the file system is fuller than the tier's size allows, or failing):
        the tier holds fewer pages from now on, so that later writes evict old pages instead."""
        before = self.disk.capacity
        self.disk.capacity = max(1, min(before, len(self.disk) - num_failed - 1))
        logger.warning("KV offload: %d disk writes failed; the disk tier now holds at most %d pages (was %d), "
                       "evicting the least recently used", num_failed, self.disk.capacity, before)

    def _finish_load(self, load_id: int, load: Load) -> None:
        """Every rank has its copies done: unpin the sources, count the load and, unless it
        landed when it started (CPU tier), land it now."""
        del self._loads[load_id]
        for index, entry in load.pinned:
            index.unpin(entry)
        ok = min(load.ok, len(load.pages))
        seconds = time.monotonic() - load.started
        for tier in set(load.tiers[:ok]):
            self.counters[tier].loaded_bytes += load.tiers[:ok].count(tier) * self.page_bytes
        deepest = max(load.tiers, key=TIERS.index)
        self.counters[deepest].observe_load(seconds)
        if load.landed:
            return
        self.observe_load_speed(deepest, ok, load.seconds)
        if ok < len(load.pages):
            logger.info("KV offload: load for %s got %d of %d pages; the rest is recomputed",
                        load.request_id, ok, len(load.pages))
        split = self._splits.get(load.request_id)
        if split is not None and split.load_id == load_id:
            split.landed = self._land(load, ok, claimed=True)
            return
        claimed = self._loading.get(load.request_id) == load_id
        if claimed:
            del self._loading[load.request_id]
        pages = self._land(load, ok, claimed)
        if claimed:
            self._held[load.request_id] = pages

    def _land(self, load: Load, ok: int, claimed: bool) -> list[Page]:
        """The load's first `ok` pages become prefix-cache pages. Returns what stays held for the
        request when it still `claimed` the load (its device hits, then those pages); the
        rest is given back."""
        load.landed = True
        tokens = load.tokens or [None] * ok
        cached, cached_tokens = [], []
        for page, key, tier, page_tokens in zip(load.pages[:ok], load.hashes[:ok], load.tiers[:ok], tokens):
            if self.pool.cache_page(page, key):
                cached.append(key)
                cached_tokens.append(page_tokens)
                if tier != CPU:  # promoted: the next reuse is a CPU hit (and a remote one lands on disk)
                    self.queue_store(page, key, page_tokens)
        if load.tokens is not None:
            self.pool.record_pages_stored(cached, cached_tokens, MEDIUM_GPU)  # the device's index sees them again
        keep = len(load.held) - len(load.pages) + ok if claimed else 0
        self.pool.free_pages(reversed(load.held[keep:]))
        held, load.held = load.held[:keep], []
        return held

    # --- stats ------------------------------------------------------------------------------------

    def capacity_bytes(self, tier: str) -> int:
        if tier == REMOTE:
            return self._remote_info()[0]
        index = self.cpu if tier == CPU else self.disk
        return index.capacity * self.page_bytes

    def usage_bytes(self, tier: str) -> int:
        if tier == REMOTE:
            return self._remote_info()[1]
        index = self.cpu if tier == CPU else self.disk
        return len(index) * self.page_bytes

    def _remote_info(self) -> tuple[int, int]:
        now = time.monotonic()
        if now - self._remote_memory_at >= _REMOTE_INFO_EVERY_S:
            self._remote_memory_at = now
            self._remote_memory = self.remote.memory() or self._remote_memory
        return self._remote_memory

    def copy_stats(self) -> list[float]:
        """Every rank's host<->device copies timed on the device: load bytes, load seconds, store
        bytes, store seconds (empty without CUDA)."""
        copies = [c for c in self._rank_copies if c]
        return [sum(c[i] for c in copies) for i in range(4)] if copies else []

    def stats(self) -> list[KVOffloadTierStats]:
        out = []
        for tier in self.tiers:
            c = self.counters[tier]
            errors = sum(r.get(tier, 0) for r in self._rank_errors)
            if tier == REMOTE:
                errors += self.remote.errors  # the core's own lookups
            out.append(KVOffloadTierStats(
                tier=tier, capacity_bytes=self.capacity_bytes(tier), usage_bytes=self.usage_bytes(tier),
                hit_tokens=c.hit_tokens, miss_tokens=c.miss_tokens, stored_bytes=c.stored_bytes,
                loaded_bytes=c.loaded_bytes, errors=errors, load_seconds_buckets=list(c.load_buckets),
                load_seconds_sum=c.load_sum))
        return out


def _present(entries: list[TierEntry | None], tokens: list[PageTokens | None]) -> tuple[list[TierEntry], list]:
    """The entries a store made in one tier (the pages it skipped there left out), with their tokens."""
    pairs = [(e, t) for e, t in zip(entries, tokens) if e is not None]
    return [e for e, _ in pairs], [t for _, t in pairs]


def _ema(average: float | None, value: float) -> float:
    return value if average is None else average + _ESTIMATE_EMA * (value - average)

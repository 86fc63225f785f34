"""Replica choice: the three routing policies, as pure functions of the candidates' load.

A policy sees `BackendView`s (URL, in-flight requests, engine-reported running/waiting, KV usage)
and an optional routing key; it returns one URL. No I/O, no clocks: tests drive it directly.

- round-robin: rotate over the candidates.
- least-load: fewest (waiting + running), KV usage breaks ties.
- prefix-aware: the replica that recently served the longest matching run of the prompt's leading
  pages, else a consistent-hash ring walk from the first page's hash; either way a replica is
  skipped while its load exceeds `load_factor` × the mean (consistent hashing with bounded loads,
  Mirrokni et al. 2018), so one hot prefix never floods one replica.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence

POLICIES = ("prefix-aware", "least-load", "round-robin")


@dataclass(frozen=True)
class BackendView:
    """What a policy may know about one ready replica."""

    url: str
    in_flight: int = 0  # requests this router has open on it
    running: float = 0.0  # pagoda:num_requests_running, last scrape
    waiting: float = 0.0  # pagoda:num_requests_waiting, last scrape
    kv_usage: float = 0.0  # pagoda:kv_cache_usage_perc, last scrape (0..1)

    @property
    def load(self) -> float:
        # The router's own count is fresh; the scraped one is up to a poll old but also counts
        # other routers' requests. The larger of the two is the better guess of both.
        return max(float(self.in_flight), self.running + self.waiting)


class Policy(Protocol):
    def choose(self, candidates: Sequence[BackendView], key: "PrefixKey | None") -> str: ...


@dataclass(frozen=True)
class PrefixKey:
    """Chained hashes of the prompt's leading pages (tokenizer-free: a page is `page_chars`
    characters, roughly the engine's 16-token page). page_hashes[i] covers pages 0..i."""

    page_hashes: tuple[bytes, ...]


def prefix_key(text: str, page_chars: int = 64, max_pages: int = 32) -> PrefixKey:
    """Hash the leading full pages of `text`. A prompt shorter than one page is one (partial)
    page, so short identical prompts still meet on one replica."""
    data = text.encode("utf-8", "surrogatepass")
    n_full = min(len(data) // page_chars, max_pages)
    hashes: list[bytes] = []
    parent = b""
    for i in range(max(n_full, 1)):
        page = data[i * page_chars:(i + 1) * page_chars]
        parent = hashlib.blake2b(parent + page, digest_size=8).digest()
        hashes.append(parent)
    return PrefixKey(tuple(hashes))


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[BackendView], key: PrefixKey | None = None) -> str:
        ordered = sorted(candidates, key=lambda b: b.url)
        url = ordered[self._next % len(ordered)].url
        self._next += 1
        return url


class LeastLoad:
    def choose(self, candidates: Sequence[BackendView], key: PrefixKey | None = None) -> str:
        return min(candidates, key=lambda b: (b.load, b.kv_usage, b.in_flight, b.url)).url


class PrefixAware:
    """Prefix affinity with bounded loads. `remember()`-ed prefixes live in an LRU table of
    `table_size` page hashes; the ring has `vnodes` points per replica."""

    def __init__(self, load_factor: float = 1.25, table_size: int = 65536, vnodes: int = 64):
        if load_factor < 1.0:
            raise ValueError(f"prefix load factor must be >= 1.0, got {load_factor}")
        self.load_factor = load_factor
        self.table_size = table_size
        self.vnodes = vnodes
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # page hash -> replica URL
        self._ring_for: tuple[str, ...] = ()
        self._ring: list[tuple[int, str]] = []
        self._least = LeastLoad()

    def _ring_points(self, urls: tuple[str, ...]) -> list[tuple[int, str]]:
        if urls != self._ring_for:
            points = []
            for url in urls:
                for v in range(self.vnodes):
                    h = hashlib.blake2b(f"{url}#{v}".encode(), digest_size=8).digest()
                    points.append((int.from_bytes(h, "big"), url))
            self._ring = sorted(points)
            self._ring_for = urls
        return self._ring

    def _bound(self, candidates: Sequence[BackendView]) -> float:
        # The request being placed counts too, hence the +1: with all replicas idle the bound is
        # ceil(factor / n) >= 1, so an idle replica always qualifies.
        total = sum(b.load for b in candidates) + 1
        return math.ceil(self.load_factor * total / len(candidates))

    def choose(self, candidates: Sequence[BackendView], key: PrefixKey | None = None) -> str:
        if key is None:
            return self._least.choose(candidates)
        by_url = {b.url: b for b in candidates}
        bound = self._bound(candidates)

        def fits(url: str) -> bool:
            return by_url[url].load + 1 <= bound

        # Longest remembered prefix first: that replica holds the most of this prompt's pages.
        for h in reversed(key.page_hashes):
            url = self._owner.get(h)
            if url in by_url and fits(url):
                return url
        ring = self._ring_points(tuple(sorted(by_url)))
        start = bisect.bisect(ring, (int.from_bytes(key.page_hashes[0], "big"), ""))
        for i in range(len(ring)):
            url = ring[(start + i) % len(ring)][1]
            if fits(url):
                return url
        # Only fractional scraped loads can leave no replica under the bound.
        return self._least.choose(candidates)

    def remember(self, key: PrefixKey, url: str) -> None:
        """Record that `url` now holds these pages (called once the request is sent there)."""
        for h in key.page_hashes:
            self._owner[h] = url
            self._owner.move_to_end(h)
        while len(self._owner) > self.table_size:
            self._owner.popitem(last=False)

    def forget(self, url: str) -> None:
        """A replica left: its cache went with it."""
        for h in [h for h, u in self._owner.items() if u == url]:
            del self._owner[h]


def make_policy(name: str, **kwargs) -> RoundRobin | LeastLoad | PrefixAware:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "prefix-aware":
        return PrefixAware(**kwargs)
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")

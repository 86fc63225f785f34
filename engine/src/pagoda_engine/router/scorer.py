"""The endpoint scorer shared by `pagoda epp` and `pagoda route`: precise prefix match from the
pods' KV events, queue depth and KV usage, as llm-d's default scorers weigh them.

Each pod gets a weighted sum of three scores in [0, 1]: the share of the request's tokens its
prefix cache already holds (`KVIndex.matched`), how short its queue is next to the
others' (min-max normalised, as llm-d's queue scorer), and how much of its KV pool is free. A pod
whose queue has reached `queue_limit` goes last while any other is under it (llm-d's
low-queue filter), so a full pod is avoided even when it holds the prefix. Pure: no I/O, no
clock; the EPP and the router hand it what they know. `PrecisePrefix` is the router's policy
over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pagoda_engine.router.kv_index import PrefixSource, endpoint_of
from pagoda_engine.router.policy import BackendView, PrefixAware, PrefixKey
from pagoda_engine.router.prompt_pages import Prompt


@dataclass(frozen=True)
class Candidate:
    name: str  # ip:port (the EPP) or URL (the router)
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    matched_tokens: int = 0


@dataclass(frozen=True)
class Weights:
    prefix: float = 3.0
    queue: float = 2.0
    kv_usage: float = 1.0


def rank(candidates: Sequence[Candidate], num_tokens: int, weights: Weights = Weights(),
         queue_limit: float = 128.0) -> list[str]:
    """The candidates' names, best first (the EPP's ordered fallback list)."""
    if not candidates:
        return []
    pool = [c for c in candidates if c.waiting < queue_limit]
    full = [c for c in candidates if c.waiting >= queue_limit] if pool else []
    pool = pool or list(candidates)
    least, most = min(c.waiting for c in pool), max(c.waiting for c in pool)
    spread = most - least

    def score(c: Candidate) -> float:
        prefix = c.matched_tokens / num_tokens if num_tokens else 0.0
        queue = 1.0 - (c.waiting - least) / spread if spread else 1.0
        return weights.prefix * prefix + weights.queue * queue + weights.kv_usage * (1.0 - min(1.0, c.kv_usage))

    # Ties go to the less loaded, then by name, so the order is stable.
    ranked = sorted(pool, key=lambda c: (-score(c), c.waiting + c.running, c.name))
    return [c.name for c in ranked] + sorted(c.name for c in full)


# --- `pagoda route`'s policy over the same ranking ------------------------------------------

@dataclass(frozen=True)
class TokenKey(PrefixKey):
    """A routing key that also carries the request's tokenized prompt (precise prefix routing) and
    the LoRA adapter it runs under (None: the base model), whose pages are its own."""

    prompt: Prompt | None = None
    adapter: str | None = None


class PrecisePrefix(PrefixAware):
    """`pagoda route --policy prefix-aware` with KV events: while some replica's events show it
    holding the request's leading pages, `rank` decides exactly as `pagoda epp` does; otherwise
    (no events yet, a prefix no one holds) the approximate prefix-aware choice, which it keeps
    learning, so both ingress paths pick alike."""

    def __init__(self, prefixes: PrefixSource, weights: Weights = Weights(), queue_limit: float = 128.0, **kwargs):
        super().__init__(**kwargs)
        self.prefixes, self.weights, self.queue_limit = prefixes, weights, queue_limit

    def choose(self, candidates: Sequence[BackendView], key: PrefixKey | None = None) -> str:
        if isinstance(key, TokenKey) and key.prompt is not None and key.prompt.num_tokens:
            endpoints = {endpoint_of(c.url): c for c in candidates}
            matched = self.prefixes.matched(key.prompt, endpoints, key.adapter)
            if any(matched.values()):
                return rank([Candidate(c.url, waiting=c.waiting, running=max(c.running, float(c.in_flight)),
                                       kv_usage=c.kv_usage, matched_tokens=matched[e])
                             for e, c in endpoints.items()], key.prompt.num_tokens, self.weights, self.queue_limit)[0]
        return super().choose(candidates, key)

"""Speculative decoding on the engine core's side: who drafts, what a verification step samples,
and which drafted tokens a request keeps.

A speculating request's decode step feeds its last token and k drafted ones (`Request.spec_token_ids`,
set by the proposer when the scheduler plans the step); the model scores all k + 1 positions at
once, and the step samples a token at every one of them with the request's own sampling settings
(`verification_rows`: position j sees the output so far plus drafts 0..j-1, so penalties,
min_tokens and the seed's step are those plain decoding would have at that token). The request
keeps the drafts up to the first that differs from the token sampled at its position, then that
sampled token (or, with every draft kept, the one after the last draft): `accept`.

Why this is exact. The drafts here are one token per position (a point mass: prompt lookup, and
any proposer that drafts greedily). Leviathan et al.'s rule for a draft token d with draft
probability q(d) = 1 under the target's p is: keep d with probability min(1, p(d)/q(d)) = p(d);
else draw from the residual max(p - q, 0), normalised, which is p with d removed. Drawing t ~ p
and keeping d when t = d does exactly that: P(keep) = p(d), and given t != d, t is distributed
as p without d. So each kept token is distributed as the target's next token, and the output is
the target's distribution (vLLM's `RejectionSampler` with draft_probs=None is this rule). Greedy
rows draw the argmax, so greedy output is identical to decoding without speculation; a seeded
row's token at output index i draws the noise plain decoding would draw for index i, so seeded
outputs are identical too.

KV pages: the verification step allocates pages for all k + 1 positions; the rejected drafts'
entries lie past `num_computed_tokens` once the step is applied, and the pages they alone took are
handed back at once (`KVCacheManager.trim`). They were never registered in the prefix cache,
which hashes only a request's known tokens.

Structured outputs: a constrained request's position j samples under its grammar's mask after
drafts 0..j-1 (`RequestGrammar.mask_after`), so a kept token is one the grammar allows, and the
rule above holds for the constrained distribution. Drafts are not filtered before verification:
the first draft the grammar refuses cannot equal the token sampled at its position under a mask
that excludes it, so verification stops there (and the rows after it repeat that mask: what they
sample is never kept).

Not speculated: requests whose token is still in flight (async scheduling: the engine core
resolves the step in flight before scheduling a step that speculates), and every request of a
step with more running requests than `disable_by_batch_size`.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from pagoda_engine.core.request import Request
from pagoda_engine.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

# vLLM logs its speculative-decoding line with the other stats every 10 s.
_LOG_INTERVAL_S = 10.0


def ngram_draft(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup (vLLM's ngram method): the longest n-gram (max_n down to min_n tokens) that
    ends `tokens` and also occurs earlier in them; the up to k tokens that followed its latest
    earlier occurrence are the draft. [] when none occurs."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1: every earlier occurrence (the suffix itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    """Drafts from the request's own earlier tokens (prompt and output)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, reqs: list[Request], max_drafts: list[int]) -> list[list[int]]:
        return [ngram_draft(np.asarray(r.all_token_ids, dtype=np.int64), k, self.min_n, self.max_n) if k > 0 else []
                for r, k in zip(reqs, max_drafts)]


@dataclasses.dataclass
class SpecDecodeStats:
    """Cumulative counters (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # verification rows: requests × steps that carried a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)


class SpecDecoder:
    """The proposer, when a step speculates, and what was drafted and kept (the metrics)."""

    def __init__(self, config: SpeculativeConfig, proposer=None):
        self.config = config
        self.k = config.num_speculative_tokens
        # A proposer has `propose(reqs, max_drafts) -> drafts`; `pagoda bench` may hand its own. One
        # with `drafts_after_allocation` (a drafting model, `core/draft_proposer.py`) drafts once
        # the scheduler has allocated the step's pages (`fill`); until then a request's draft
        # stands as placeholders of the length it will have.
        self.proposer = proposer if proposer is not None else NgramProposer(config)
        self._after_allocation = getattr(self.proposer, "drafts_after_allocation", False)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._logged = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._logged_at = time.monotonic()
        self._drafted = False  # some running request may hold a draft from the last schedule

    def forget_counts(self) -> None:
        """Start the counters (and the log line's window) again: the warm-up's drafts are not the server's."""
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._logged = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._logged_at = time.monotonic()

    def active(self, num_running: int) -> bool:
        """Whether a step with this many running requests speculates."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Set each running request's draft for the step being scheduled ([] where it does not speculate)."""
        if not self.active(len(running)):
            if self._drafted:  # the drafts of the last step that speculated are spent
                for r in running:
                    r.spec_token_ids = []
                self._drafted = False
            return
        self._drafted = True
        eligible, budgets = [], []
        if self._after_allocation:
            self.proposer.retain(running)
        for r in running:
            r.spec_token_ids = []
            # A decode whose last token is known (nothing in flight).
            if r.num_output_placeholders or r.num_tokens - r.num_computed_tokens != 1 or r.num_computed_tokens == 0:
                continue
            # Never draft past what the request may still write: after the step it holds every
            # kept draft plus one sampled token.
            room = max_model_len - r.num_tokens - 1
            max_tokens = r.sampling_params.max_tokens
            if max_tokens is not None:
                room = min(room, max_tokens - r.num_output_tokens - 1)
            if room > 0:
                eligible.append(r)
                budgets.append(min(self.k, room))
        if self._after_allocation:
            for r, n in zip(eligible, budgets):
                r.spec_token_ids = [-1] * n
        elif eligible:
            for r, draft in zip(eligible, self.proposer.propose(eligible, budgets)):
                r.spec_token_ids = draft

    def fill(self, scheduled: list) -> None:
        """A drafting model's drafts for the scheduled steps, whose pages are now allocated: each
        `ScheduledRequest`'s placeholders (as many as the budget kept) become its drafted tokens."""
        if not self._after_allocation:
            return
        drafting = [s for s in scheduled if s.draft_token_ids]
        if drafting:
            drafts = self.proposer.propose([s.request for s in drafting], [len(s.draft_token_ids) for s in drafting])
            for s, draft in zip(drafting, drafts):
                assert len(draft) == len(s.draft_token_ids), s.request.request_id
                s.draft_token_ids[:] = draft
                s.request.spec_token_ids = draft

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafted
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.accepted_per_pos[pos] += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_INTERVAL_S:
            self.log(now)

    def log(self, now: float | None = None) -> None:
        """vLLM's line: mean acceptance length and acceptance rates since the last one."""
        now = time.monotonic() if now is None else now
        s, last = self.stats, self._logged
        drafts = s.num_drafts - last.num_drafts
        if drafts:
            drafted = s.num_draft_tokens - last.num_draft_tokens
            accepted = s.num_accepted_tokens - last.num_accepted_tokens
            elapsed = max(now - self._logged_at, 1e-9)
            per_pos = [(a - b) / drafts for a, b in zip(s.accepted_per_pos, last.accepted_per_pos)]
            logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                        "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                        "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                        1 + accepted / drafts, accepted / elapsed, drafted / elapsed, accepted, drafted,
                        ", ".join(f"{r:.3f}" for r in per_pos), 100 * accepted / max(drafted, 1))
        self._logged = dataclasses.replace(s, accepted_per_pos=list(s.accepted_per_pos))
        self._logged_at = now


def verification_rows(req: Request, draft: list[int]) -> list[Request]:
    """The sampling rows of a speculating request's k + 1 positions: position j as the request
    would be after keeping drafts 0..j-1 (its output tokens, hence penalties, min_tokens and the
    seed's step). Read-only copies for `core.sampling_batch`; the request itself at every
    position where none of those read its output (greedy or unseeded, no penalties, min_tokens
    reached): a copy costs tens of µs on the host, in the step's critical path."""
    p = req.sampling_params
    if ((p.greedy or p.seed is None) and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0 and req.num_output_tokens + req.num_output_placeholders >= p.min_tokens):
        return [req] * (len(draft) + 1)
    return [req] + [dataclasses.replace(req, output_token_ids=req.output_token_ids + draft[:j], events=[])
                    for j in range(1, len(draft) + 1)]


def accept(draft: list[int], sampled: list[int]) -> int:
    """How many leading drafts the tokens sampled at their positions keep (`sampled` has one
    more token than `draft`: the one after the last draft)."""
    n = 0
    while n < len(draft) and draft[n] == sampled[n]:
        n += 1
    return n

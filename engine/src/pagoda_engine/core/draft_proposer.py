"""The engine core's side of a drafting model (`draft_model`, `eagle3`): which tokens each request's
drafting KV still lacks, and the plan that drafts its next tokens on rank 0 (`DraftPlan`,
run by `worker.drafter.Drafter`).

KV pages: the drafter's KV tensors are indexed by the target's page ids (one pool of page ids;
each page costs the target's bytes plus the drafter's, which the sizing counts). A request's
draft KV therefore lives in the pages the scheduler already gave it: no second allocator, and a
page freed, trimmed after refused drafts or handed to another request goes for both models at
once. What the drafter's half of a page holds is tracked here per request instead of per page:
the tokens its KV was built from (`_fed`). Each step the request's drafting KV is taken as
valid up to the first draft it was fed that the request did not keep, and never past the target's
computed tokens (the pages beyond those may have been trimmed and reused); preemption forgets it
all. A prefix hit therefore recomputes the shared pages' draft KV once (the same tokens give the
same values, so a neighbour reading them meanwhile reads what it wrote itself), which keeps the
prefix cache the target's alone. One exception, EAGLE-3's: its entry at position j pairs token
j + 1 with the target's state at j, so a shared page's last entry depends on a token past the
page; there the entry of the request that computed the page stays (`catch_up_slot`): a request
with a prefix hit drafts over it, which costs acceptance at most, never output.

Per engine step a speculating request, whose last token is known and whose verification slots
(positions N - 1 .. N - 1 + k) the scheduler has allocated, gets: step 0, the tokens its
drafting KV lacks up to its last (a draft model feeds tokens at their positions; an EAGLE-3 head
pairs the target's hidden state at position j with token j + 1, so it stops one position
earlier), whose last row drafts the first token; steps 1 .. k - 1, each one token, the previous
draft. Positions and slots stay inside the pages the verification uses.

EAGLE-3's later draft steps run on the head's own hidden states, not the target's: those
positions' drafting KV is not kept as valid; the next step recomputes them from the target's
hidden states of the tokens it kept (as vLLM's proposer does).
"""

from __future__ import annotations

from pagoda_engine.core.kv.block_pool import NULL_PAGE_ID
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.request import Request
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.executor_types import DraftPlan, DraftStep
from pagoda_engine.speculative import MODEL_METHODS, SpeculativeConfig
from pagoda_engine.tokenizer_files import has_tokenizer, load_tokenizer
from pagoda_engine.worker.executor import Executor


class ModelProposer:
    """Drafts from a model on rank 0. Its drafts are planned once the scheduler has allocated the
    step's pages (`drafts_after_allocation`): it writes KV at the verification's positions."""

    drafts_after_allocation = True

    def __init__(self, config: SpeculativeConfig, executor: Executor, kv: KVCacheManager, max_tokens: int):
        self.eagle = config.method == "eagle3"
        self.max_tokens = max_tokens  # the most tokens one drafting forward feeds (the step's token budget)
        self.executor = executor
        self.kv = kv
        self.page_size = kv.page_size
        # request id -> (the request, its preemptions then, its tokens then, the drafts fed after them):
        # what its drafting KV was built from. A request's own tokens never change (preemption
        # aside), so only the drafts need comparing with what it kept.
        self._fed: dict[str, tuple[Request, int, int, list[int]]] = {}

    def retain(self, running: list[Request]) -> None:
        """Forget the requests that are no longer running."""
        if len(self._fed) > len(running):
            ids = {r.request_id for r in running}
            self._fed = {rid: fed for rid, fed in self._fed.items() if rid in ids}

    def _valid(self, req: Request) -> int:
        """How many leading positions of req's drafting KV still hold what its tokens give."""
        fed = self._fed.get(req.request_id)
        if fed is None or fed[0] is not req or fed[1] != req.num_preemptions:
            return 0  # another request of the same id, or recomputed since
        _, _, known, drafts = fed
        kept = req.output_token_ids[known - req.num_prompt_tokens:known - req.num_prompt_tokens + len(drafts)]
        same = known + next((j for j, (a, b) in enumerate(zip(drafts, kept)) if a != b), min(len(drafts), len(kept)))
        # EAGLE-3's position j holds token j + 1's pair.
        return min(same - 1 if self.eagle else same, req.num_computed_tokens)

    def propose(self, reqs: list[Request], num_drafts: list[int]) -> list[list[int]]:
        """Exactly `num_drafts[i]` tokens for each request (each a decode whose verification pages are allocated)."""
        ps = self.page_size
        first = []  # (request index, start position, last position, tokens fed)
        for i, req in enumerate(reqs):
            last = req.num_tokens - (2 if self.eagle else 1)
            start = min(max(self._valid(req), 0), last)
            fed = _tokens(req, start + 1, last + 2) if self.eagle else _tokens(req, start, last + 1)
            first.append((i, start, last, fed))
        tables = [self.kv.page_ids(r.request_id) for r in reqs]
        pages = self.kv.pool.pages

        def slot(i: int, p: int) -> int:
            return tables[i][p // ps] * ps + p % ps

        def catch_up_slot(i: int, p: int) -> int:
            # EAGLE-3's entry at a page's last position depends on the next page's first token,
            # which requests sharing the page need not agree on: in a page the request found in
            # the prefix cache, still held by another, the entry of the request that computed the
            # page stays, and this one is written to the null page (vLLM, which keeps the draft's
            # KV in the target's blocks, reuses the cached entry the same way).
            page = tables[i][p // ps]
            if (self.eagle and p % ps == ps - 1 and p < reqs[i].num_cached_tokens
                    and pages[page].ref_cnt > 1):
                return NULL_PAGE_ID * ps + p % ps
            return page * ps + p % ps

        def catch_up(pieces: list[tuple[int, int, int, list[int]]], drafting: bool) -> DraftStep:
            """One forward over (request index, first position, last position, tokens fed) pieces;
            decodes (one token after cached ones) first, as the attention plan wants them."""
            pieces.sort(key=lambda f: 0 if f[2] == f[1] and f[1] > 0 else 1)
            positions, slots, ids, feature_slots = [], [], [], []
            for i, start, last, fed in pieces:
                span = range(start, last + 1)
                positions += span
                slots += [catch_up_slot(i, p) for p in span]
                feature_slots += [slot(i, p) for p in span]
                ids += fed
            return DraftStep(query_lens=[f[2] - f[1] + 1 for f in pieces], seq_lens=[f[2] + 1 for f in pieces],
                             page_tables=[tables[f[0]] for f in pieces], positions=positions, slots=slots,
                             num_decodes=sum(1 for f in pieces if f[2] == f[1] and f[1] > 0),
                             requests=[f[0] for f in pieces] if drafting else [], token_ids=ids,
                             feature_slots=feature_slots if self.eagle else None, writes_only=not drafting)

        # A catch-up longer than a step's token budget (a long prompt's first drafts, a prefix
        # hit's) goes through forwards of at most that many tokens that only write KV, so that
        # the drafter's activations stay within what the profile step measured for the target's.
        steps = []
        if sum(last - start + 1 for _, start, last, _ in first) > self.max_tokens:
            chunk, size = [], 0
            for i, start, last, fed in first:
                a = start
                while a < last:
                    n = min(last - a, self.max_tokens - size)
                    chunk.append((i, a, a + n - 1, fed[a - start:a - start + n]))
                    size, a = size + n, a + n
                    if size == self.max_tokens:
                        steps.append(catch_up(chunk, drafting=False))
                        chunk, size = [], 0
            if chunk:
                steps.append(catch_up(chunk, drafting=False))
            first = [(i, last, last, fed[-1:]) for i, _, last, fed in first]
        steps.append(catch_up(first, drafting=True))
        rows = [f[0] for f in first]
        lasts = {f[0]: f[2] for f in first}
        for j in range(1, max(num_drafts)):
            kept = [(row, i) for row, i in enumerate(rows) if num_drafts[i] > j]
            pos = [lasts[i] + j for _, i in kept]
            steps.append(DraftStep(query_lens=[1] * len(kept), seq_lens=[p + 1 for p in pos],
                                   page_tables=[tables[i] for _, i in kept], positions=pos,
                                   slots=[slot(i, p) for (_, i), p in zip(kept, pos)], num_decodes=len(kept),
                                   requests=[i for _, i in kept], from_rows=[row for row, _ in kept]))
            rows = [i for _, i in kept]
        drafts = self.executor.propose_drafts(DraftPlan(len(reqs), max(num_drafts), steps))
        for req, draft in zip(reqs, drafts):
            # A draft model's KV holds every draft it was fed; EAGLE-3's only the target-fed positions.
            self._fed[req.request_id] = (req, req.num_preemptions, req.num_tokens, [] if self.eagle else draft[:-1])
        return drafts


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """The request's tokens [start, end) without building prompt + output in full."""
    num_prompt = req.num_prompt_tokens
    if start >= num_prompt:
        return req.output_token_ids[start - num_prompt:end - num_prompt]
    if end <= num_prompt:
        return req.prompt_token_ids[start:end]
    return req.prompt_token_ids[start:] + req.output_token_ids[:end - num_prompt]


def model_proposer(config: SpeculativeConfig, executor: Executor, kv: KVCacheManager, model_dir: str,
                   max_model_len: int, max_tokens: int) -> ModelProposer | None:
    """The proposer of a drafting model (None for ngram), after the checks that need both models:
    the same tokenizer (a draft model) and positions enough for max_model_len."""
    if config.method not in MODEL_METHODS:
        return None
    draft_dir = executor.draft_model_dir
    if config.method == "draft_model":
        check_same_tokenizer(model_dir, draft_dir)
    limit = executor.draft_max_position
    if limit < max_model_len:
        raise ModelLoadError(f"the drafting model {draft_dir} serves at most {limit} positions, fewer than the "
                             f"target's max_model_len {max_model_len}: lower --max-model-len to {limit}")
    return ModelProposer(config, executor, kv, max_tokens)


def check_same_tokenizer(target_dir: str, draft_dir: str) -> None:
    """A draft model's tokens are the target's: the same vocabulary, token for token, where both
    directories hold a tokenizer (the vocabulary sizes were compared as the draft loaded)."""
    if not (has_tokenizer(target_dir) and has_tokenizer(draft_dir)):
        return
    target, draft = load_tokenizer(target_dir).get_vocab(), load_tokenizer(draft_dir).get_vocab()
    if target != draft:
        differ = sorted(set(target.items()) ^ set(draft.items()), key=lambda kv: kv[1])[:3]
        raise ModelLoadError(f"the draft model {draft_dir} does not share the tokenizer of the target {target_dir} "
                             f"({len(draft)} and {len(target)} tokens; e.g. {differ}): a draft model must draft in the "
                             "target's tokens")

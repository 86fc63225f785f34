"""One token-budget loop: running requests first, then waiting ones, no prefill/decode phases.

Every request has `num_computed_tokens` and simply advances: a decode asks for 1 token, a prompt
for the rest of its prompt (chunked to fit the budget, and to `long_prefill_token_threshold`
tokens a step where that is set, as vLLM's V1 scheduler). When pages run out, the lowest-priority
running request (the newest, under FCFS) is preempted: its pages are freed (they stay in the prefix
cache) and it goes back to the front of the waiting queue to be recomputed. Preempted requests go
back in front of everything that arrived after them (`_queue_key`).

KV offload tiers: a waiting request whose prefix continues below the device (CPU, disk, Redis)
has its pages loaded (`KVCacheManager.load_from_tiers`). Pages from host memory count as prefix
hits at once: the request is admitted in the same schedule, and the step waits on the device for
their copies (unless other requests run in it and the copies would hold it up: then the request
is admitted on the next schedule, as below). Pages from disk or Redis are read first: while they
travel the request is passed over and the requests behind it go ahead; once they have arrived it
is admitted with them as prefix hits. A preempted request's full pages went down to the tiers when
they filled, so it resumes by loading them instead of recomputing.

Admission (`kv_growth_reservation`, on by default): a waiting request is admitted only if, after
its prompt's pages, the free pages still hold the expected remaining output of every running
request and of itself. The expected output of a request is the mean output length of the
requests that stopped on their own so far (EOS or a stop token; exponentially weighted; 1,024
tokens before the first), capped by what its max_tokens and max_model_len still allow. With
nothing running, a request is admitted whenever it fits, so a long request can never wait forever.

Async scheduling (`advance`): the core schedules step N+1 before step N's tokens are known. A
scheduled step is then advanced at once (`num_computed_tokens` moves on, and each request that
samples counts one output placeholder), so the next `schedule` gives every such request one more
decode, fed on the device from step N's sampled token. `update_from_output(..., advanced=True)`
later fills the placeholder in, and drops the tokens of requests that finished meanwhile.

The batch queue (pipeline parallelism, vLLM V1's): up to one batch per stage in flight, each
advanced when launched; `schedule(skip_in_flight=True)` leaves out a request whose token is still
in flight (it waits for its batch), so the next batch holds other requests' decodes and the next
chunks of prompts, whose earlier chunks every stage runs first.

Speculative decoding (`core.spec_decode`): before the running requests are planned, the proposer
drafts up to k tokens for each decode that speculates (`Request.spec_token_ids`); such a request
asks for 1 + k tokens, inside the same budget (a budget too small keeps fewer drafts). At the
update it keeps the drafts up to the first the step's sampled tokens refuse, plus one sampled
token; its computed tokens step back over the refused drafts and the pages only they took are
freed (`KVCacheManager.trim`).

A request with a grammar still compiling (structured outputs) stays in the waiting queue, passed
over, until it is compiled.

Lifecycle events: the scheduler stamps each request's QUEUED, SCHEDULED (each admission from the
waiting queue), PREEMPTED and FIRST_TOKEN events (`time.time()`) on the request; they ride on its
next output to the API process, which derives queue time, TTFT and the rest from them.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from pagoda_engine.config import SchedulerConfig
from pagoda_engine.core.request import Request, RequestStatus
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.spec_decode import SpecDecoder, accept
from pagoda_engine.messages import EngineCoreEventType


# Admission control: the running mean of the output lengths of requests that stopped on their own
# (EOS or a stop token) weighs each new one by this much; before any has, a request is expected to
# write this many tokens. A request cut at max_tokens or the context says only "at least this
# long" (and its cap already bounds its own expected growth), so it is not counted: a warm-up of
# short capped requests, or max_tokens=1 probes, would otherwise make long generations look short.
_OUTPUT_LEN_EMA = 0.05
_FIRST_OUTPUT_LEN_GUESS = 1024


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # drafted tokens included
    # Speculative decoding: the drafted tokens this step verifies, after the request's known ones.
    draft_token_ids: list[int] = field(default_factory=list)
    # After this step every known token is computed, so the step samples a new one. Fixed when
    # scheduled: under async scheduling the request moves on before the step's update.
    completes_sequence: bool = field(init=False)

    def __post_init__(self) -> None:
        req = self.request
        self.completes_sequence = (req.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids)
                                   == req.num_tokens + req.num_output_placeholders)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 spec: SpecDecoder | None = None, max_loras: int | None = None):
        self.config = config
        # --enable-lora: the running requests never name more distinct adapters than device slots.
        self.max_loras = max_loras
        self.spec = spec  # speculative decoding's proposer and counters; None: off
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrival = itertools.count()
        # Mean output length of requests that stopped on their own: the admission estimate.
        self._mean_output_len: float | None = None

    # --- queue management ---------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        req.arrival_seq = next(self._arrival)
        req.status = RequestStatus.WAITING
        req.record_event(EngineCoreEventType.QUEUED)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _queue_key(self, req: Request) -> tuple:
        if self.config.policy == "priority":
            return (req.priority, req.arrival_seq)
        return (req.arrival_seq,)

    def abort(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(req)
        return aborted

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if status == RequestStatus.FINISHED_STOPPED:
            n = req.num_output_tokens
            m = self._mean_output_len
            self._mean_output_len = n if m is None else m + _OUTPUT_LEN_EMA * (n - m)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.kv.forget(req)
        del self.requests[req.request_id]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    # --- the loop -----------------------------------------------------------------------------
    def schedule(self, skip_in_flight: bool = False) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.long_prefill_token_threshold or budget  # one prompt's tokens in this step
        self.kv.poll_offload()
        if self.spec is not None:
            self.spec.propose(self.running, self.max_model_len)

        # 1. Running requests: decodes and unfinished prompt chunks. Never starved by new arrivals.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            limit = self.kv.compute_limit(req)  # a split load's cut, short of max_model_len; else None
            end = self.max_model_len if limit is None else limit
            known = req.num_tokens + req.num_output_placeholders - req.num_computed_tokens
            num_new = min(known + len(req.spec_token_ids), budget, end - req.num_computed_tokens, chunk_cap)
            if num_new <= 0 or (req.num_output_placeholders and (skip_in_flight or self._placeholder_is_last(req))):
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new):
                if num_new > known:
                    num_new = known  # drafts are optional: dropped before anything is preempted for them
                    continue
                if self.kv.release_loaded_pages():
                    continue  # pages held for loaded waiting requests go before any running request
                victim = self._pick_victim(i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num_new, req.spec_token_ids[:max(num_new - known, 0)]))
                budget -= num_new
                i += 1
        if self.spec is not None:
            self.spec.fill(out.scheduled)  # a drafting model drafts into the pages just allocated

        # 2. Waiting requests, only while nothing had to be preempted this step.
        reserved = None  # pages the running requests' expected output will take
        now = time.time()
        admitting = self.waiting and not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs
        for req in sorted(self.waiting, key=self._queue_key) if admitting else ():
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if req.waits_for_grammar or req.waits_for_remote_kv or self.kv.is_loading(req):
                continue  # its grammar compiles, its prefix comes up from an offload tier or from a
                # producer engine (disaggregated prefill): the others go first
            if self.max_loras is not None and not self._adapter_fits(req):
                continue  # every device slot serves running requests' adapters: it waits for one to free
            if req.num_output_placeholders and skip_in_flight:
                break  # preempted while its batch is in flight: readmitted once that batch is back
            # Only a request preempted in this very call can still wait for a token, and then
            # nothing is admitted: the core resolves the step in flight before the next call.
            assert not req.num_output_placeholders, req.request_id
            computed_pages, num_cached = self.kv.get_computed_pages(req)
            growth = None  # pages of req's expected output, when the reservation applies
            if self.config.kv_growth_reservation and self.running:
                if reserved is None:
                    reserved = sum(self._growth_pages(r) for r in self.running)
                growth = self._growth_pages(req)
                need = -(-req.num_tokens // self.kv.page_size) - len(computed_pages) + growth
                if self.kv.num_free_pages - need < reserved:
                    break
            computed_pages = self.kv.load_from_tiers(req, computed_pages, overlapped=bool(out.scheduled))
            if computed_pages is None:
                continue  # its prefix comes up from disk or Redis
            num_cached = len(computed_pages) * self.kv.page_size
            limit = self.kv.split_limit(req)  # a split load's cut, short of the prompt's end; else None
            num_new = min((req.num_tokens if limit is None else limit) - num_cached, budget, chunk_cap)
            if not self.kv.allocate_slots(req, num_new, computed_pages) and not (
                    self.kv.release_loaded_pages(but=req) and self.kv.allocate_slots(req, num_new, computed_pages)):
                self.kv.give_up_split(req)  # nothing was taken: a split load started for it is given up
                break
            self.waiting.remove(req)
            self.kv.count_admission(req, num_cached)
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.record_event(EngineCoreEventType.SCHEDULED, now)
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            if growth is not None:
                reserved += growth
        return out

    def _adapter_fits(self, req: Request) -> bool:
        """Whether admitting `req` keeps the running requests' distinct adapters within --max-loras."""
        name = req.lora_name
        if name is None:
            return True
        running = self.running_adapters()
        return name in running or len(running) < self.max_loras

    def running_adapters(self) -> set[str]:
        """The LoRA adapters of the running requests."""
        return {r.lora_name for r in self.running if r.lora_name is not None}

    def waiting_adapters(self) -> set[str]:
        """The LoRA adapters of the waiting requests."""
        return {r.lora_name for r in self.waiting if r.lora_name is not None}

    def _growth_pages(self, req: Request) -> int:
        """Pages `req`'s expected remaining output will take (admission control)."""
        generated = req.num_output_tokens + req.num_output_placeholders
        max_tokens = req.sampling_params.max_tokens
        allowed = self.max_model_len - req.num_prompt_tokens
        if max_tokens is not None:
            allowed = min(allowed, max_tokens)
        expected = _FIRST_OUTPUT_LEN_GUESS if self._mean_output_len is None else self._mean_output_len
        remaining = min(allowed - generated, max(expected - generated, 0))
        return -(-max(int(remaining), 0) // self.kv.page_size)

    def _pick_victim(self, current: int) -> Request:
        """The running request to preempt: the newest (FCFS) or lowest-priority one not yet
        scheduled this step (indices >= current)."""
        candidates = self.running[current:]
        return max(candidates, key=self._queue_key)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.record_event(EngineCoreEventType.PREEMPTED)
        self.num_preemptions += 1
        self.waiting.append(req)

    def _placeholder_is_last(self, req: Request) -> bool:
        """The token in flight reaches max_tokens or max_model_len: the request ends with it,
        so it needs no further step."""
        max_tokens = req.sampling_params.max_tokens
        return ((max_tokens is not None and req.num_output_tokens + req.num_output_placeholders >= max_tokens)
                or req.num_tokens + req.num_output_placeholders >= self.max_model_len)

    def advance(self, out: SchedulerOutput) -> None:
        """Async scheduling: count a scheduled step as done before its tokens are known."""
        for sched in out.scheduled:
            sched.request.num_computed_tokens += sched.num_new_tokens
            sched.request.num_steps_in_flight += 1
            if sched.completes_sequence:
                sched.request.num_output_placeholders += 1

    # --- after the forward pass ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int], advanced: bool = False,
                           verified: dict[str, list[int]] | None = None) -> list[tuple[Request, int]]:
        """Advance every scheduled request (unless `advance` already did); append sampled tokens;
        finish what must finish. `verified`: for each request that verified drafts, the tokens
        sampled at its draft positions and the one after. Returns each request that produced
        tokens (or finished) this step, with how many it kept."""
        updated = []
        now = time.time()
        for sched in out.scheduled:
            req = sched.request
            if advanced:
                req.num_steps_in_flight -= 1
                if req.is_finished:
                    continue  # aborted, or finished by the step before: this token is surplus
            draft = sched.draft_token_ids
            rejected = 0
            if draft:
                tokens = verified[req.request_id]
                num_kept = accept(draft, tokens)
                tokens, rejected = tokens[:num_kept + 1], len(draft) - num_kept
                self.spec.observe(len(draft), num_kept)
            # `advance` counted every scheduled token (refused drafts included) as computed.
            req.num_computed_tokens += (0 if advanced else sched.num_new_tokens) - rejected
            if not sched.completes_sequence:
                continue  # a prompt chunk: nothing sampled yet
            if advanced:
                req.num_output_placeholders -= 1
            if not draft:
                tokens = [sampled[req.request_id]]
            num_appended, status = 0, None
            for token in tokens:  # a stop ends the request at that token: the rest are dropped
                req.output_token_ids.append(token)
                num_appended += 1
                if req.num_output_tokens == req.num_resumed_tokens + 1:  # the first this engine sampled
                    req.record_event(EngineCoreEventType.FIRST_TOKEN, now)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            updated.append((req, num_appended))
            if status is not None:
                self._finish(req, status)
            elif rejected:
                self.kv.trim(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        # Once its grammar is complete, a constrained request may only sample EOS, which ends it
        # (even under ignore_eos: nothing else could follow). A token the grammar refuses (never
        # expected: the mask allowed it) ends it too.
        if req.grammar is not None and (not req.grammar.accept(token) or req.grammar.ended_by(token)):
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and req.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

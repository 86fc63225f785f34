"""The token-budget scheduler on its own: budget, decode priority, chunking, preemption, policies,
lifecycle events."""

import random
import time
import zlib

from pagoda_engine.config import SchedulerConfig
from pagoda_engine.core.request import Request, RequestStatus
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.scheduler import Scheduler
from pagoda_engine.messages import EngineCoreEventType as Ev
from pagoda_engine.sampling_params import SamplingParams


def _sched(num_pages=64, page_size=4, budget=16, max_seqs=8, policy="fcfs", max_len=256, reserve=True,
           long_prefill=0):
    kv = KVCacheManager(num_pages, page_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy,
                                     kv_growth_reservation=reserve, long_prefill_token_threshold=long_prefill),
                     kv, max_len)


def _req(rid, n, max_tokens=8, priority=0):
    # crc32, not hash(): str hashes change with PYTHONHASHSEED, and two prompts that happen to start
    # alike share prefix-cache pages, which changes how many tokens a step schedules.
    base = zlib.crc32(rid.encode())
    return Request(request_id=rid, prompt_token_ids=[(base + i) % 50 + 1 for i in range(n)],
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority)


def _run_step(s: Scheduler):
    out = s.schedule()
    sampled = {x.request.request_id: 7 for x in out.scheduled}
    s.update_from_output(out, sampled)
    return out


def test_budget_never_exceeded_and_decodes_never_starved():
    rng = random.Random(0)
    s = _sched(num_pages=200, budget=16, max_seqs=6)
    for i in range(12):
        s.add_request(_req(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 10)))
    steps = 0
    while s.has_unfinished_requests():
        decoding_before = [r for r in s.running if r.num_computed_tokens >= r.num_prompt_tokens]
        out = _run_step(s)
        steps += 1
        assert 0 < out.num_tokens <= 16
        assert len(s.running) <= 6
        scheduled = {x.request.request_id for x in out.scheduled}
        # Every request already decoding gets its token in this step (no preemption in a big pool).
        assert all(r.request_id in scheduled for r in decoding_before)
        assert steps < 500
    assert s.kv.num_free_pages == s.kv.pool.num_pages - 1


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    s = _sched(budget=8)
    s.add_request(_req("short", 3, max_tokens=5))
    _run_step(s)  # short's prefill
    s.add_request(_req("long", 20))
    out = _run_step(s)
    kinds = {x.request.request_id: x.num_new_tokens for x in out.scheduled}
    assert kinds == {"short": 1, "long": 7}
    out = _run_step(s)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 1, "long": 7}


def test_long_prefill_token_threshold_caps_each_prompt_in_a_step_and_leaves_decodes_alone():
    # vLLM's long_prefill_token_threshold: every prompt, waiting or part-way, takes at most 5
    # tokens a step; the budget (16) then holds several prompts' chunks beside the decodes.
    s = _sched(budget=16, long_prefill=5)
    s.add_request(_req("short", 3, max_tokens=6))
    out = _run_step(s)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 3}  # under the cap
    s.add_request(_req("a", 12))
    s.add_request(_req("b", 7))
    s.add_request(_req("c", 9))
    out = _run_step(s)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 1, "a": 5, "b": 5, "c": 5}
    out = _run_step(s)  # a and c part-way (running), b's last 2 tokens
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 1, "a": 5, "b": 2, "c": 4}
    assert [x.completes_sequence for x in out.scheduled] == [True, False, True, True]
    out = _run_step(s)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 1, "a": 2, "b": 1, "c": 1}
    # Without the cap the same arrivals fill the budget in arrival order, a whole prompt at a time.
    s = _sched(budget=16)
    s.add_request(_req("short", 3, max_tokens=6))
    _run_step(s)
    for rid, n in (("a", 12), ("b", 7), ("c", 9)):
        s.add_request(_req(rid, n))
    out = _run_step(s)
    assert {x.request.request_id: x.num_new_tokens for x in out.scheduled} == {"short": 1, "a": 12, "b": 3}


def test_preemption_recomputes_newest_request_when_pages_run_out():
    # 6 usable pages = 24 tokens; without the growth reservation both requests are admitted at once.
    s = _sched(num_pages=7, page_size=4, budget=64, reserve=False)
    s.add_request(_req("old", 8, max_tokens=12))
    s.add_request(_req("new", 8, max_tokens=12))
    _run_step(s)
    preempted = []
    while s.has_unfinished_requests():
        out = _run_step(s)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "new"
    assert s.num_preemptions == len(preempted)
    assert s.kv.num_free_pages == 6


def test_lifecycle_events_are_stamped_in_order_on_the_wall_clock():
    # The preemption scene above: "new" is queued, scheduled, preempted, scheduled again.
    s = _sched(num_pages=7, page_size=4, budget=64, reserve=False)
    old, new = _req("old", 8, max_tokens=12), _req("new", 8, max_tokens=12)
    before = time.time()
    s.add_request(old)
    s.add_request(new)
    events = {"old": [], "new": []}
    while s.has_unfinished_requests():
        _run_step(s)
        for req in (old, new):
            events[req.request_id] += req.take_events() or []
    assert [e.type for e in events["old"]] == [Ev.QUEUED, Ev.SCHEDULED, Ev.FIRST_TOKEN]
    new_types = [e.type for e in events["new"]]
    assert new_types[:3] == [Ev.QUEUED, Ev.SCHEDULED, Ev.FIRST_TOKEN]
    assert Ev.PREEMPTED in new_types and new_types.count(Ev.FIRST_TOKEN) == 1
    after_preemption = new_types[new_types.index(Ev.PREEMPTED) + 1:]
    assert after_preemption[0] == Ev.SCHEDULED  # readmitted
    for evs in events.values():
        stamps = [e.timestamp for e in evs]
        assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= time.time()
    assert old.take_events() is None  # taken once


def test_growth_reservation_defers_admission_instead_of_preempting():
    """The same two requests with the reservation on: "new" waits while "old"'s 12 output tokens
    would not fit beside it, and starts when "old" is done. Nothing is recomputed."""
    s = _sched(num_pages=7, page_size=4, budget=64)
    s.add_request(_req("old", 8, max_tokens=12))
    s.add_request(_req("new", 8, max_tokens=12))
    started = {}
    step = 0
    while s.has_unfinished_requests():
        out = _run_step(s)
        for x in out.scheduled:
            started.setdefault(x.request.request_id, step)
        assert not out.preempted
        step += 1
    assert s.num_preemptions == 0
    assert started["old"] == 0 and started["new"] == 12  # old: prefill + 11 more decodes, then new
    assert s.kv.num_free_pages == 6
    # "new" was looked at and passed over in 11 schedules: the prefix cache counts it once.
    assert s.kv.prefix_queries == 16


def test_growth_reservation_learns_how_long_outputs_are():
    """Before any request has finished, each is expected to fill what max_tokens allows (here the
    context); once early stops show outputs are short, more requests run at once."""
    s = _sched(num_pages=61, page_size=4, budget=256, max_seqs=32, max_len=64)  # 240 tokens
    for i in range(40):
        s.add_request(Request(request_id=f"r{i}", prompt_token_ids=[(i + j) % 50 + 3 for j in range(8)],
                              sampling_params=SamplingParams(max_tokens=None), eos_token_ids=(2,)))
    running = []
    while s.has_unfinished_requests():
        out = s.schedule()
        assert not out.preempted
        running.append(len(s.running))
        # Every request stops (EOS) after its third token.
        s.update_from_output(out, {x.request.request_id: 2 if x.request.num_output_tokens == 2 else 7
                                   for x in out.scheduled if x.completes_sequence})
    # At first: 8 prompt + 56 expected output tokens = 16 pages each, so 3 fit; later, after the
    # mean output length has fallen toward 3 tokens, far more.
    assert running[0] == 3
    assert max(running[-10:]) > 3 * running[0]
    assert s.num_preemptions == 0 and s.kv.num_free_pages == 60


def test_requests_cut_at_max_tokens_do_not_make_outputs_look_short():
    """A warm-up of short capped requests (or max_tokens=1 probes) says nothing about how long an
    uncapped generation runs: afterwards, requests that may fill the context are still admitted
    only as far as their expected output fits, and nothing is preempted."""
    s = _sched(num_pages=61, page_size=4, budget=256, max_seqs=32, max_len=64)  # 240 tokens
    for i in range(8):
        s.add_request(_req(f"probe{i}", 4, max_tokens=2))
    while s.has_unfinished_requests():
        _run_step(s)
    for i in range(8):
        s.add_request(_req(f"long{i}", 8, max_tokens=None))
    out = _run_step(s)
    assert len(out.scheduled) == 3  # 8 prompt + 56 expected output tokens = 16 pages each
    while s.has_unfinished_requests():
        _run_step(s)
    assert s.num_preemptions == 0


def test_a_request_alone_is_admitted_whatever_its_expected_output():
    s = _sched(num_pages=5, page_size=4, budget=64, max_len=256)  # 16 tokens: far below 256
    s.add_request(_req("big", 4, max_tokens=200))
    out = _run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["big"]


def test_priority_policy_runs_lower_value_first():
    s = _sched(budget=4, max_seqs=1, policy="priority")
    s.add_request(_req("late-important", 4, priority=5))
    s.add_request(_req("urgent", 4, priority=-1))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["urgent"]


def test_fcfs_runs_in_arrival_order():
    s = _sched(budget=4, max_seqs=1)
    s.add_request(_req("first", 4, priority=5))
    s.add_request(_req("second", 4, priority=-1))
    assert [x.request.request_id for x in s.schedule().scheduled] == ["first"]


def test_abort_frees_pages_from_running_and_waiting():
    s = _sched(budget=8, max_seqs=1)
    s.add_request(_req("a", 6))
    s.add_request(_req("b", 6))
    _run_step(s)
    assert s.kv.num_free_pages < 63
    aborted = s.abort(["a", "b", "missing"])
    assert [r.status for r in aborted] == [RequestStatus.FINISHED_ABORTED] * 2
    assert not s.has_unfinished_requests() and s.kv.num_free_pages == 63


def test_max_tokens_and_stop_tokens_finish_requests():
    s = _sched()
    r = Request(request_id="x", prompt_token_ids=[1, 2, 3],
                sampling_params=SamplingParams(max_tokens=5, stop_token_ids=[9], min_tokens=2), eos_token_ids=(2,))
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, {"x": 9})  # stop token before min_tokens: ignored
    assert not r.is_finished
    out = s.schedule()
    s.update_from_output(out, {"x": 9})
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9

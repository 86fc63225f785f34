"""The engine core's warm-up steps: real requests through its scheduler, runner and ranks before
it serves, where the device's first steps of each shape pay one-time costs
(`DeviceFacts.first_steps_pay_once`; a CPU engine skips them)."""

from __future__ import annotations

import time

import torch

from pagoda_engine.core.request import Request
from pagoda_engine.sampling_params import SamplingParams

_WARM_UP_MAX_STEPS = 64  # each warm-up phase needs at most 8 steps; what is left after this many is aborted
# Prompts the warm-up runs one at a time (up to its long prompt's length): one past each power of
# two, so that a step of every size class any kernel picks its configuration by (the experts'
# tiles, `fused_moe_triton._configs`: up to 4, 32, 128, 384, 768, 4,096 tokens) and of odd token
# counts has run before the first request.
WARM_UP_PROMPT_LENS = (5, 9, 17, 33, 65, 129, 257, 513)
WARM_UP_REQUEST_PREFIX = "pagoda-warm-up-"


def warm_up_steps(core) -> None:
    """Run steps on `core` (an `EngineCore`) like a server's first ones (two prompts, then a
    prompt among decodes; then prompts of `WARM_UP_PROMPT_LENS` tokens one at a time) so that its
    first requests do not pay one-time costs: the eager decode plan, GEMMs at sizes the profile
    step did not run, first-use buffers, Triton kernel variants (a compile holds a live step
    100-300 ms; a Qwen3-MoE server's first requests waited 2.5 s). On an H100 a fresh server's
    first step took 311 ms and its second 100 ms, against 25 ms and 7 ms later; with the warm-up a
    fresh server's first run at 16 req/s had a TTFT p99 of 200 ms instead of 330 (a second run:
    104; the rest was a Triton kernel variant for misaligned inputs, which `StepRunner.prepare`
    avoids by aligning its inputs). The warm-up requests leave nothing behind: the KV offload tiers
    are detached meanwhile (nothing is stored), the prefix-cache and speculative decoding's counters are put back, and they
    sample with seeds of their own (the engine's generator, which unseeded requests draw from, is
    untouched). Cores whose experts span the pod's other cores all run this at start-up, each
    turn agreed with the others (`_warm_up_turn`), so their forwards pair up even where their
    steps differ."""
    sc = core.config.scheduler
    # All three at once take at most half the pool, so none waits on pages (a pool fixed with
    # --num-kv-pages may be smaller than one max_model_len sequence).
    long_len = max(1, min(1024, core.max_model_len - 8, sc.max_num_batched_tokens - 40,
                          core.kv_capacity_tokens // 4 - 16))
    gen = torch.Generator().manual_seed(0)

    def add(i: int, prompt_len: int) -> None:
        ids = torch.randint(0, core.vocab_size, (prompt_len,), generator=gen).tolist()
        params = SamplingParams(max_tokens=4, ignore_eos=True, seed=i)
        core.scheduler.add_request(Request(request_id=f"{WARM_UP_REQUEST_PREFIX}{i}", prompt_token_ids=ids,
                                           sampling_params=params, eos_token_ids=core.eos_token_ids,
                                           arrival_time=time.time()))

    def run_out() -> None:
        for _ in range(_WARM_UP_MAX_STEPS):
            if not _warm_up_turn(core):
                break

    kv = core.kv
    offload, kv.offload = kv.offload, None
    counters = kv.prefix_queries, kv.prefix_hits
    try:
        add(0, long_len)
        add(1, 16)
        _warm_up_turn(core)
        add(2, long_len)  # joins the decodes of the first two
        run_out()
        for i, n in enumerate(n for n in WARM_UP_PROMPT_LENS if n <= long_len):
            add(3 + i, n)  # its prompt alone, then its decodes alone
            run_out()
    finally:
        core.abort_requests([r for r in list(core.scheduler.requests) if r.startswith(WARM_UP_REQUEST_PREFIX)])
        kv.offload = offload
        kv.prefix_queries, kv.prefix_hits = counters
        if core.scheduler.spec is not None:  # drafted and kept by the warm-up's requests: not the server's
            core.scheduler.spec.forget_counts()


def _warm_up_turn(core) -> bool:
    """One step of the warm-up; False when there was nothing left to run. A core in lockstep
    takes it as its loop takes every turn (`core.process.CoreLoop.run_lockstep`): it agrees
    with the other cores whether any has work, then makes its forward of the turn
    (`lockstep_forward`); False once no core has work."""
    if not core.in_lockstep:
        if not core.has_unfinished_requests():
            return False
        core.step()
        return True
    busy, _ = core.agree_with_cores()
    if not busy:
        return False
    core.lockstep_forward(lambda outputs: None)
    return True

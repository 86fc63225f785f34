"""The scheduler alone, without a model: how many steps a workload takes and how much is
recomputed after preemptions, for a KV pool of a given size, with and without the growth
reservation (`--kv-growth-reservation`). Every step "samples" a token for each request that
completes its sequence; requests of the `chat` workload stop at an exponentially distributed
length (EOS), the others at max_tokens.

    python -m pagoda_engine.bench.admission_sim --pages 26377    # the H100's pool for Llama-3.1-8B
"""

from __future__ import annotations

import argparse

import numpy as np

from pagoda_engine.bench.workloads import build_workload
from pagoda_engine.config import SchedulerConfig
from pagoda_engine.core.request import Request
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.scheduler import Scheduler
from pagoda_engine.sampling_params import SamplingParams

EOS, OTHER = 2, 5


def workload(name: str) -> list[tuple[list[int], int | None, int | None]]:
    """(prompt, max_tokens, stop after this many tokens or None) per request: T1 and N1 are the
    benchmark's own workloads (`workloads.py`); `chat` stops at an EOS."""
    if name in ("T1", "N1"):
        wl = build_workload(name, vocab_size=128_256)
        return [(prompt, n, None) for prompt, n in zip(wl.prompts, wl.output_lens)]
    if name == "chat":  # default max_tokens (the rest of the context), answers of 400 tokens on average
        rng = np.random.default_rng(0)
        return [(rng.integers(3, 128000, size=int(rng.integers(50, 2000))).tolist(), None,
                 max(1, int(rng.exponential(400)))) for _ in range(2000)]
    raise ValueError(f"unknown workload {name!r}")


def simulate(requests, num_pages: int, reserve: bool, max_num_seqs: int = 512, budget: int = 16384,
             max_model_len: int = 8192, page_size: int = 16) -> dict:
    kv = KVCacheManager(num_pages, page_size)
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  kv_growth_reservation=reserve), kv, max_model_len)
    stop_at = {}
    for i, (prompt, max_tokens, stop) in enumerate(requests):
        s.add_request(Request(request_id=str(i), prompt_token_ids=prompt, eos_token_ids=(EOS,),
                              sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=stop is None)))
        stop_at[str(i)] = stop
    steps = computed = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        steps += 1
        computed += out.num_tokens
        s.update_from_output(out, {
            x.request.request_id: EOS if stop_at[x.request.request_id] == x.request.num_output_tokens + 1 else OTHER
            for x in out.scheduled if x.completes_sequence})
    # Each request computes its prompt and every output token but the last (never fed back).
    needed = sum(len(p) - 1 + (stop or min(m or max_model_len, max_model_len - len(p))) for p, m, stop in requests)
    return {"steps": steps, "preemptions": s.num_preemptions, "tokens_computed": computed,
            "tokens_recomputed": computed - needed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda_engine.bench.admission_sim")
    p.add_argument("--pages", type=int, default=26377, help="KV pool size in pages of 16 tokens")
    p.add_argument("--workloads", default="T1,N1,chat")
    p.add_argument("--max-num-seqs", type=int, default=512)
    args = p.parse_args(argv)
    for name in args.workloads.split(","):
        reqs = workload(name)
        max_len = 8192 if name == "chat" else 131072
        for reserve in (False, True):
            r = simulate(reqs, args.pages, reserve, args.max_num_seqs, max_model_len=max_len)
            print(f"{name:5s} pages={args.pages} reservation={'on ' if reserve else 'off'} steps={r['steps']:6d} "
                  f"preemptions={r['preemptions']:5d} tokens recomputed={r['tokens_recomputed']:8d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

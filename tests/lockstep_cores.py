"""Engine cores whose MoE layers span two of them (`pagoda serve --data-parallel-size 2
--enable-expert-parallel`), one per spawned process (`spawned_ranks.run_ranks`), driven here as
`core.process.CoreLoop.run_lockstep` drives them. Not a test module: test modules anywhere under
tests/ import it by name."""

from __future__ import annotations

import dataclasses
import os
import time


def start_core(rank: int, port: int, **config):
    """Core `rank` of two, its experts across both, rendezvousing on `port`; `config`:
    `EngineConfig.from_kwargs`' other arguments."""
    from pagoda_engine.api.server.dp_client import rank_config
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core.engine_core import EngineCore

    cfg = EngineConfig.from_kwargs(data_parallel_size=2, enable_expert_parallel=True, **config)
    return EngineCore(rank_config(dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, data_parallel_master_port=port)), rank))


def add_greedy(core, rank: int, requests: list[tuple[list[int], int]]) -> list:
    """A greedy request (ignoring EOS) of each (prompt, max_tokens), queued on `core`."""
    from pagoda_engine.core.request import Request
    from pagoda_engine.sampling_params import SamplingParams

    added = [Request(request_id=f"r{rank}.{i}", prompt_token_ids=prompt, eos_token_ids=core.eos_token_ids,
                     sampling_params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     arrival_time=time.time()) for i, (prompt, n) in enumerate(requests)]
    for request in added:
        core.scheduler.add_request(request)
    return added


def run_lockstep(core) -> None:
    """`CoreLoop.run_lockstep`'s turns until both cores are done: each turn the cores agree whether
    any has work, and one with none runs a dummy batch (a core whose own requests are done keeps
    doing so for the other)."""
    while True:
        busy, done = core.agree_with_cores(stopping=not core.has_unfinished_requests())
        if done == 2:
            break
        if busy:
            core.lockstep_forward(lambda outputs: None)


def finish(core, results, result) -> None:
    """Hand `result` to the parent and end the process as the engine core process does
    (`run_engine_core`): no interpreter teardown, whose destruction of the gloo groups under
    their threads may abort it."""
    results.put(result)
    results.close()
    results.join_thread()  # the result has left this process
    core.close()
    os._exit(0)

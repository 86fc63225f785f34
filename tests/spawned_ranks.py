"""Real processes for multi-rank tests: one spawned process per rank, rendezvousing on a free port."""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable, ranks, args: Callable[[int], tuple], timeout: float = 300) -> list:
    """What `target(rank, port, *args(rank), results)` of each rank put on `results` (one item a
    process), once every process has exited 0; processes still alive at the end are killed."""
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, port, *args(rank), results)) for rank in ranks]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=timeout) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        return got
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()

"""Device time of a few kernel launches, for the kernel benchmarks (`lora_kernels`,
`moe_kernels`, `gemv_sweep`): the launches captured once as a CUDA graph and replayed, so the
host's launch cost is out of the figure, as it is when the engine replays its graphs."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replay_us(fn: Callable[[], object], launches: int = 1, replays: int = 50) -> float:
    """µs a launch: `fn` (which makes `launches` launches) run three times, then captured as one
    CUDA graph and replayed `replays` times between two events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (replays * launches)

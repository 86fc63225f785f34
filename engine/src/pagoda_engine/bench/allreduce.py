"""`python -m pagoda_engine.bench.allreduce`: how long the all-reduce of tensor parallelism takes on
this machine, at the sizes a step makes.

Two processes (one per GPU, NCCL; on a machine without two GPUs, two CPU processes over gloo), a
bf16 sum of `rows × hidden` values: by default a decode step of 400 sequences and prefill chunks of
8,192 and 16,384 tokens at Llama-3.1-8B's hidden size 4,096. Each size is timed eagerly and, on
GPUs, replayed from a CUDA graph (as decode steps run). A TP=2 step does two of these per layer.

    python -m pagoda_engine.bench.allreduce                  # 400, 8192, 16384 rows x 4096
    python -m pagoda_engine.bench.allreduce --rows 1,400 --hidden 2048
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GRAPH_CALLS = 20  # all-reduces captured in one graph, replayed as a whole


def _time_eager(x: torch.Tensor, iters: int) -> float:
    for _ in range(3):
        dist.all_reduce(x)
    _sync(x)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    _sync(x)
    return (time.perf_counter() - t0) / iters


def _time_graph(x: torch.Tensor, iters: int) -> float:
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dist.all_reduce(x)  # NCCL sets up its communicator outside the capture
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(GRAPH_CALLS):
                dist.all_reduce(x)
    graph.replay()
    torch.cuda.synchronize()
    replays = max(1, iters // GRAPH_CALLS)
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * GRAPH_CALLS)


def _sync(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.synchronize()


def _rank_main(rank: int, port: int, rows: list[int], hidden: int, iters: int, use_cuda: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if use_cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=2)
    try:
        device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
        for n in rows:
            x = torch.ones(n * hidden, dtype=torch.bfloat16, device=device)
            eager = _time_eager(x, iters)
            graph = _time_graph(x, iters) if use_cuda else None
            x.fill_(rank + 1)  # a check that the timed calls did sum: 1 + 2 on every rank
            dist.all_reduce(x)
            if not bool((x == 3).all()):
                raise RuntimeError(f"all-reduce of {n} rows gave a wrong sum on rank {rank}")
            if rank == 0:
                results.append({"rows": n, "bytes": x.numel() * x.element_size(), "eager_s": eager, "graph_s": graph})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(rows: list[int], hidden: int, iters: int) -> tuple[str, list[dict]]:
    """(backend, one result per size): seconds per all-reduce, eagerly and inside a graph (None on CPU)."""
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_rank_main, args=(_free_port(), rows, hidden, iters, use_cuda, results), nprocs=2)
        return ("nccl" if use_cuda else "gloo"), list(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="400,8192,16384", help="comma-separated row counts (tokens of a step)")
    parser.add_argument("--hidden", type=int, default=4096, help="values per row (the model's hidden size)")
    parser.add_argument("--iters", type=int, default=50, help="timed all-reduces per size")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows takes whole numbers separated by commas, got {args.rows!r}")
    if any(r < 1 for r in rows) or args.hidden < 1 or args.iters < 1:
        parser.error("--rows, --hidden and --iters must be >= 1")
    backend, results = run(rows, args.hidden, args.iters)
    print(f"all-reduce (sum) of bf16 rows x {args.hidden} over 2 ranks, {backend}:")
    for r in results:
        eager_us = r["eager_s"] * 1e6
        line = (f"  {r['rows']:>6} rows = {r['bytes'] / 1e6:8.2f} MB: eager {eager_us:8.1f} us "
                f"({r['bytes'] / r['eager_s'] / 1e9:6.1f} GB/s)")
        if r["graph_s"] is not None:
            line += f", in a CUDA graph {r['graph_s'] * 1e6:8.1f} us"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

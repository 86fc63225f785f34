"""`python -m pagoda_engine.bench.moe_dispatch`: one MoE layer whose experts span data-parallel
cores, timed through each way of reaching them (`--all2all-backend`): the all-gather /
reduce-scatter, the all-to-all with counts, and the all-to-all in two overlapped micro-batches
(`--enable-dbo`), at the token counts per core a step makes. The numbers `--all2all-backend`'s
choice rests on.

One process per rank (one per GPU, NCCL; on a machine without enough GPUs, CPU processes over
gloo), each a data-parallel core with its own tokens, the layer at Qwen3-30B-A3B's shape by default
(hidden 2,048, 128 experts of intermediate 768, top-8; bf16 on GPUs, float32 on CPU), random
weights. Every way's output is checked against the all-gather's before it is timed.

    python -m pagoda_engine.bench.moe_dispatch                       # 2 ranks; 1, 8, 32, 128, 512, 2048 tokens
    python -m pagoda_engine.bench.moe_dispatch --ranks 4 --tokens 16,256
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagoda_engine.worker.model.layers import TPGroup
from pagoda_engine.worker.model.moe import ALLGATHER, ALLTOALLV, DataParallelDispatch, FusedMoE, attach_dp_dispatch

WAYS = ((ALLGATHER, 1), (ALLTOALLV, 1), (ALLTOALLV, 2))  # (backend, micro-batches)


def _name(backend: str, microbatches: int) -> str:
    return backend + (" x2 (dbo)" if microbatches > 1 else "")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(rank: int, ranks: int, port: int, shape: dict, tokens: list[int], iters: int, use_cuda: bool,
               results) -> None:
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    timeout = datetime.timedelta(seconds=300)
    if use_cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(dist.PrefixStore("dispatch", store), rank, ranks, options)
    else:
        backend = dist.ProcessGroupGloo(dist.PrefixStore("dispatch", store), rank, ranks, timeout)
    counts = TPGroup(dist.ProcessGroupGloo(dist.PrefixStore("counts", store), rank, ranks, timeout), rank, ranks)
    group = TPGroup(backend, rank, ranks)
    torch.manual_seed(0)  # the router the same on every rank; each rank's experts its own
    with torch.device(device), torch.no_grad():
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            moe = FusedMoE(shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"], renormalize=True,
                           expert_parallel=True, data_parallel=(ranks, rank))
        finally:
            torch.set_default_dtype(prev)
        moe.gate.weight.normal_(0, 0.02)
        torch.manual_seed(1 + rank)
        moe.experts.w13.normal_(0, 0.02)
        moe.experts.w2.normal_(0, 0.02)
    for n in tokens:
        x = torch.randn(n, shape["hidden"], generator=torch.Generator().manual_seed(rank)).to(device, dtype)
        outs, times = {}, {}
        for backend_name, microbatches in WAYS:
            dispatch = DataParallelDispatch(group, counts, backend_name, device, microbatches)
            attach_dp_dispatch(moe, dispatch)

            def forward() -> torch.Tensor:
                with torch.no_grad():
                    dispatch.begin_forward(n)
                    return moe(x)

            outs[_name(backend_name, microbatches)] = forward()
            samples = []
            for _ in range(iters):
                counts.all_reduce(torch.zeros(1))  # start together
                _sync(device)
                t0 = time.perf_counter()
                forward()
                _sync(device)
                samples.append(time.perf_counter() - t0)
            times[_name(backend_name, microbatches)] = statistics.median(samples)
        reference = outs[_name(ALLGATHER, 1)]
        for name, out in outs.items():
            tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
            if not torch.allclose(out.float(), reference.float(), rtol=tolerance, atol=tolerance):
                raise RuntimeError(f"{name} gave another output than the all-gather at {n} tokens on rank {rank}")
        # The slowest rank's time is the layer's.
        slowest = counts.all_gather(torch.tensor([times[_name(b, m)] for b, m in WAYS], dtype=torch.float64))
        if rank == 0:
            worst = torch.stack(slowest).max(dim=0).values.tolist()
            results.append({"tokens": n, **{_name(b, m): t for (b, m), t in zip(WAYS, worst)}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(ranks: int, shape: dict, tokens: list[int], iters: int) -> tuple[str, list[dict]]:
    """(collectives' backend, per token count the median seconds of one layer through each way)."""
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= ranks
    with mp.Manager() as manager:
        results = manager.list()
        mp.spawn(_rank_main, args=(ranks, _free_port(), shape, tokens, iters, use_cuda, results), nprocs=ranks)
        return ("nccl" if use_cuda else "gloo"), sorted(results, key=lambda r: r["tokens"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel cores (GPUs, or CPU processes)")
    parser.add_argument("--tokens", default="1,8,32,128,512,2048", help="comma-separated tokens per core")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=768, help="each expert's intermediate size")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20, help="timed layers per token count and way")
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens takes whole numbers separated by commas, got {args.tokens!r}")
    if min(tokens) < 1 or min(args.ranks, args.hidden, args.experts, args.intermediate, args.top_k, args.iters) < 1:
        parser.error("--tokens, --ranks, --hidden, --experts, --intermediate, --top-k and --iters must be >= 1")
    if args.ranks < 2 or args.experts % args.ranks or args.top_k > args.experts:
        parser.error("--ranks must be >= 2 and divide --experts; --top-k must not exceed --experts")
    shape = dict(hidden=args.hidden, experts=args.experts, intermediate=args.intermediate, top_k=args.top_k)
    backend, results = run(args.ranks, shape, tokens, args.iters)
    names = [_name(b, m) for b, m in WAYS]
    print(f"one MoE layer (hidden {args.hidden}, {args.experts} experts x {args.intermediate}, top-{args.top_k}) "
          f"across {args.ranks} data-parallel cores, {backend}: median ms of the slowest rank")
    print(f"  {'tokens/core':>11}  " + "  ".join(f"{n:>24}" for n in names))
    for r in results:
        print(f"  {r['tokens']:>11}  " + "  ".join(f"{r[n] * 1e3:>24.3f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What one forward step costs on the GPU, eagerly and through the engine's CUDA graphs: the host's
launch time, the wall time and the GPU's own time, for prefill-only and mixed steps of several
sizes. A step is host-bound where its launch takes longer than its kernels; the piecewise graphs
exist for those steps.

    python -m pagoda_engine.bench.step_costs            # Llama-3.1-8B's shapes, dummy weights
    python -m pagoda_engine.bench.step_costs --verify-k 4   # speculative decoding's verification steps

With `--verify-k K` the engine speculates (ngram, k = K) and the table is of verification steps
(one to eight requests, each its last token and K drafts over a context of 640 tokens, L1's
middle) beside the one-token decode step of the same requests: eager, through the piecewise
graphs (how verification steps ran before they had graphs of their own) and through the graph
the engine picks (the verification graph; the decode graph for the decode rows).

Each step's pages are fresh (cached tokens are whatever the pool holds: the cost is the same);
every row is the median of 10 runs after 3 warm-ups, and the GPU time is taken with the GPU
held back until the whole step is queued. The last column compares the two paths' hidden states.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagoda_engine.bench import add_arguments
from pagoda_engine.bench.offline import _build
from pagoda_engine.worker.attention.base import AttentionBatch

# name -> (context lengths of the decodes, lengths of the prefill chunks)
SHAPES = {
    "prefill 16": ([], [16]),
    "prefill 128": ([], [128]),
    "prefill 250": ([], [250]),
    "prefill 1024": ([], [1024]),
    "8 decodes + 1024": ([1100] * 8, [1024]),
    "32 decodes + 128": ([512] * 32, [128]),
    "64 decodes + 64": ([512] * 64, [64]),
    "128 decodes + 96": ([1024] * 128, [96]),
    "64 decodes + 256": ([512] * 64, [256]),
    "200 decodes + 200": ([800] * 200, [200]),
    "prefill 300": ([], [300]),
    "prefill 448": ([], [448]),
    "64 decodes + 320": ([512] * 64, [320]),
    "128 decodes + 384": ([1024] * 128, [384]),
}


def make_step(decode_contexts: list[int], prefill_lens: list[int], page_size: int, device: torch.device):
    """(batch, input ids, positions) of decodes over `decode_contexts` tokens (the new one
    included) followed by prefill chunks from position 0, on consecutive fresh pages."""
    page = 1
    tables, query_lens, seq_lens, slots, positions = [], [], [], [], []
    for length, is_decode in [(c, True) for c in decode_contexts] + [(n, False) for n in prefill_lens]:
        table = list(range(page, page + -(-length // page_size)))
        page += len(table)
        new = [length - 1] if is_decode else list(range(length))
        tables.append(table)
        query_lens.append(len(new))
        seq_lens.append(length)
        slots += [table[p // page_size] * page_size + p % page_size for p in new]
        positions += new
    batch = AttentionBatch(query_lens=query_lens, seq_lens=seq_lens, page_tables=tables,
                           slot_mapping=torch.tensor(slots, device=device), num_decodes=len(decode_contexts))
    ids = torch.randint(0, 1000, (len(positions),), device=device)
    return batch, ids, torch.tensor(positions, device=device)


# name -> (requests, new tokens a request, context length a request (new tokens included))
VERIFY_SHAPES = [(1, 640), (2, 640), (4, 640), (8, 640), (1, 2000)]


def make_verify_step(num_reqs: int, new_tokens: int, context: int, page_size: int, device: torch.device):
    """(batch, input ids, positions) of `num_reqs` requests each feeding its last `new_tokens` of
    `context` tokens (a verification step: the last token and its drafts), on fresh pages."""
    page = 1
    tables, slots, positions = [], [], []
    for _ in range(num_reqs):
        table = list(range(page, page + -(-context // page_size)))
        page += len(table)
        new = list(range(context - new_tokens, context))
        tables.append(table)
        slots += [table[p // page_size] * page_size + p % page_size for p in new]
        positions += new
    batch = AttentionBatch(query_lens=[new_tokens] * num_reqs, seq_lens=[context] * num_reqs, page_tables=tables,
                           slot_mapping=torch.tensor(slots, device=device),
                           num_decodes=num_reqs if new_tokens == 1 else 0)
    ids = torch.randint(0, 1000, (len(positions),), device=device)
    return batch, ids, torch.tensor(positions, device=device)


def measure(fn, repeats: int = 10) -> tuple[float, float, float, torch.Tensor]:
    """(launch ms, wall ms, GPU ms, output) of `fn()`, medians over `repeats` runs."""
    for _ in range(3):
        fn()
    launches, walls = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        launches.append(t1 - t0)
        walls.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # hold the GPU until the whole step is queued
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    torch.cuda.synchronize()
    median = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return median(launches), median(walls), start.elapsed_time(end), out.float().clone()


def main(argv: list[str] | None = None) -> None:
    own = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    own.add_argument("--verify-k", type=int, default=0, help="time verification steps of k drafts a request")
    verify_k = own.parse_args(argv).verify_k
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine = ["latency", "--max-num-seqs", "256"]
    if verify_k:
        engine += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": verify_k})]
    args = parser.parse_args(engine)
    core, _ = _build(args)
    if verify_k:
        verification_costs(core, verify_k)
        return
    executor = core.executor
    attn, model = executor.attn, executor.model
    sizes = executor.piecewise.token_sizes if executor.piecewise else []
    print(f"GPU {torch.cuda.get_device_name()}; piecewise graphs at {sizes} tokens")

    def eager(batch, ids, positions):
        attn.plan(batch)
        return model(ids, positions, attn)

    print(f"{'step':20s} {'tokens':>6s} | eager: launch  wall   GPU  | graphs: launch  wall   GPU  | max |diff|")
    with torch.inference_mode():
        for name, (decodes, prefills) in SHAPES.items():
            batch, ids, positions = make_step(decodes, prefills, core.config.cache.block_size, core.device)
            e = measure(lambda: eager(batch, ids, positions))
            g = measure(lambda: executor.execute_model(ids, positions, batch))
            diff = (e[3] - g[3]).abs().max().item()
            print(f"{name:20s} {batch.num_tokens:6d} |   {e[0]:6.2f} {e[1]:6.2f} {e[2]:6.2f}  |   "
                  f"{g[0]:6.2f} {g[1]:6.2f} {g[2]:6.2f}   | {diff:.3g}")


if __name__ == "__main__":
    main()


def verification_costs(core, k: int) -> None:
    """The `--verify-k` table (see the module)."""
    executor = core.executor
    attn, model, piecewise = executor.attn, executor.model, executor.piecewise
    verify = executor.worker.verify_graphs
    print(f"GPU {torch.cuda.get_device_name()}; verification graphs at "
          f"{verify.batch_sizes if verify else 'none'} requests of {k + 1} rows")

    def eager(batch, ids, positions):
        attn.plan(batch)
        return model(ids, positions, attn)

    print(f"{'step':24s} | eager: launch  wall   GPU  | piecewise: launch  wall   GPU  | "
          f"engine's graph: launch  wall   GPU  | max |diff| vs eager")
    with torch.inference_mode():
        for num_reqs, context in VERIFY_SHAPES:
            for new in (1, k + 1):
                batch, ids, positions = make_verify_step(num_reqs, new, context, core.config.cache.block_size,
                                                         core.device)
                name = f"{num_reqs} x {'decode' if new == 1 else f'verify {new}'} @{context}"
                e = measure(lambda: eager(batch, ids, positions))
                p = measure(lambda: piecewise.run(ids, positions, batch)) if piecewise is not None else None
                g = measure(lambda: executor.execute_model(ids, positions, batch))
                cells = "   ".join(f"{m[0]:6.2f} {m[1]:6.2f} {m[2]:6.2f}" if m else "     -      -      -"
                                   for m in (e, p, g))
                print(f"{name:24s} |   {cells}   | {(e[3] - g[3]).abs().max().item():.3g}")

"""What one forward step costs on the GPU, eagerly and through the engine's CUDA graphs: the host's
launch time, the wall time and the GPU's own time, for prefill-only and mixed steps of several
sizes. A step is host-bound where its launch takes longer than its kernels; the piecewise graphs
exist for those steps.

    python -m pagoda_engine.bench.step_costs            # Llama-3.1-8B's shapes, dummy weights

Each step's pages are fresh (cached tokens are whatever the pool holds: the cost is the same);
every row is the median of 10 runs after 3 warm-ups, and the GPU time is taken with the GPU
held back until the whole step is queued. The last column compares the two paths' hidden states.
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(["latency", "--max-num-seqs", "256"])
    core, _ = _build(args)
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

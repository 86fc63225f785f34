"""`python -m pagoda_engine.bench.offload_copy`: host↔device copies of the KV offload CPU tier
through the engine's own data plane (`worker.kv_offload.KVOffloader`), against the pinned-copy
bandwidth of one big tensor measured first.

On CUDA it builds a KV pool shaped like Llama-3.1-8B's (32 layers of `[pages, 2, 16, 8, 128]`
bf16: 2 MiB a page), stores `--pages` device pages (in a random order, as the block pool hands
them out) into CPU slots and loads them back into other device pages, `--load-pages` per load
(256: one 4,096-token context), every load queued before the first is waited for. It does this
twice: with contiguous slots (how the tier index allocates one store's pages) and with
fragmented ones (a random permutation: the worst case). Printed per direction: GB/s while the
copies ran and its share of the pinned bandwidth, and the host time of each `store` / `load`
call (what the engine core's thread spends); the pages that came back are checked bit for bit.
On CUDA it also times one load issued while the compute stream is busy with a `--step-ms` step
(a sleep kernel standing in for the forward in flight when the core starts a load): a load
that waits for the step before copying takes the step plus the copy, one whose copy overlaps
the step about the longer of the two.

On CPU (no CUDA) the same path runs on a tiny pool, so that a CPU test covers it; the pinned
bandwidth and the share are then not measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pagoda_engine.bench.multiturn import measure_pinned_bandwidth
from pagoda_engine.kv_tiers import CPU, OffloadSetup
from pagoda_engine.worker.kv_offload import KVOffloader

# Llama-3.1-8B's KV shape (one rank, bf16): 32 layers, 8 KV heads of 128, 16-token pages.
LLAMA_8B = dict(layers=32, kv_heads=8, head_dim=128, page_size=16)
TINY = dict(layers=2, kv_heads=2, head_dim=8, page_size=4)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pages", type=int, default=None, help="pages stored and loaded back (1,024 on CUDA, 64 on CPU)")
    p.add_argument("--load-pages", type=int, default=None, help="pages per load (256 on CUDA, 16 on CPU)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per slot layout (the best is kept)")
    p.add_argument("--step-ms", type=float, default=10.0, help="the busy step one load is issued behind (CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="also write the results as JSON to this file")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(offloader: KVOffloader, store_ids: set[int], load_ids: set[int]) -> None:
    """Poll until every store and load named has finished (the engine core's own loop); a load
    is reported once its copies are queued, and done when the stream that waits for them is."""
    loading = bool(load_ids)
    while store_ids or load_ids:
        events = offloader.poll()
        store_ids.difference_update(events.copied)
        load_ids.difference_update(load_id for load_id, _, _ in events.loaded)
        if store_ids or load_ids:
            time.sleep(0.0005)
    if loading:
        offloader.wait_for_loads()  # what the next step does
        _sync(offloader.device)


def _round(offloader: KVOffloader, src: list[int], dst: list[int], slots: list[int], load_pages: int,
           ids: list[int]) -> dict:
    """Store `src` into `slots`, then load them back into `dst`; times and host costs."""
    device = offloader.device
    n = len(src)
    _sync(device)
    ids[0] += 1
    store_id = ids[0]
    t0 = time.perf_counter()
    offloader.store(store_id, src, slots, [None] * n, [None] * n, [])
    t_call = time.perf_counter() - t0
    _sync(device)
    store_s = time.perf_counter() - t0
    _drain(offloader, {store_id}, set())

    load_ids, calls = set(), []
    t0 = time.perf_counter()
    for start in range(0, n, load_pages):
        ids[0] += 1
        load_ids.add(ids[0])
        t1 = time.perf_counter()
        offloader.load(ids[0], dst[start:start + load_pages], [(CPU, s) for s in slots[start:start + load_pages]])
        calls.append(time.perf_counter() - t1)
    _sync(device)
    load_s = time.perf_counter() - t0
    _drain(offloader, set(), load_ids)
    return {"store_s": store_s, "store_call_s": t_call, "load_s": load_s, "load_call_s": max(calls)}


def _load_behind_step(offloader: KVOffloader, dst: list[int], slots: list[int], step_s: float, ids: list[int]) -> float:
    """Seconds from issuing one load while the current stream runs a `step_s` kernel until it is done."""
    device = offloader.device
    cycles_per_s = _sleep_cycles_per_s(device)
    _sync(device)
    torch.cuda._sleep(int(step_s * cycles_per_s))
    ids[0] += 1
    t0 = time.perf_counter()
    offloader.load(ids[0], dst, [(CPU, s) for s in slots])
    _drain(offloader, set(), {ids[0]})
    return time.perf_counter() - t0


def _sleep_cycles_per_s(device: torch.device) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _sync(device)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / (start.elapsed_time(end) / 1e3)


def run_offload_copy(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = dict(LLAMA_8B if cuda else TINY)
    for name in shape:
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
    pages = args.pages or (1024 if cuda else 64)
    load_pages = args.load_pages or (256 if cuda else 16)
    if pages < 1 or load_pages < 1 or args.repeats < 1:
        raise SystemExit("error: --pages, --load-pages and --repeats must be >= 1")
    dtype = torch.bfloat16
    h2d = measure_pinned_bandwidth(to_device=True)
    d2h = measure_pinned_bandwidth(to_device=False)
    gen = torch.Generator().manual_seed(args.seed)
    num_pages = 2 * pages + 1  # page 0 is the null page: stored pages, then the pages loads fill
    caches = [torch.randn(num_pages, 2, shape["page_size"], shape["kv_heads"], shape["head_dim"], generator=gen,
                          dtype=torch.float32).to(dtype).to(device) for _ in range(shape["layers"])]
    offloader = KVOffloader(caches, OffloadSetup(b"\0" * 16, num_cpu_slots=pages), b"\0" * 16)
    page_bytes = offloader.payload_bytes
    order = torch.randperm(2 * pages, generator=gen).add(1).tolist()
    src, dst = order[:pages], order[pages:]
    # Contiguous last: the bit check and the load behind a step read the slots it stored into.
    layouts = {"fragmented": torch.randperm(pages, generator=gen).tolist(), "contiguous": list(range(pages))}
    ids = [0]
    _round(offloader, src, dst, layouts["contiguous"], load_pages, ids)  # warm-up: allocator, kernels
    result = {"bench": "offload_copy", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "torch": torch.__version__, **shape, "dtype": str(dtype).removeprefix("torch."),
              "page_bytes": page_bytes, "pages": pages, "load_pages": load_pages,
              "pinned_h2d_Bps": h2d, "pinned_d2h_Bps": d2h, "layouts": {}}
    for name, slots in layouts.items():
        rounds = [_round(offloader, src, dst, slots, load_pages, ids) for _ in range(args.repeats)]
        best = {k: min(r[k] for r in rounds) for k in rounds[0]}
        nbytes = pages * page_bytes
        result["layouts"][name] = {
            "store_Bps": nbytes / best["store_s"], "load_Bps": nbytes / best["load_s"],
            "store_share": nbytes / best["store_s"] / d2h if d2h else None,
            "load_share": nbytes / best["load_s"] / h2d if h2d else None,
            "store_call_ms": 1e3 * best["store_call_s"], "load_call_ms": 1e3 * best["load_call_s"]}
    back = torch.stack([c[dst] for c in caches], 1)
    result["bit_identical"] = bool(torch.equal(back.view(torch.int16), torch.stack([c[src] for c in caches], 1)
                                               .view(torch.int16)))
    if cuda:
        copy_s = load_pages * page_bytes / result["layouts"]["contiguous"]["load_Bps"]
        behind = min(_load_behind_step(offloader, dst[:load_pages], layouts["contiguous"][:load_pages],
                                       args.step_ms / 1e3, ids) for _ in range(args.repeats))
        result["load_behind_step"] = {"step_ms": args.step_ms, "copy_ms": 1e3 * copy_s, "latency_ms": 1e3 * behind}
    offloader.close()
    _print(result)
    if not result["bit_identical"]:
        raise SystemExit("error: the pages loaded back differ from those stored")
    return result


def _print(r: dict) -> None:
    print(f"=== KV offload copies: {r['pages']} pages of {r['page_bytes'] / 2**20:.2f} MiB ({r['layers']} layers, "
          f"{r['kv_heads']} kv heads x {r['head_dim']}, {r['page_size']}-token pages, {r['dtype']}) on {r['device']}; "
          f"loads of {r['load_pages']} pages ===")
    for direction, key in (("host->device", "pinned_h2d_Bps"), ("device->host", "pinned_d2h_Bps")):
        bw = r[key]
        print(f"pinned copy of one 1 GiB tensor, {direction}: " + (f"{bw / 1e9:.1f} GB/s" if bw else "n/a (no CUDA)"))
    for name, x in r["layouts"].items():
        for op, share in (("store", "store_share"), ("load", "load_share")):
            pct = f" = {100 * x[share]:.1f} % of pinned" if x[share] else ""
            print(f"{name:10s} slots, {op:5s}: {x[f'{op}_Bps'] / 1e9:7.2f} GB/s{pct}; host time per call "
                  f"{x[f'{op}_call_ms']:.2f} ms")
    b = r.get("load_behind_step")
    if b:
        print(f"one load of {r['load_pages']} pages issued behind a {b['step_ms']:.1f} ms step: done after "
              f"{b['latency_ms']:.2f} ms (the copy alone {b['copy_ms']:.2f} ms; step + copy "
              f"{b['step_ms'] + b['copy_ms']:.2f} ms)")
    print(f"pages back bit-identical: {r['bit_identical']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda_engine.bench.offload_copy", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    result = run_offload_copy(args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`pagoda bench multiturn`: workload M1 — multi-turn conversations whose contexts outgrow the
device's KV pool, the case the KV offload tiers exist for.

U users (`--users`), each with a context of its own (`--context-len`, 4,096 tokens) and `--turns`
turns (8): each turn sends the whole conversation so far plus `--new-tokens` (128) new prompt
tokens and asks for `--output-len` (256) tokens (temperature 1.0, `ignore_eos`, streamed). The
model's reply joins the conversation (its token ids read back from the stream when the server
uses the benchmark's synthetic one-word-per-id tokenizer, else stand-in ids of the same length).
Turns arrive as one Poisson process of `--request-rate` per second, handed to the users in turn
(arrival k is turn k // U of user k % U), and a user's turn waits for its previous reply.

Unless `--num-gpu-blocks-override` is given, the device pool is capped at a third of the
working set (every conversation's final context), so that later turns find their prefix on the
device only if something kept it: run once with `--kv-offload-cpu-gb` sized to hold the working
set, once without, and compare. Printed: TTFT p50/p99 of first turns and of later turns, output
tokens/s, the hit rate of each tier (device, cpu, disk, remote) over the run from the server's
/metrics, the bytes moved between host and device per second — on average over the run and while
the tiers' copies ran (timed on the device by the engine) — against a pinned-memory copy
bandwidth measured here first, and how long a load took from the schedule that starts it to the
one that lands it (the loads' latency histogram: the step after a landing waits on the device for
what is left of its copies); `python -m pagoda_engine.bench.offload_copy` measures the copies alone.

The server is `pagoda serve` started here (as `pagoda bench serve` does) or `--base-url`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from pagoda_engine.bench.serve import (
    LaunchedServer,
    RequestResult,
    _one_request,
    _percentiles,
    _served_model,
    _vocab_size,
    arrival_offsets,
    with_token_tokenizer,
)

M1_OUTPUT_LEN = 256
_LOAD_SAMPLE_S = 0.25  # how often the run reads the server's running/waiting/KV-usage gauges
_ID_WORD = re.compile(r"<(\d+)>")
TIERS = ("cpu", "disk", "remote")


def add_multiturn_arguments(p: argparse.ArgumentParser) -> None:
    """M1's own flags; --output-len (256), --request-rate, --base-url and the engine's flags are shared
    with `pagoda bench serve`."""
    p.add_argument("--users", type=int, default=16, help="conversations (U)")
    p.add_argument("--turns", type=int, default=8, help="turns per conversation")
    p.add_argument("--context-len", type=int, default=4096, help="each conversation's first context, in tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="new prompt tokens per turn")


def working_set_pages(users: int, turns: int, context_len: int, new_tokens: int, output_len: int, page_size: int) -> int:
    """Pages of every conversation's final context (what the tiers must hold to serve every turn)."""
    final = context_len + turns * new_tokens + (turns - 1) * output_len
    return users * -(-final // page_size)


def measure_pinned_bandwidth(nbytes: int = 1 << 30, iters: int = 10, to_device: bool = True) -> float | None:
    """Host (pinned) → device copy bandwidth in bytes/s (device → host with `to_device=False`);
    None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst, src = (dev, host) if to_device else (host, dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    bw = nbytes * iters / (time.perf_counter() - t0)
    del host, dev
    torch.cuda.empty_cache()
    return bw


def _metric_samples(text: str):
    """(name{tier} or name, value) of every sample of a /metrics page, one per engine."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield f"{s.name}{{{s.labels['tier']}}}" if "tier" in s.labels else s.name, s.value


def _metrics(base_url: str) -> dict[str, float]:
    """The server's counters summed over engines: name{tier} → value."""
    out: dict[str, float] = {}
    for key, value in _metric_samples(httpx.get(f"{base_url}/metrics", timeout=30).text):
        out[key] = out.get(key, 0.0) + value
    return out


def _hit_rates(before: dict[str, float], after: dict[str, float]) -> dict[str, dict]:
    """Per tier over the run: tokens looked up there, found there, and the rate."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries = delta("pagoda:prefix_cache_queries_total")
    lower_hits = sum(delta(f"pagoda:kv_offload_hit_tokens_total{{{t}}}") for t in TIERS)
    device_hits = delta("pagoda:prefix_cache_hits_total") - lower_hits
    rates = {"device": {"queried_tokens": int(queries), "hit_tokens": int(device_hits),
                        "hit_rate": round(device_hits / queries, 4) if queries else None}}
    for tier in TIERS:
        if f"pagoda:kv_offload_hit_tokens_total{{{tier}}}" not in after:
            continue
        hit, miss = delta(f"pagoda:kv_offload_hit_tokens_total{{{tier}}}"), delta(f"pagoda:kv_offload_miss_tokens_total{{{tier}}}")
        rates[tier] = {"queried_tokens": int(hit + miss), "hit_tokens": int(hit),
                       "hit_rate": round(hit / (hit + miss), 4) if hit + miss else None}
    return rates


class _Conversation:
    def __init__(self, rng: np.random.Generator, vocab: int, args: argparse.Namespace):
        self.rng, self.vocab, self.args = rng, vocab, args
        self.tokens = rng.integers(0, vocab, size=args.context_len).tolist()
        self.ready_at = 0.0  # perf_counter when its previous reply ended

    def next_prompt(self) -> list[int]:
        self.tokens += self.rng.integers(0, self.vocab, size=self.args.new_tokens).tolist()
        return list(self.tokens)

    def add_reply(self, text: str) -> None:
        ids = [int(m) for m in _ID_WORD.findall(text)]
        if len(ids) != self.args.output_len or any(i >= self.vocab for i in ids):
            ids = self.rng.integers(0, self.vocab, size=self.args.output_len).tolist()  # a real tokenizer's text
        self.tokens += ids


async def _user(client, url: str, model: str, conv: _Conversation, offsets: list[float], t0: float,
                output_len: int) -> list[RequestResult]:
    results = []
    for offset in offsets:
        body = {"model": model, "prompt": conv.next_prompt(), "max_tokens": output_len, "temperature": 1.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        result = await _one_request(client, url, body, max(offset, time.perf_counter() - t0), t0, keep_text=True)
        results.append(result)
        if not result.ok:
            break  # the conversation cannot go on without this reply
        conv.add_reply(result.text)
    return results


# What `_sample_load` reads from the server's /metrics while the turns run.
_LOAD_GAUGES = {"pagoda:num_requests_running": "running", "pagoda:num_requests_waiting": "waiting",
                "pagoda:kv_cache_usage_perc": "kv_usage"}


async def _sample_load(client: httpx.AsyncClient, base_url: str, every_s: float, samples: list[dict]) -> None:
    """Until cancelled: the server's running and waiting requests and its KV pool's usage (summed
    over engines; usage averaged), every `every_s` seconds. What M1's throughput is made of: a
    pool that holds few conversations at once runs small decode batches."""
    while True:
        try:
            text = (await client.get(f"{base_url}/metrics")).text
        except httpx.HTTPError:
            text = ""
        sample: dict[str, list[float]] = {}
        for key, value in _metric_samples(text):
            if key in _LOAD_GAUGES:
                sample.setdefault(_LOAD_GAUGES[key], []).append(value)
        if sample:
            samples.append({"running": sum(sample.get("running", [0.0])), "waiting": sum(sample.get("waiting", [0.0])),
                            "kv_usage": statistics.fmean(sample.get("kv_usage", [0.0]))})
        await asyncio.sleep(every_s)


def load_summary(samples: list[dict]) -> dict:
    """Means (and the running count's quartiles) of `_sample_load`'s samples; None each without any."""
    if not samples:
        return {"samples": 0, "running_mean": None, "running_p25_p50_p75": None, "waiting_mean": None,
                "kv_usage_mean": None}
    running = [s["running"] for s in samples]
    return {"samples": len(samples), "running_mean": round(statistics.fmean(running), 2),
            "running_p25_p50_p75": [float(x) for x in np.percentile(running, [25, 50, 75])],
            "waiting_mean": round(statistics.fmean(s["waiting"] for s in samples), 2),
            "kv_usage_mean": round(statistics.fmean(s["kv_usage"] for s in samples), 4)}


async def _drive(base_url: str, model: str, vocab: int, args: argparse.Namespace) -> tuple[list, list, float, list]:
    rng = np.random.default_rng(0)
    convs = [_Conversation(rng, vocab, args) for _ in range(args.users)]
    offsets = arrival_offsets(args.users * args.turns, args.request_rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    samples: list[dict] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        sampler = asyncio.create_task(_sample_load(client, base_url, _LOAD_SAMPLE_S, samples))
        t0 = time.perf_counter()
        try:
            per_user = await asyncio.gather(*[
                _user(client, f"{base_url}/v1/completions", model, conv, offsets[u::args.users], t0, args.output_len)
                for u, conv in enumerate(convs)])
        finally:
            sampler.cancel()
        duration = time.perf_counter() - t0
    first = [r[0] for r in per_user if r]
    later = [x for r in per_user for x in r[1:]]
    return first, later, duration, samples


def run_multiturn(args: argparse.Namespace) -> dict:
    if args.num_prompts is not None or args.input_len is not None:
        raise SystemExit("error: M1 is sized by --users, --turns, --context-len and --new-tokens; "
                         "--num-prompts and --input-len do not apply")
    args.output_len = args.output_len or M1_OUTPUT_LEN
    for name in ("users", "turns", "context_len", "new_tokens", "output_len"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
    if args.request_rate <= 0:
        raise SystemExit("error: --request-rate must be > 0 (or inf)")
    pages = working_set_pages(args.users, args.turns, args.context_len, args.new_tokens, args.output_len,
                              args.block_size)
    final_len = args.context_len + args.turns * (args.new_tokens + args.output_len)
    if args.max_model_len is None:
        args.max_model_len = final_len
    if args.num_gpu_blocks_override is None and args.num_kv_pages is None and not args.base_url:
        # A third of the working set, but never less than two of the longest conversations.
        args.num_gpu_blocks_override = max(-(-pages // 3), 2 * -(-final_len // args.block_size)) + 1
    bandwidth = measure_pinned_bandwidth()
    server, base_url = None, (args.base_url or "").rstrip("/")
    if not base_url:
        if args.served_model_name is None:
            args.served_model_name = Path(args.model).name
        args.model = with_token_tokenizer(args.model)
        server = LaunchedServer(args)
        server.start()
        base_url = server.url
    try:
        model = args.served_model or _served_model(base_url)
        pool = args.num_gpu_blocks_override or args.num_kv_pages
        print(f"=== pagoda bench multiturn: workload M1 ({args.users} users x {args.turns} turns; context "
              f"{args.context_len} tokens, +{args.new_tokens} prompt / {args.output_len} output tokens per turn; "
              f"Poisson arrivals at {args.request_rate} turns/s) against {base_url} ===")
        if pool:
            print(f"device pool: {pool} pages; working set {pages} pages ({pages / pool:.1f} x the pool); "
                  f"CPU tier {args.kv_offload_cpu_gb:g} GiB")
        before = _metrics(base_url)
        first, later, duration, samples = asyncio.run(_drive(base_url, model, _vocab_size(args), args))
        after = _metrics(base_url)
    finally:
        if server is not None:
            server.stop()
    ok = [r for r in first + later if r.ok]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    moved = delta("pagoda:kv_offload_stored_bytes_total{cpu}") + delta("pagoda:kv_offload_loaded_bytes_total{cpu}")
    loads = delta("pagoda:kv_offload_load_seconds_count{cpu}")
    result = {
        "bench": "multiturn", "workload": "M1", "users": args.users, "turns": args.turns,
        "context_len": args.context_len, "new_tokens": args.new_tokens, "output_len": args.output_len,
        "request_rate": args.request_rate, "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "kv_offload_cpu_gb": args.kv_offload_cpu_gb, "working_set_pages": pages,
        "completed": len(ok), "failed": len(first) + len(later) - len(ok),
        "errors": sorted({r.error for r in first + later if r.error})[:5], "duration_s": round(duration, 3),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / duration, 1),
        "ttft_first_turn_ms": _percentiles([r.ttft for r in first if r.ok]),
        "ttft_later_turns_ms": _percentiles([r.ttft for r in later if r.ok]),
        "hit_rates": _hit_rates(before, after),
        # The engine's batches: steps (vLLM's iteration_tokens histogram) and the sampled gauges.
        "steps": int(steps := delta("pagoda:iteration_tokens_total_count")),
        "wall_ms_per_step": round(1e3 * duration / steps, 3) if steps else None,  # idle time included
        "mean_tokens_per_step": round(delta("pagoda:iteration_tokens_total_sum") / steps, 2) if steps else None,
        "load": load_summary(samples),
        "host_device_bytes_per_s": round(moved / duration, 1),
        # Loads from the CPU tier, and their mean time from the schedule that starts one to the one that lands it.
        "cpu_loads": int(loads),
        "cpu_load_landed_ms_mean": (round(1e3 * delta("pagoda:kv_offload_load_seconds_sum{cpu}") / loads, 3)
                                    if loads else None),
        "pinned_copy_bandwidth_Bps": bandwidth,
        # The copies themselves, timed on the device by the engine (load and store together).
        "copy_bytes_per_s": (round(delta("pagoda:kv_offload_copy_bytes_total") / copy_s, 1)
                             if (copy_s := delta("pagoda:kv_offload_copy_seconds_total")) else None),
    }
    _print(result)
    return result


def _print(r: dict) -> None:
    print(f"completed {r['completed']} turns in {r['duration_s']:.2f} s ({r['failed']} failed)")
    for error in r["errors"]:
        print(f"  error: {error}")
    for name, label in (("ttft_first_turn_ms", "first turns"), ("ttft_later_turns_ms", "later turns")):
        s = r[name]
        if s["p50"] is not None:
            print(f"TTFT {label:12s} ms: p50 {s['p50']:.2f}   p99 {s['p99']:.2f}")
    print(f"output tokens/s: {r['output_tokens_per_s']:,.1f}")
    load = r["load"]
    if r["steps"]:
        print(f"engine steps: {r['steps']:,} ({r['wall_ms_per_step']:.2f} ms of the run's wall time each, "
              f"idle time included), {r['mean_tokens_per_step']:.1f} tokens each on average")
    if load["samples"]:
        p25, p50, p75 = load["running_p25_p50_p75"]
        print(f"running requests: mean {load['running_mean']:.2f} (p25 / p50 / p75 {p25:g} / {p50:g} / {p75:g}); "
              f"waiting: mean {load['waiting_mean']:.2f}; KV pool in use: mean {100 * load['kv_usage_mean']:.1f} % "
              f"({load['samples']} samples of the server's gauges)")
    for tier, h in r["hit_rates"].items():
        rate = "n/a" if h["hit_rate"] is None else f"{100 * h['hit_rate']:.1f} %"
        print(f"hit rate {tier:7s}: {rate} ({h['hit_tokens']:,} of {h['queried_tokens']:,} tokens looked up there)")
    bw = r["pinned_copy_bandwidth_Bps"]
    against = f" ({100 * r['host_device_bytes_per_s'] / bw:.1f} % of" if bw else " (pinned copy bandwidth: no CUDA"
    print(f"host<->device: {r['host_device_bytes_per_s'] / 1e9:.3f} GB/s on average over the run{against}"
          f"{f' {bw / 1e9:.1f} GB/s measured)' if bw else ')'}")
    if r["cpu_loads"]:
        print(f"loads from the CPU tier: {r['cpu_loads']:,}, landed {r['cpu_load_landed_ms_mean']:.2f} ms after the "
              f"schedule that started them on average (the step after waits on the device for the rest of the copies)")
    if r["copy_bytes_per_s"] is not None:
        share = f" = {100 * r['copy_bytes_per_s'] / bw:.1f} % of the pinned copy bandwidth" if bw else ""
        print(f"while the tiers' copies ran (device time, loads and stores): {r['copy_bytes_per_s'] / 1e9:.3f} GB/s{share}")
    if not math.isfinite(r["request_rate"]):
        print("(turns sent as fast as each conversation allows)")

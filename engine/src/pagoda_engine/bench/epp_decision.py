"""`pagoda bench epp-decision`: the Endpoint Picker's decision time, one CPU core.

What one ext_proc request costs `pagoda epp` between the body's arrival and its answer: the JSON
body read, the prompt tokenized with the model's tokenizer, the prefix looked up in the KV-event
index of every pod, the pods ranked (`router.epp.read_body`, `Picker.pick`: what the servicer
runs). The index holds `--tenants` prefixes of `--prefix-len` tokens spread over `--pods` pods,
stored as BlockStored events; each request is a tenant's prefix (as text) and a question of its
own. Every tenant has been seen once before the timed run (its pods' events name pages the EPP
routed it to); the start-up heap is frozen before that, as `pagoda epp` freezes it. Requests are
paced at `--rate` per second on this one thread, pinned to one CPU core; the target is p99 <= 2 ms
at 1,000 requests/s. Each decision's wall time is reported, and its CPU time (the thread's), which
leaves out the time other processes took the core. (gRPC framing is not included: it is Envoy's
and grpcio's, per message.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np

from pagoda_engine.bench.serve import _percentiles


def add_epp_decision_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the model whose tokenizer cuts prompts (default: pagoda's default)")
    p.add_argument("--pods", type=int, default=8)
    p.add_argument("--tenants", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=4096)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rate", type=float, default=1000.0, help="decisions per second (default 1000)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--output-json", default=None)


def run_epp_decision(args: argparse.Namespace) -> dict:
    import asyncio

    import httpx

    from pagoda_engine.kv_event_wire import BlockStored, KVEventBatch
    from pagoda_engine.model_path import resolve_model_path
    from pagoda_engine.router.backends import Backend, BackendPool
    from pagoda_engine.router.epp import Picker, read_body
    from pagoda_engine.router.kv_index import KVIndex, PrefixSource
    from pagoda_engine.router.prompt_pages import CachedTokenizer
    from pagoda_engine.router.metrics import RouterMetrics
    from pagoda_engine.router.scorer import Weights
    from pagoda_engine.tokenizer_files import load_tokenizer
    import msgspec

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    tokenizer = load_tokenizer(resolve_model_path(args.model))
    rng = np.random.default_rng(0)
    vocab = min(len(tokenizer), 30000)
    texts, token_lists = [], []
    for _ in range(args.tenants):
        text = tokenizer.decode(rng.integers(100, vocab, size=args.prefix_len).tolist())
        texts.append(text)
        token_lists.append(list(tokenizer.encode(text)))
    index = KVIndex()
    pods = [f"10.0.0.{i + 1}:8000" for i in range(args.pods)]
    bs = args.block_size
    for t, tokens in enumerate(token_lists):
        n = len(tokens) // bs
        event = BlockStored(block_hashes=[t * 100_000 + i for i in range(n)], parent_block_hash=None,
                            token_ids=tokens[:n * bs], block_size=bs, lora_id=None, medium="GPU", lora_name=None)
        batch = msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=[event])))
        index.apply(pods[t % args.pods], batch)

    async def make_pool() -> BackendPool:
        pool = BackendPool(httpx.AsyncClient(), RouterMetrics())
        for i, pod in enumerate(pods):
            pool.backends[pod] = Backend(f"http://{pod}", ready=True, waiting=float(i % 3), running=4.0,
                                         kv_usage=0.3 + 0.05 * i)
        return pool

    pool = asyncio.run(make_pool())
    cached = CachedTokenizer(tokenizer)
    print(f"tokenizer: {type(tokenizer).__name__}, pieces cached: {cached.exact}")
    picker = Picker(pool, PrefixSource(index, None, cached, lambda urls: None), Weights(), 128.0)
    num = int(args.rate * args.seconds)
    bodies = [json.dumps({"model": "m", "prompt": texts[int(rng.integers(args.tenants))] + f" question {i}?" * 8,
                          "max_tokens": 64}).encode() for i in range(min(num, 2000))]
    gc.collect()
    gc.freeze()  # where `pagoda epp` freezes its start-up heap: before any request
    for text in texts:  # each tenant seen once, as the EPP saw it when it routed the pages the index holds
        picker.pick(read_body(json.dumps({"model": "m", "prompt": text + " first?"}).encode()), None)
    for body in bodies[:50]:  # warm: first calls allocate
        picker.pick(read_body(body), None)
    times, cpu_times, late = [], [], 0
    start = time.perf_counter()
    for i in range(num):
        due = start + i / args.rate
        now = time.perf_counter()
        if now < due:
            time.sleep(due - now)
        elif now - due > 0.002:
            late += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        picker.pick(read_body(bodies[i % len(bodies)]), None)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
    elapsed = time.perf_counter() - start
    result = {"bench": "epp-decision", "pods": args.pods, "tenants": args.tenants, "prefix_len": args.prefix_len,
              "rate": args.rate, "achieved_rate": round(num / elapsed, 1), "decisions": num,
              "decision_ms": _percentiles(times), "max_ms": round(max(times) * 1e3, 3),
              "decision_cpu_ms": _percentiles(cpu_times), "started_late": late,
              "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    d, c = result["decision_ms"], result["decision_cpu_ms"]
    print(f"=== pagoda bench epp-decision: {args.pods} pods, {args.tenants} tenants x {args.prefix_len}-token prefixes ===")
    print(f"{num} decisions at {result['achieved_rate']}/s (asked {args.rate:g}/s): p50 {d['p50']} ms, p90 {d['p90']} ms, "
          f"p99 {d['p99']} ms, max {result['max_ms']} ms; {late} started > 2 ms late")
    print(f"CPU time: p50 {c['p50']} ms, p90 {c['p90']} ms, p99 {c['p99']} ms; "
          f"load average {' '.join(f'{x:.2f}' for x in result['load_average'] or [])}")
    return result

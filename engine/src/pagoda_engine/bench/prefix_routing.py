"""`pagoda bench prefix-routing`: precise prefix routing (the engines' KV events) against the
approximate router on a multi-tenant prefix workload, over several engines.

Each tenant has a long shared prefix (`--prefix-len` tokens, e.g. a system prompt and documents);
each request is one tenant's prefix and a short question of its own (`--question-len`), tenants
drawn uniformly, arrivals Poisson at each `--request-rate`. The engines start once (engine i on GPU
i with `--gpus-per-engine 1`), publishing their KV events to this process; then, per rate, the
same workload goes through `pagoda route --policy prefix-aware` twice: approximate (text-page
hashes and a hash ring) and precise (`--kv-events-bind`, `scorer.PrecisePrefix`). Each run uses
tenant prefixes no engine has seen, so neither inherits the other's cache. Reported per rate and
policy: TTFT p50/p90/p99, output tokens/s and the engines' prefix-cache hit rate over the run.

    pagoda bench prefix-routing --model /models/llama-3.1-8b --load-format auto --engines 2 \\
        --tenants 32 --prefix-len 4096 --request-rate 4,8,12 --num-prompts 400
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from pagoda_engine import envs
from pagoda_engine.bench.serve import (PREFIX_HITS, PREFIX_QUERIES, _free_port, _one_stream, _percentiles, _rate_list,
                                       _scrape, _server_args, _server_main, _vocab_size, arrival_offsets,
                                       with_token_tokenizer)

POLICIES = ("approximate", "precise")


def add_prefix_routing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--gpus-per-engine", type=int, default=1,
                   help="GPUs each engine gets (CUDA_VISIBLE_DEVICES i*n .. i*n+n-1); 0: CPU engines")
    p.add_argument("--tenants", type=int, default=32, help="tenants, each with its own shared prefix (default 32)")
    p.add_argument("--prefix-len", type=int, default=4096, help="tokens of each tenant's shared prefix (default 4096)")
    p.add_argument("--question-len", type=int, default=64, help="tokens of each request's own question (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--num-prompts", type=int, default=400, help="requests per run (default 400)")
    p.add_argument("--request-rate", type=_rate_list, default=[4.0],
                   help="requests per second, or a comma-separated sweep (default 4)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="which routers to run: approximate, precise or both (default both)")
    p.add_argument("--output-json", default=None, help="also write the results as JSON to this file")


def _check(args: argparse.Namespace) -> None:
    for name in ("engines", "tenants", "prefix_len", "question_len", "output_len", "num_prompts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1")
    if args.gpus_per_engine < 0:
        raise SystemExit("error: --gpus-per-engine must be >= 0")
    args.policy_list = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not args.policy_list or set(args.policy_list) - set(POLICIES):
        raise SystemExit(f"error: --policies takes {', '.join(POLICIES)}, got {args.policies!r}")


class _Engine:
    def __init__(self, args: argparse.Namespace, index: int, events: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        server = _server_args(args, self.port)
        server.kv_events_config = (f'{{"enable_kv_cache_events": true, "endpoint": "{events}", '
                                   f'"topic": "kv@127.0.0.1:{self.port}@bench"}}')
        n = args.gpus_per_engine
        self.devices = ",".join(str(index * n + g) for g in range(n)) if n else None
        self.process = multiprocessing.get_context("spawn").Process(target=_server_main, args=(server,),
                                                                    name=f"pagoda-bench-engine-{index}")

    def start(self) -> None:
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.devices  # a spawned child takes the environment as it is now
        try:
            self.process.start()
        finally:
            if self.devices is not None:
                if saved is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = saved

    def wait(self, timeout_s: float) -> None:
        _wait_http(f"{self.url}/health", timeout_s, lambda: self.process.is_alive(), "pagoda serve")

    def stop(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGTERM)
            self.process.join(60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def _wait_http(url: str, timeout_s: float, alive, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"{what} exited before it was ready")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{what} was not ready within {timeout_s:.0f} s")


def _start_router(urls: list[str], policy: str, model_dir: str, events: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagoda_engine.router.app", "--host", "127.0.0.1", "--port", str(port),
           "--backends", ",".join(urls), "--policy", "prefix-aware", "--health-interval", "0.2",
           "--log-level", "warning"]
    if policy == "precise":
        cmd += ["--model", model_dir, "--kv-events-bind", events]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/health", 120, lambda: proc.poll() is None, f"pagoda route ({policy})")
    return proc, url


def _workload(args: argparse.Namespace, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, vocab, size=(args.tenants, args.prefix_len))
    tenants = rng.integers(0, args.tenants, size=args.num_prompts)
    questions = rng.integers(0, vocab, size=(args.num_prompts, args.question_len))
    return [prefixes[t].tolist() + questions[i].tolist() for i, t in enumerate(tenants)]


async def _drive(router: str, model: str, prompts: list[list[int]], output_len: int, rate: float) -> dict:
    offsets = arrival_offsets(len(prompts), rate)
    url = f"{router}/v1/completions"
    t0 = time.perf_counter()
    results = await asyncio.gather(*[_one_stream(url, {
        "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 1.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}}, offset, t0)
        for prompt, offset in zip(prompts, offsets)])
    duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if r.error})[:3],
            "ttft_ms": _percentiles([r.ttft for r in ok]),
            "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / duration, 1),
            "requests_per_s": round(len(ok) / duration, 3), "duration_s": round(duration, 2)}


def _prefix_counters(urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for url in urls:
        h = _scrape(url)
        if h is not None:
            queries += h.prefix_cache.get(PREFIX_QUERIES, 0.0)
            hits += h.prefix_cache.get(PREFIX_HITS, 0.0)
    return queries, hits


def run_prefix_routing(args: argparse.Namespace) -> dict:
    _check(args)
    if args.served_model_name is None:
        args.served_model_name = Path(args.model).name
    args.model = with_token_tokenizer(args.model)
    if args.max_model_len is None:
        args.max_model_len = args.prefix_len + args.question_len + args.output_len
    if args.gpus_per_engine == 0:
        args.device = "cpu"
    vocab = _vocab_size(args)
    events = f"tcp://127.0.0.1:{_free_port()}"
    logs = Path(tempfile.mkdtemp(prefix="pagoda-bench-prefix-routing-"))
    engines = [_Engine(args, i, events) for i in range(args.engines)]
    runs = []
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait(envs.bench_server_timeout_s())
        urls = [e.url for e in engines]
        print(f"=== pagoda bench prefix-routing: {args.engines} engines, {args.tenants} tenants x {args.prefix_len}-token "
              f"prefix + {args.question_len}-token questions, {args.output_len} output tokens, {args.num_prompts} "
              f"requests per run ===")
        for r_index, rate in enumerate(args.request_rate):
            for p_index, policy in enumerate(args.policy_list):
                router, router_url = _start_router(urls, policy, args.model, events, logs / f"route-{policy}.log")
                try:
                    before = _prefix_counters(urls)
                    prompts = _workload(args, vocab, seed=1000 * r_index + p_index + 1)
                    run = asyncio.run(_drive(router_url, args.served_model_name, prompts, args.output_len, rate))
                    after = _prefix_counters(urls)
                finally:
                    router.terminate()
                    router.wait(30)
                queried = after[0] - before[0]
                run.update({"policy": policy, "request_rate": rate,
                            "prefix_cache_hit_rate": round((after[1] - before[1]) / queried, 4) if queried else None})
                runs.append(run)
                t = run["ttft_ms"]
                print(f"rate {rate:g}/s {policy:>11}: TTFT p50 {t['p50']} ms, p90 {t['p90']} ms, p99 {t['p99']} ms; "
                      f"{run['output_tokens_per_s']} output tok/s; prefix-cache hits {run['prefix_cache_hit_rate']}; "
                      f"{run['completed']} ok, {run['failed']} failed {run['errors'] or ''}")
    finally:
        for engine in engines:
            engine.stop()
    result = {"bench": "prefix-routing", "engines": args.engines, "tenants": args.tenants, "prefix_len": args.prefix_len,
              "question_len": args.question_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "runs": runs, "completed": sum(r["completed"] for r in runs), "logs": str(logs)}
    for rate in args.request_rate:
        pair = {r["policy"]: r for r in runs if r["request_rate"] == rate}
        if set(pair) == set(POLICIES) and pair["approximate"]["ttft_ms"]["p90"] and pair["precise"]["ttft_ms"]["p90"]:
            ratio = pair["precise"]["ttft_ms"]["p90"] / pair["approximate"]["ttft_ms"]["p90"]
            speed = pair["precise"]["output_tokens_per_s"] / max(pair["approximate"]["output_tokens_per_s"], 1e-9)
            print(f"rate {rate:g}/s: precise TTFT p90 = {ratio:.2f} x approximate; throughput {speed:.2f} x")
    return result

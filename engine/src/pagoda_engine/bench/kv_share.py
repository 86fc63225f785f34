"""`pagoda bench kv-share`: two engines sharing one Redis — issue 15's target "a 4,096-token prompt
computed on one engine and sent to the other gets TTFT <= 0.5 x recomputing it".

Started here (each stopped at the end): `--redis-shards` `redis-server`s (default 1; `--redis-server`,
else the one on PATH) on free ports of 127.0.0.1, with no persistence, `--redis-maxmemory-gb` each
(allkeys-lru) and `--redis-io-threads` (default 1), unless `--kv-offload-remote-url` names running
ones (several: comma-separated, the remote tier sharded over them); then two
`pagoda serve` engines, A and B, one after the other, both with that URL as their remote tier and
the same engine flags (by default Llama-3.1-8B's architecture with dummy weights and the synthetic
one-word-per-id tokenizer, as `bench serve`).

Both fit on one GPU: each engine's KV pool is fixed by `--num-gpu-blocks-override` (default: four
prompts' pages), since the engine's own sizing reads `--gpu-memory-utilization` as the share of the
whole GPU that may be in use, other processes included, and would leave the second engine nothing.
`--gpu-memory-utilization` defaults to 0.42 here all the same, which is what each engine would get.

Each of `--num-prompts` rounds (K, default 8) takes two fresh random prompts of `--input-len` tokens
(4,096; token ids from `numpy.random.default_rng(0)`) and asks for `--output-len` tokens (1),
streamed, temperature 1.0, `ignore_eos`; the TTFT is the arrival of the first streamed choice:
  (a) recompute: prompt i to engine B, which never saw it;
  (b) remote hit: prompt j to engine A; once every full page of j is in Redis (the bench reads the
      keys there), j to engine B.
Before a round both prompts' keys are deleted from Redis, and after each computed prompt the bench
waits until all its pages are in Redis (and after every request until the engine's counters are
still), so no write of one request overlaps the next. One untimed round of each kind comes first (kernels, connections, and the Redis
key prefixes of these engines' fingerprints, found by the keys of A's first page).

Why B cannot find j anywhere but in Redis: B has no CPU or disk tier (the flags are refused), the
prompts are distinct random ids (their first pages differ), and B's own counters say it: every
request's device prefix hits (`pagoda:prefix_cache_hits_total` less the tiers' hits) and remote hit
tokens (`pagoda:kv_offload_hit_tokens_total{tier="remote"}`) are read before and after it. A round
whose recompute found anything cached, or whose remote hit found nothing in Redis or hit the device
cache, makes the run invalid (exit 1), so a "hit" that did not come from Redis cannot pass silently.
With split loads (`--kv-offload-split-loads`, the engines' default) B computes a prefix Redis holds up
to a cut while the rest loads: its prefix hits then count only the pages it took from Redis, and
fall short of the remote hit tokens by the pages it computed. `--no-kv-offload-split-loads` makes
B load every page first.

Printed (and `--output-json`): TTFT p50 and mean of recompute and of remote hit, their ratio
against the 0.5 target, B's remote hit tokens per kind, how long B's loads from Redis took (the
engine's `pagoda:kv_offload_load_seconds`: lookup done to pages on the device) and the bytes/s they
moved, and A's TTFT computing the j prompts (a second recompute figure, on the other engine).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from pagoda_engine import envs
from pagoda_engine.bench.multiturn import _metrics
from pagoda_engine.kv_tiers import redacted_url
from pagoda_engine.bench.serve import (
    PREFILL_TIME,
    QUEUE_TIME,
    LaunchedServer,
    RequestResult,
    _free_port,
    _one_request,
    _percentiles,
    _scrape,
    _served_model,
    _vocab_size,
    with_token_tokenizer,
)

KV_SHARE_INPUT_LEN, KV_SHARE_OUTPUT_LEN, KV_SHARE_NUM_PROMPTS = 4096, 1, 8
TARGET_RATIO = 0.5
_REDIS_READY_TIMEOUT_S = 30.0

REMOTE_HITS = "pagoda:kv_offload_hit_tokens_total{remote}"
REMOTE_LOADED = "pagoda:kv_offload_loaded_bytes_total{remote}"
REMOTE_STORED = "pagoda:kv_offload_stored_bytes_total{remote}"
REMOTE_LOAD_S = "pagoda:kv_offload_load_seconds_sum{remote}"
PREFIX_HITS = "pagoda:prefix_cache_hits_total"
LOWER_TIER_HITS = tuple(f"pagoda:kv_offload_hit_tokens_total{{{t}}}" for t in ("cpu", "disk", "remote"))


def add_kv_share_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-server", default=None, metavar="PATH",
                   help="the redis-server binary to start (default: redis-server on PATH); not with "
                        "--kv-offload-remote-url, which names a running one")
    p.add_argument("--redis-maxmemory-gb", type=float, default=16.0,
                   help="maxmemory of the redis-server started here (allkeys-lru); a Llama-3.1-8B prompt of "
                        "4,096 tokens takes 0.5 GiB, and every round stores two")
    p.add_argument("--redis-io-threads", type=int, default=1, metavar="N",
                   help="--io-threads of the redis-server started here (default 1: the main thread only). On a "
                        "2-core machine 4 I/O threads did not measurably speed up the engines' reads (python -m "
                        "pagoda_engine.bench.remote_read --io-threads 1 4 measures a machine; docs/benchmarks.md)")
    p.add_argument("--redis-shards", type=int, default=1, metavar="N",
                   help="redis-servers started here; the engines' remote tier is sharded over them (their URLs, "
                        "comma-separated, in --kv-offload-remote-url): one Redis serves a read from one thread")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids of the prompts are drawn below this (default: config.json of --model)")
    p.set_defaults(gpu_memory_utilization=0.42)


# --- the Redis server --------------------------------------------------------------------------------


class RedisServer:
    """A `redis-server` of this run: 127.0.0.1, a free port, no persistence, an LRU memory cap,
    `io_threads` I/O threads (1: none besides the main thread); with PAGODA_KV_REMOTE_PASSWORD
    set, that password (the engines read it from there too)."""

    def __init__(self, binary: str, maxmemory_gb: float, io_threads: int = 1):
        self.binary, self.maxmemory_gb, self.io_threads = binary, maxmemory_gb, io_threads
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="pagoda-kv-share-redis-"))
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--maxmemory", str(int(self.maxmemory_gb * (1 << 30))), "--maxmemory-policy", "allkeys-lru",
               "--dir", str(self.dir), "--io-threads", str(self.io_threads)]
        if envs.kv_remote_password():
            cmd += ["--requirepass", envs.kv_remote_password()]
        with open(self.dir / "redis.log", "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        client = redis_client(self.url)
        deadline = time.monotonic() + _REDIS_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if client.ping():
                    return
            except Exception:  # not listening yet
                time.sleep(0.1)
        log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port}:\n{log}")

    def version(self) -> str:
        return str(redis_client(self.url).info("server").get("redis_version", "?"))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(url, password=envs.kv_remote_password(), socket_timeout=30)


class RedisPages:
    """Which of a prompt's full pages Redis holds under the fingerprints of the engines of this run
    (one key prefix per parallel rank, learned from the keys of the first prompt an engine stores),
    each on the server of the remote tier's shards that its name picks."""

    def __init__(self, url: str, page_size: int):
        from pagoda_engine.kv_tiers import split_remote_urls

        self.clients = [redis_client(u) for u in split_remote_urls(url)]
        self.page_size = page_size
        self.prefixes: list[bytes] = []

    def hashes(self, prompt: list[int]) -> list[bytes]:
        from pagoda_engine.core.kv.block_pool import hash_pages

        return hash_pages(prompt, self.page_size)

    def learn_prefixes(self, prompt: list[int], num_ranks: int) -> None:
        """Until every rank's key of the prompt's first page is in Redis: their prefixes."""
        from pagoda_engine.worker.kv_stores import REDIS_KEY_NAMESPACE

        suffix = self.hashes(prompt)[0].hex().encode()

        def found() -> bool:
            keys = [k for client in self.clients
                    for k in client.scan_iter(match=REDIS_KEY_NAMESPACE + b"*:" + suffix, count=10000)]
            self.prefixes = sorted({k[:-len(suffix)] for k in keys})
            return len(self.prefixes) >= num_ranks

        _until(found, f"the first page of a prompt engine A computed to reach Redis ({num_ranks} rank keys)")

    def names(self, prompt: list[int]) -> list[bytes]:
        return [p + h.hex().encode() for h in self.hashes(prompt) for p in self.prefixes]

    def _by_server(self, prompt: list[int]) -> list[tuple[object, list[bytes]]]:
        from pagoda_engine.worker.kv_stores import shard_index

        names: list[list[bytes]] = [[] for _ in self.clients]
        for name in self.names(prompt):
            names[shard_index(name, len(self.clients))].append(name)
        return [(client, part) for client, part in zip(self.clients, names) if part]

    def count(self, prompt: list[int]) -> int:
        total = 0
        for client, names in self._by_server(prompt):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            total += sum(pipe.execute())
        return total

    def delete(self, prompt: list[int]) -> None:
        for client, names in self._by_server(prompt):
            client.delete(*names)

    def wait_stored(self, prompt: list[int], engine: str) -> None:
        want = len(self.names(prompt))
        _until(lambda: self.count(prompt) == want,
               f"engine {engine}'s {want} page entries of the prompt to reach Redis (is its remote tier failing? "
               f"see its pagoda:kv_offload_errors_total)")


def _until(predicate, what: str, step: float = 0.02) -> None:
    """Until a prompt's pages are in Redis, or an engine's counters are still."""
    timeout_s = envs.bench_kv_share_store_timeout_s()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(step)


def _settled(base_url: str) -> dict[str, float]:
    """The engine's counters once it is idle and they stay the same for three scrapes in a row
    (its stats published). A write to Redis moves no counter until it ends: the bench waits for a
    prompt's keys in Redis besides (`RedisPages.wait_stored`)."""
    keys = (REMOTE_STORED, REMOTE_LOADED, "pagoda:num_requests_running", "pagoda:num_requests_waiting")
    seen: list[tuple] = []

    def still() -> bool:
        m = _metrics(base_url)
        seen.append(tuple(m.get(k, 0.0) for k in keys))
        last = seen[-3:]
        return len(last) == 3 and len(set(last)) == 1 and last[0][2] == last[0][3] == 0
    _until(still, f"{base_url} to go idle", step=0.05)
    return _metrics(base_url)


# --- one request -------------------------------------------------------------------------------------


@dataclass
class Run:
    """One request to one engine and what its counters moved."""

    kind: str  # recompute | remote_hit | computed_on_a
    engine: str
    ttft_ms: float | None
    error: str | None
    remote_hit_tokens: int = 0
    device_hit_tokens: int = 0
    remote_loaded_bytes: int = 0
    remote_load_s: float = 0.0
    queue_ms: float | None = None  # the engine's own: arrival at the core to the first schedule (a load waits here)
    prefill_ms: float | None = None  # first schedule to the first token

    @property
    def valid(self) -> bool:
        """Whether it measured what its kind says: a recompute found nothing cached; a remote hit
        found its prefix in Redis and not on B's device."""
        if self.ttft_ms is None:
            return False
        if self.kind == "remote_hit":  # a split load computes some of what Redis held: fewer prefix hits
            return self.remote_hit_tokens > 0 and self.device_hit_tokens <= 0
        if self.kind == "recompute":
            return self.remote_hit_tokens == 0 and self.device_hit_tokens == 0
        return True


def _ttft_ms(r: RequestResult) -> float | None:
    # A token came back (its text may be empty: a byte-level piece the detokenizer holds back).
    return round((r.first_choice - r.sent) * 1e3, 3) if r.first_choice and r.output_tokens >= 1 else None


async def _request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                   kind: str, engine: str) -> Run:
    before = _settled(url)
    hist_before = _scrape(url)
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 1.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = await _one_request(client, f"{url}/v1/completions", body, 0.0, time.perf_counter())
    ttft = _ttft_ms(r)
    after = _settled(url)
    hist_after = _scrape(url)
    split = {}
    if hist_before is not None and hist_after is not None:
        split = {"queue_ms": hist_after.mean_ms_since(hist_before, QUEUE_TIME),
                 "prefill_ms": hist_after.mean_ms_since(hist_before, PREFILL_TIME)}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    lower = sum(delta(name) for name in LOWER_TIER_HITS)
    return Run(kind, engine, ttft, None if ttft is not None else r.error, remote_hit_tokens=int(delta(REMOTE_HITS)),
               device_hit_tokens=int(delta(PREFIX_HITS) - lower), remote_loaded_bytes=int(delta(REMOTE_LOADED)),
               remote_load_s=delta(REMOTE_LOAD_S), **split)


async def _drive(a_url: str, b_url: str, model: str, pages: RedisPages, prompts: list[list[int]],
                 warm_up: list[list[int]], args: argparse.Namespace) -> list[Run]:
    num_ranks = args.tensor_parallel_size * args.pipeline_parallel_size
    async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as client:
        # Untimed: one prompt A computes and B loads (learning the key prefixes), one B computes.
        await _request(client, a_url, model, warm_up[0], args.output_len, "computed_on_a", "A")
        pages.learn_prefixes(warm_up[0], num_ranks)
        pages.wait_stored(warm_up[0], "A")
        await _request(client, b_url, model, warm_up[0], args.output_len, "remote_hit", "B")
        await _request(client, b_url, model, warm_up[1], args.output_len, "recompute", "B")
        pages.wait_stored(warm_up[1], "B")
        runs = []
        for k in range(args.num_prompts):
            cold, shared = prompts[2 * k], prompts[2 * k + 1]
            pages.delete(cold)
            pages.delete(shared)
            runs.append(await _request(client, b_url, model, cold, args.output_len, "recompute", "B"))
            pages.wait_stored(cold, "B")  # B's own write of it must not overlap what follows
            runs.append(await _request(client, a_url, model, shared, args.output_len, "computed_on_a", "A"))
            pages.wait_stored(shared, "A")
            runs.append(await _request(client, b_url, model, shared, args.output_len, "remote_hit", "B"))
            print(f"round {k + 1}/{args.num_prompts}: " + ", ".join(
                f"{r.kind} {r.ttft_ms} ms" + (f" ({r.remote_hit_tokens} remote hit tokens)" if r.engine == "B" else "")
                for r in runs[-3:]), flush=True)
    return runs


# --- the run -----------------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    if args.kv_offload_cpu_gb or args.kv_offload_disk_path:
        raise SystemExit("error: kv-share measures the remote tier alone: engine B must find a prefix nowhere "
                         "but in Redis, so --kv-offload-cpu-gb and --kv-offload-disk-path do not apply")
    if args.kv_offload_remote_url and args.redis_server:
        raise SystemExit("error: --redis-server starts a Redis; --kv-offload-remote-url names a running one: "
                         "give one of them")
    if args.redis_maxmemory_gb <= 0:
        raise SystemExit("error: --redis-maxmemory-gb must be > 0")
    if args.redis_io_threads < 1:
        raise SystemExit("error: --redis-io-threads must be >= 1")
    if args.redis_shards < 1:
        raise SystemExit("error: --redis-shards must be >= 1")
    if args.kv_offload_remote_url and args.redis_shards != 1:
        raise SystemExit("error: --redis-shards starts Redis servers; --kv-offload-remote-url names running ones "
                         "(list several, comma-separated, to shard over them)")
    if not args.enable_prefix_caching:
        raise SystemExit("error: kv-share needs prefix caching (the tiers are keyed by it)")
    if args.data_parallel_size != 1:
        raise SystemExit("error: kv-share runs one engine core per server (--data-parallel-size 1)")
    if args.input_len < 2 * args.block_size:
        raise SystemExit(f"error: --input-len must span at least two pages ({2 * args.block_size} tokens): "
                         "a prompt's last token is always computed")


def run_kv_share(args: argparse.Namespace) -> dict:
    args.num_prompts = args.num_prompts or KV_SHARE_NUM_PROMPTS
    args.input_len = args.input_len or KV_SHARE_INPUT_LEN
    args.output_len = args.output_len or KV_SHARE_OUTPUT_LEN
    _check_args(args)
    if args.served_model_name is None:
        args.served_model_name = Path(args.model).name
    args.model = with_token_tokenizer(args.model)
    if args.max_model_len is None:
        args.max_model_len = args.input_len + args.output_len
    if args.num_gpu_blocks_override is None and args.num_kv_pages is None:
        args.num_gpu_blocks_override = 4 * -(-args.max_model_len // args.block_size) + 1
    vocab = _vocab_size(args)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, vocab, size=(2 * args.num_prompts, args.input_len)).tolist()
    warm_up = np.random.default_rng().integers(0, vocab, size=(2, args.input_len)).tolist()  # never seen before

    redis_servers: list[RedisServer] = []
    engines: list[LaunchedServer] = []
    try:
        if args.kv_offload_remote_url is None:
            binary = args.redis_server or shutil.which("redis-server")
            if binary is None:
                raise SystemExit("error: no redis-server on PATH: install it (Debian: apt-get install redis-server), "
                                 "or give --redis-server PATH or --kv-offload-remote-url redis://HOST:PORT")
            for _ in range(args.redis_shards):
                redis_servers.append(RedisServer(binary, args.redis_maxmemory_gb, args.redis_io_threads))
                redis_servers[-1].start()
            args.kv_offload_remote_url = ",".join(server.url for server in redis_servers)
            ports = ", ".join(str(server.port) for server in redis_servers)
            redis_desc = (f"{len(redis_servers)} x redis-server {redis_servers[0].version()} started on 127.0.0.1 "
                          f"(port{'s' * (len(redis_servers) > 1)} {ports}; maxmemory {args.redis_maxmemory_gb:g} GiB "
                          f"each, allkeys-lru, no persistence, {args.redis_io_threads} I/O "
                          f"thread{'s' * (args.redis_io_threads > 1)})")
        else:
            redis_desc = f"the running Redis at {redacted_url(args.kv_offload_remote_url)}"
        ready = []
        for _ in range(2):  # one after the other: each starts on a GPU the other no longer changes
            engines.append(LaunchedServer(args))
            ready.append(round(engines[-1].start(), 1))
        a, b = engines
        model = _served_model(a.url)
        print(f"=== pagoda bench kv-share: two engines sharing Redis ({args.num_prompts} rounds; prompts of "
              f"{args.input_len} tokens, {args.output_len} output token{'s' * (args.output_len > 1)}) ===")
        print(f"redis: {redis_desc}; the engines read each server over {envs.kv_remote_read_connections()} connections "
              f"(PAGODA_KV_REMOTE_READ_CONNECTIONS)")
        print(f"engines: A {a.url} (ready in {ready[0]} s), B {b.url} (ready in {ready[1]} s); model {model!r} "
              f"({args.model}, {args.load_format} weights); KV pool {args.num_gpu_blocks_override or args.num_kv_pages} "
              f"pages each; no CPU or disk tier")
        pages = RedisPages(args.kv_offload_remote_url, args.block_size)
        runs = asyncio.run(_drive(a.url, b.url, model, pages, prompts, warm_up, args))
    finally:
        for engine in reversed(engines):
            engine.stop()
        for server in redis_servers:
            server.stop()
    result = summarize(runs)
    result.update({"bench": "kv-share", "num_prompts": args.num_prompts, "input_len": args.input_len,
                   "output_len": args.output_len, "model": args.served_model_name, "load_format": args.load_format,
                   "redis": redis_desc, "redis_url": redacted_url(args.kv_offload_remote_url),
                   "redis_started_here": bool(redis_servers), "redis_shards": len(redis_servers) or None, "remote_read_connections": envs.kv_remote_read_connections(),
                   "num_gpu_blocks_override": args.num_gpu_blocks_override,
                   "engine_startup_s": ready})
    _print(result)
    return result


def summarize(runs: list[Run]) -> dict:
    by_kind = {kind: [r for r in runs if r.kind == kind] for kind in ("recompute", "remote_hit", "computed_on_a")}
    out: dict = {}
    for kind, rs in by_kind.items():
        ok = [r for r in rs if r.valid]
        out[kind] = {"ttft_ms": _percentiles([r.ttft_ms for r in ok], scale=1.0), "valid": len(ok), "runs": len(rs),
                     "remote_hit_tokens": sum(r.remote_hit_tokens for r in rs),
                     "device_hit_tokens": sum(r.device_hit_tokens for r in rs),
                     "queue_ms_mean": _mean([r.queue_ms for r in ok]), "prefill_ms_mean": _mean([r.prefill_ms for r in ok]),
                     "errors": sorted({r.error for r in rs if r.error})[:5]}
    hits = by_kind["remote_hit"]
    loaded, load_s = sum(r.remote_loaded_bytes for r in hits), sum(r.remote_load_s for r in hits)
    out["remote_hit"]["loaded_bytes"] = loaded
    out["remote_hit"]["load_ms_mean"] = round(load_s / len(hits) * 1e3, 3) if hits and load_s else None
    out["remote_load_bytes_per_s"] = round(loaded / load_s, 1) if load_s else None
    recompute, hit = out["recompute"]["ttft_ms"], out["remote_hit"]["ttft_ms"]
    for stat in ("p50", "mean"):
        ratio = hit[stat] / recompute[stat] if hit[stat] and recompute[stat] else None
        out[f"ttft_ratio_{stat}"] = round(ratio, 4) if ratio is not None else None
    out["target_ratio"] = TARGET_RATIO
    out["target_met"] = out["ttft_ratio_p50"] is not None and out["ttft_ratio_p50"] <= TARGET_RATIO
    out["valid"] = all(r.valid for r in runs)
    out["completed"] = sum(r.valid for r in runs)
    out["runs"] = [vars(r) | {"valid": r.valid} for r in runs]
    return out


def _mean(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def _print(r: dict) -> None:
    labels = {"recompute": "recompute on B", "remote_hit": "remote hit on B", "computed_on_a": "computed on A"}
    for kind, label in labels.items():
        s = r[kind]
        t = s["ttft_ms"]
        line = f"{label:16s} TTFT ms: " + (f"p50 {t['p50']:.2f}   mean {t['mean']:.2f}" if t["p50"] is not None else "-")
        if kind != "computed_on_a":
            line += f"   ({s['remote_hit_tokens']:,} remote hit tokens, {s['device_hit_tokens']:,} device hit tokens)"
        print(line + f"   [{s['valid']} of {s['runs']} valid]")
        if s["queue_ms_mean"] is not None and s["prefill_ms_mean"] is not None:
            print(f"  in the engine, mean ms: queued {s['queue_ms_mean']:.2f} (a remote hit's lookup and load), "
                  f"prefill {s['prefill_ms_mean']:.2f}; the rest of the TTFT is the API process and HTTP")
        for error in s["errors"]:
            print(f"  error: {error}")
    bps = r["remote_load_bytes_per_s"]
    if bps:
        h = r["remote_hit"]
        print(f"remote loads on B: {h['loaded_bytes'] / 1e9:.3f} GB in all, {h['load_ms_mean']:.2f} ms each on average "
              f"(lookup done to pages on the device), {bps / 1e9:.3f} GB/s")
    if r["ttft_ratio_p50"] is not None:
        verdict = "met" if r["target_met"] else "missed"
        print(f"TTFT remote hit / recompute: p50 {r['ttft_ratio_p50']:.3f}, mean {r['ttft_ratio_mean']:.3f} "
              f"(target <= {r['target_ratio']}: {verdict})")
    if not r["valid"]:
        bad = [x for x in r["runs"] if not x["valid"]]
        print(f"error: {len(bad)} request(s) did not measure what they should (a recompute that found a cached "
              "prefix, a remote hit with no remote hit tokens or with device hits, or a failed request): "
              + "; ".join(f"{x['kind']} on {x['engine']}: ttft {x['ttft_ms']}, remote {x['remote_hit_tokens']}, "
                          f"device {x['device_hit_tokens']}" for x in bad[:3]))

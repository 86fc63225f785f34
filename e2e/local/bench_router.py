"""Router overhead on this machine (a measurement for the notes, not a test).

  python e2e/local/bench_router.py [--requests 400] [--tokens 64] [--token-delay 0.005]

Starts one engine double (e2e/local/fake_engine.py: the engine's HTTP surface with no model, so
only HTTP and the router cost anything; a real engine's compute would only add noise to the
difference) and `pagoda route` in front of it, the router pinned to CPU 0, and measures against
the same engine directly:
  1. per request: sequential non-streaming 1-token requests, latency p50/p99;
  2. per streamed token: each chunk's trip from the engine's send (its `t_sent`, same clock) to
     the client, streams of --tokens tokens one --token-delay apart, p50/p99;
  3. the router's max request rate on its one core: closed-loop async clients (1-token
     requests), requests/s through the router and, for scale, directly.
The router's CPU time per request and per token (from /proc) is reported too: on a machine busy
with other work, wall-clock figures grow, CPU time per unit of work does not, and 1 / (CPU time per
request) is the rate one dedicated core can sustain.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagoda_e2e import PYTHON, Proc, free_port, start_router  # noqa: E402

FAKE = str(Path(__file__).resolve().parent / "fake_engine.py")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc): unlike wall time, it does not grow
    when the machine is busy with other work."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary_ms(values: list[float]) -> dict:
    return {"p50_ms": round(pct(values, 0.5) * 1e3, 3), "p99_ms": round(pct(values, 0.99) * 1e3, 3),
            "mean_ms": round(statistics.fmean(values) * 1e3, 3), "n": len(values)}


def request_latencies(base: str, model: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=60) as c:
        body = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
        for _ in range(20):  # warm-up: connections, caches
            c.post(base + "/v1/completions", json=body)
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.post(base + "/v1/completions", json=body)
            out.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return out


def chunk_latencies(base: str, model: str, n_streams: int, tokens: int, delay: float) -> tuple[list[float], list[float]]:
    """Per streamed chunk: receive time minus the engine's send time (fake engine: `t_sent` in
    each chunk, same clock), and per stream the time to the first chunk."""
    trips, ttfts = [], []
    with httpx.Client(timeout=60) as c:
        body = {"model": model, "prompt": "hello", "max_tokens": tokens, "stream": True, "fake_token_delay": delay,
                "fake_stamp": True}
        for i in range(n_streams + 3):
            t0 = time.perf_counter()
            first = True
            with c.stream("POST", base + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now, sent = time.time(), json.loads(line[6:])["t_sent"]
                    if i >= 3:  # the first streams warm up
                        trips.append(now - sent)
                        if first:
                            ttfts.append(time.perf_counter() - t0)
                    first = False
    return trips, ttfts


async def max_rate(base: str, model: str, concurrency: int, seconds: float) -> float:
    body = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        for _ in range(concurrency):
            await c.post(base + "/v1/completions", json=body)
        deadline = time.perf_counter() + seconds

        async def worker():
            nonlocal done
            while time.perf_counter() < deadline:
                r = await c.post(base + "/v1/completions", json=body)
                assert r.status_code == 200
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--token-delay", type=float, default=0.005, help="seconds between streamed tokens")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--workdir", default=None, help="where the process logs go (default: a temp dir)")
    args = p.parse_args()

    import tempfile

    work = Path(args.workdir or tempfile.mkdtemp(prefix="pagoda-bench-router-"))
    work.mkdir(parents=True, exist_ok=True)
    engine_port, router_port = free_port(), free_port()
    engine = Proc([PYTHON, FAKE, "--port", str(engine_port), "--model", "bench", "--token-delay", "0"],
                  work / "engine.log")
    engine.wait_http(f"http://127.0.0.1:{engine_port}/health", timeout=60)
    model = "bench"
    router = start_router(router_port, [f"http://127.0.0.1:{engine_port}"], work / "router.log",
                          ["--policy", "prefix-aware", "--log-level", "warning"])
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(router.pid, {cpus[0]})  # the router gets one core; engine and clients the rest
    if len(cpus) > 1:
        os.sched_setaffinity(engine.pid, set(cpus[1:]))
        os.sched_setaffinity(0, set(cpus[1:]))
    direct, routed = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{router_port}"
    try:
        out: dict = {"machine": {"cpus": len(cpus), "python": platform.python_version(),
                                                        "cpu": platform.processor() or platform.machine()}}
        lat_d = request_latencies(direct, model, args.requests)
        cpu0 = cpu_seconds(router.pid)
        lat_r = request_latencies(routed, model, args.requests)
        cpu_request = (cpu_seconds(router.pid) - cpu0) / (args.requests + 20)
        out["request"] = {"direct": summary_ms(lat_d), "router": summary_ms(lat_r),
                          "added_p50_ms": round((pct(lat_r, 0.5) - pct(lat_d, 0.5)) * 1e3, 3),
                          "added_p99_ms": round((pct(lat_r, 0.99) - pct(lat_d, 0.99)) * 1e3, 3),
                          "router_cpu_ms_per_request": round(cpu_request * 1e3, 3)}
        trip_d, ttft_d = chunk_latencies(direct, model, args.streams, args.tokens, args.token_delay)
        cpu0 = cpu_seconds(router.pid)
        trip_r, ttft_r = chunk_latencies(routed, model, args.streams, args.tokens, args.token_delay)
        cpu_stream = (cpu_seconds(router.pid) - cpu0) / (args.streams + 3)
        out["stream"] = {"tokens_per_stream": args.tokens, "token_interval_ms": args.token_delay * 1e3,
                         "chunk_trip_direct": summary_ms(trip_d), "chunk_trip_router": summary_ms(trip_r),
                         "added_per_token_p50_ms": round((pct(trip_r, 0.5) - pct(trip_d, 0.5)) * 1e3, 3),
                         "added_per_token_p99_ms": round((pct(trip_r, 0.99) - pct(trip_d, 0.99)) * 1e3, 3),
                         "router_cpu_ms_per_token": round((cpu_stream - cpu_request) / args.tokens * 1e3, 4),
                         "ttft_direct": summary_ms(ttft_d), "ttft_router": summary_ms(ttft_r)}
        cpu0, t0 = cpu_seconds(router.pid), time.perf_counter()
        rate = asyncio.run(max_rate(routed, model, args.concurrency, args.seconds))
        busy = (cpu_seconds(router.pid) - cpu0) / (time.perf_counter() - t0)
        out["max_rate"] = {"concurrency": args.concurrency, "router_one_core_rps": round(rate, 1),
                           "router_core_busy": round(busy, 2),  # < 1: the machine, not the router, was the limit
                           "router_rps_per_cpu_second": round(rate / busy, 1) if busy else None,
                           "direct_rps": round(asyncio.run(max_rate(direct, model, args.concurrency, args.seconds)), 1)}
        print(json.dumps(out, indent=1))
    finally:
        router.stop()
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

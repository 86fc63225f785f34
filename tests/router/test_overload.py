"""Overload: a real `pagoda serve` (tiny model, bounded waiting queue) behind a real `pagoda route`
(bounded per model), offered ten times the concurrency it runs. Past the bounds requests get 429
with Retry-After at once, neither process's memory grows with the offered load, and once the load
stops a request is served as fast as before it. OVERLOAD_SECONDS stretches the run (the issue's
proof runs 60 s: `OVERLOAD_SECONDS=60 pytest tests/router/test_overload.py`)."""

import asyncio
import os
import time

import httpx
import pytest

from pagoda_e2e import free_port, start_engine, start_router

RUNS = 4  # sequences the engine runs at once
OVERLOAD = 10 * RUNS  # concurrent clients offered
SECONDS = float(os.environ.get("OVERLOAD_SECONDS", "8"))


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the engine core), in MiB."""
    total = 0
    pids = [pid] + [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    for p in pids:
        for line in open(f"/proc/{p}/status"):
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    port = free_port()
    engine = start_engine(port, tmp / "engine.log", ["--model", "pagoda-tiny", "--num-kv-pages", "512",
                                                     "--max-num-seqs", str(RUNS), "--max-waiting-requests", "4"])
    router_port = free_port()
    router = start_router(router_port, [f"http://127.0.0.1:{port}"], tmp / "router.log",
                          ["--health-interval", "0.5", "--max-waiting-per-model", "16", "--retry-after", "2"])
    yield {"engine": engine, "router": router, "base": f"http://127.0.0.1:{router_port}"}
    router.stop()
    engine.stop()


async def _offer(base: str, seconds: float, clients: int) -> dict[int, int]:
    """`clients` loops sending requests back to back for `seconds`; statuses counted."""
    statuses: dict[int, int] = {}
    retry_after: set[str] = set()
    body = {"prompt": "overload", "max_tokens": 32, "ignore_eos": True}
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as client:
        async def loop():
            while time.monotonic() < deadline:
                r = await client.post(base + "/v1/completions", json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 429:
                    retry_after.add(r.headers.get("retry-after"))
                    assert r.json()["error"]["code"] == "too_many_requests"
        await asyncio.gather(*(loop() for _ in range(clients)))
    statuses["retry_after"] = retry_after
    return statuses


def _latency(base: str, n: int = 5) -> float:
    times = []
    for _ in range(n):
        start = time.monotonic()
        assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=30).status_code == 200
        times.append(time.monotonic() - start)
    return sorted(times)[n // 2]


def test_ten_times_overload_gets_429s_bounded_memory_and_recovers(stack):
    base = stack["base"]
    before = _latency(base)
    pids = {"engine": stack["engine"].pid, "router": stack["router"].pid}
    rss_start = {k: rss_mib(p) for k, p in pids.items()}
    # A first stretch warms every buffer and pool; the second must not grow memory past it.
    asyncio.run(_offer(base, SECONDS / 2, OVERLOAD))
    rss_warm = {k: rss_mib(p) for k, p in pids.items()}
    statuses = asyncio.run(_offer(base, SECONDS, OVERLOAD))
    rss_end = {k: rss_mib(p) for k, p in pids.items()}
    print(f"overload {SECONDS:g}s x{OVERLOAD} clients: {statuses}; RSS MiB start {rss_start} warm {rss_warm} "
          f"end {rss_end}; median latency before {before * 1000:.0f} ms")
    # Some are served and the rest refused; how many of each depends on the machine's speed (a less
    # loaded CI machine served more 200s than 429s).
    assert statuses.get(200, 0) > 0 and statuses.get(429, 0) > 0, statuses
    assert set(statuses) <= {200, 429, "retry_after"}, statuses
    assert statuses["retry_after"] <= {"1", "2"}, statuses  # the engine's 1 s, the router's 2 s
    for name in pids:
        assert rss_end[name] < rss_warm[name] + 64, (name, rss_start, rss_warm, rss_end)
    # Load gone: served as fast as before within 10 s.
    deadline = time.monotonic() + 10
    while _latency(base) > max(2 * before, before + 0.05):
        assert time.monotonic() < deadline, "latency did not recover within 10 s"
        time.sleep(0.5)

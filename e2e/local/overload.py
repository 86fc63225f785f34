"""Ten times overload through `pagoda route` for a minute, with the figures issue 53 asks for:
429s with Retry-After past the bounds, the resident memory of the router and of the engine (its
core included) at the start, warmed up and at the end, and how long after the load stops a request
is served as fast as before it.

    python e2e/local/overload.py [--seconds 60] [--runs 4] [--json out.json]

A real `pagoda serve` (the built-in tiny model, --max-num-seqs RUNS, a bounded waiting queue)
behind a real `pagoda route` (bounded per model) is offered 10 x RUNS clients sending back to back.
It prints one JSON object; tests/router/test_overload.py runs the same offer for a few seconds
and checks it. Exit status 1 when a bound failed (a status other than 200/429, memory grown past
the warm figure by more than 64 MiB, or no recovery within 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagoda_e2e import free_port, start_engine, start_router  # noqa: E402

RSS_GROWTH_MIB = 64  # allowed past the warmed-up figure: allocator noise, not growth with the load
RECOVERY_S = 10


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the engine core), in MiB."""
    total = 0
    pids = [pid] + [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    for p in pids:
        for line in open(f"/proc/{p}/status"):
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def start_stack(tmp: Path, runs: int) -> dict:
    """An engine running `runs` sequences at once with a waiting queue of 4, behind a router that
    holds at most 16 requests of the model waiting."""
    port = free_port()
    engine = start_engine(port, tmp / "engine.log", ["--model", "pagoda-tiny", "--num-kv-pages", "512",
                                                     "--max-num-seqs", str(runs), "--max-waiting-requests", "4"])
    router_port = free_port()
    router = start_router(router_port, [f"http://127.0.0.1:{port}"], tmp / "router.log",
                          ["--health-interval", "0.5", "--max-waiting-per-model", "16", "--retry-after", "2"])
    return {"engine": engine, "router": router, "base": f"http://127.0.0.1:{router_port}"}


async def offer(base: str, seconds: float, clients: int) -> dict:
    """`clients` loops sending requests back to back for `seconds`: statuses counted, the
    Retry-After values of the 429s, and whether each 429 is OpenAI's rate-limit error."""
    statuses: dict[int, int] = {}
    retry_after: set[str] = set()
    shapes: set[str | None] = set()
    body = {"prompt": "overload", "max_tokens": 32, "ignore_eos": True}
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients)) as client:
        async def loop():
            while time.monotonic() < deadline:
                r = await client.post(base + "/v1/completions", json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 429:
                    retry_after.add(r.headers.get("retry-after"))
                    shapes.add(r.json()["error"]["code"])
        await asyncio.gather(*(loop() for _ in range(clients)))
    return {"statuses": statuses, "retry_after": retry_after, "codes_429": shapes}


def median_latency(base: str, n: int = 5) -> float:
    times = []
    for _ in range(n):
        start = time.monotonic()
        assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 8}, timeout=30).status_code == 200
        times.append(time.monotonic() - start)
    return sorted(times)[n // 2]


def recovery_seconds(base: str, before: float, limit: float = RECOVERY_S) -> float | None:
    """Seconds after the load stopped until a request is served as fast as before it (within 2 x
    or 50 ms of the idle median); None when that takes longer than `limit`."""
    start = time.monotonic()
    while time.monotonic() - start <= limit:
        if median_latency(base) <= max(2 * before, before + 0.05):
            return time.monotonic() - start
        time.sleep(0.5)
    return None


def measure(stack: dict, seconds: float, clients: int) -> dict:
    """The overload run's figures (memory in MiB, latency in ms)."""
    base = stack["base"]
    before = median_latency(base)
    pids = {"engine": stack["engine"].pid, "router": stack["router"].pid}
    rss_start = {k: rss_mib(p) for k, p in pids.items()}
    # A first stretch warms every buffer and pool; the second must not grow memory past it.
    asyncio.run(offer(base, seconds / 2, clients))
    rss_warm = {k: rss_mib(p) for k, p in pids.items()}
    offered = asyncio.run(offer(base, seconds, clients))
    rss_end = {k: rss_mib(p) for k, p in pids.items()}
    recovered = recovery_seconds(base, before)
    return {"seconds": seconds, "clients": clients, "statuses": offered["statuses"],
            "retry_after": sorted(offered["retry_after"], key=str), "codes_429": sorted(map(str, offered["codes_429"])),
            "rss_mib": {k: {"start": round(rss_start[k], 1), "warm": round(rss_warm[k], 1), "end": round(rss_end[k], 1)}
                        for k in pids},
            "idle_latency_ms": round(before * 1000, 1),
            "recovery_s": None if recovered is None else round(recovered, 2)}


def problems(figures: dict) -> list[str]:
    out = []
    statuses = figures["statuses"]
    if not statuses.get(200) or not statuses.get(429):
        out.append(f"expected some 200s and some 429s, got {statuses}")
    if set(statuses) - {200, 429}:
        out.append(f"statuses other than 200 and 429: {statuses}")
    if figures["codes_429"] and figures["codes_429"] != ["too_many_requests"]:
        out.append(f"429 bodies with codes {figures['codes_429']}")
    if None in figures["retry_after"] or not figures["retry_after"]:
        out.append(f"429s without Retry-After: {figures['retry_after']}")
    for name, rss in figures["rss_mib"].items():
        if rss["end"] >= rss["warm"] + RSS_GROWTH_MIB:
            out.append(f"{name} memory grew under load: {rss}")
    if figures["recovery_s"] is None:
        out.append(f"latency did not recover within {RECOVERY_S} s")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the measured overload (default 60)")
    parser.add_argument("--runs", type=int, default=4, help="sequences the engine runs at once (default 4)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.runs < 1:
        parser.error("--seconds must be > 0 and --runs >= 1")
    with tempfile.TemporaryDirectory(prefix="pagoda-overload-") as tmp:
        stack = start_stack(Path(tmp), args.runs)
        try:
            figures = measure(stack, args.seconds, 10 * args.runs)
        finally:
            stack["router"].stop()
            stack["engine"].stop()
    figures["problems"] = problems(figures)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 1 if figures["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""`python -m pagoda_engine.bench.remote_read`: how fast the remote KV tier reads pages out of
Redis into host rows, through `worker.kv_stores.RedisStore.read_into`, with its two readers:
  mget: redis-py's MGET (hiredis when installed): one bytes object per entry, checked, then copied
        into its row (the only reader before; rediss:// still uses it);
  resp: the store's own RESP reader: K connections, each in a thread of its own, pipeline GETs for
        their share of the keys, receive each payload straight into its row and check it there.

For each `--io-threads` setting and each `--shards` count S it starts S `redis-server`s
(`--redis-server`, else the one on PATH; as `pagoda bench kv-share` does: 127.0.0.1, no persistence)
and writes `--pages` entries of `--page-mib` (256 x 2 MiB: a 4,096-token Llama-3.1-8B context on one
rank) through the store (`ShardedRedisStore` over the S servers when S > 1, as the engine with S
comma-separated URLs in --kv-offload-remote-url; the readers' connections are then per server). Then, `--repeats` rounds, each reading every entry once with every reader on every server
in turn (so that other load on the machine falls on all of them alike), into the same host rows
(pinned on CUDA, as the engine's). Printed: payload GB/s over the wall time of one `read_into`
call (best and median of the rounds), and the median CPU time of one read in the redis-servers
(summed) and in this process (the reader's threads). Every read is checked against what was written, byte for byte.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from pagoda_engine.bench.kv_share import RedisServer
from pagoda_engine.bench.serve import process_cpu_s
from pagoda_engine.worker.kv_stores import RedisStore, ShardedRedisStore, remote_store

_FINGERPRINT = b"remote-read-bench"[:16]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=256, help="entries written and read back per read")
    p.add_argument("--page-mib", type=float, default=2.0, help="one entry's payload (Llama-3.1-8B, one rank: 2 MiB)")
    p.add_argument("--connections", type=int, nargs="+", default=[1, 2, 4, 8], help="the RESP reader's connections")
    p.add_argument("--io-threads", type=int, nargs="+", default=[1, 4],
                   help="redis-server --io-threads settings to measure (1: the main thread only)")
    p.add_argument("--shards", type=int, nargs="+", default=[1],
                   help="how many redis-servers the entries are spread over (the engine's comma-separated "
                        "--kv-offload-remote-url)")
    p.add_argument("--repeats", type=int, default=5, help="reads per reader and setting")
    p.add_argument("--timeout-s", type=float, default=10.0,
                   help="the store's socket timeout (the engine's PAGODA_KV_REMOTE_TIMEOUT_S, 1 s, can fail a 512 MiB "
                        "MGET on a loaded machine: the engine counts that as a failure; here the speed is measured)")
    p.add_argument("--redis-server", default=None, metavar="PATH", help="default: redis-server on PATH")
    p.add_argument("--output-json", default=None, help="also write the results as JSON to this file")


def _rows(pages: int, payload_bytes: int) -> np.ndarray:
    import torch

    pinned = torch.cuda.is_available()
    return torch.empty((pages, payload_bytes), dtype=torch.uint8, pin_memory=pinned).numpy()


def _cpu_s(pids: list[int] | None = None) -> float:
    """CPU seconds (user + system) of this process, all its threads, or of processes `pids`."""
    if pids is None:
        return time.process_time()
    return sum(process_cpu_s(pid) for pid in pids)


def _read_once(store: RedisStore | ShardedRedisStore, server_pids: list[int], keys: list[bytes], data: np.ndarray,
               rows: np.ndarray, reader: str, connections: int) -> tuple[float, float, float]:
    """(wall, redis-servers' CPU, reader CPU) seconds of one `read_into` of every entry with this
    reader; the rows are checked after."""
    for server in getattr(store, "shards", [store]):
        server.resp_reads = reader == "resp"
        server.read_connections = connections
    rows.fill(0)
    server0, reader0, t0 = _cpu_s(server_pids), _cpu_s(), time.perf_counter()
    intact, corrupt = store.read_into(keys, list(rows))
    times = time.perf_counter() - t0, _cpu_s(server_pids) - server0, _cpu_s() - reader0
    if intact != len(keys) or corrupt is not None or not np.array_equal(rows, data):
        raise RuntimeError(f"{reader} x{connections}: {intact} of {len(keys)} entries intact ({corrupt}); "
                           f"store errors {store.errors}")
    return times


def run_remote_read(args: argparse.Namespace) -> dict:
    for flag, values in (("--pages", [args.pages]), ("--repeats", [args.repeats]), ("--connections", args.connections),
                         ("--io-threads", args.io_threads), ("--shards", args.shards)):
        if any(v < 1 for v in values):
            raise SystemExit(f"error: {flag} must be >= 1, got {' '.join(map(str, values))}")
    if not args.page_mib > 0:
        raise SystemExit(f"error: --page-mib must be > 0, got {args.page_mib}")
    binary = args.redis_server or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("error: no redis-server on PATH: install it (Debian: apt-get install redis-server) or give "
                         "--redis-server PATH")
    payload_bytes = int(args.page_mib * (1 << 20))
    data = np.frombuffer(np.random.default_rng(0).bytes(args.pages * payload_bytes), dtype=np.uint8)
    data = data.reshape(args.pages, payload_bytes)
    keys = [i.to_bytes(16, "big") for i in range(args.pages)]
    rows = _rows(args.pages, payload_bytes)
    readers = [("mget", 1)] + [("resp", k) for k in args.connections]
    servers, stores, pids = [], {}, {}
    settings = [(n, s) for n in args.io_threads for s in args.shards]
    try:
        for n, s in settings:  # all up at once: the rounds below take turns, so load spreads evenly
            started = [RedisServer(binary, 2 * data.nbytes / (1 << 30) + 1, io_threads=n) for _ in range(s)]
            servers += started
            for server in started:
                server.start()
            store = stores[n, s] = remote_store(",".join(x.url for x in started), _FINGERPRINT,
                                                timeout_s=args.timeout_s)
            pids[n, s] = [x.process.pid for x in started]
            for start in range(0, args.pages, 16):
                if not store.write([(keys[i], memoryview(data[i])) for i in range(start, min(start + 16, args.pages))]):
                    raise RuntimeError(f"writing the entries to {store.url} failed")
        version = servers[0].version()
        taken: dict[tuple, list[tuple[float, float, float]]] = {(*x, *r): [] for x in settings for r in readers}
        for _ in range(args.repeats):
            for (n, s, reader, connections), times in taken.items():
                times.append(_read_once(stores[n, s], pids[n, s], keys, data, rows, reader, connections))
    finally:
        for server in servers:
            server.stop()
    results = []
    for (n, s, reader, connections), times in taken.items():
        wall, server_cpu, reader_cpu = zip(*times)
        results.append({"io_threads": n, "shards": s, "reader": reader, "connections": connections,
                        "best_GBps": round(data.nbytes / min(wall) / 1e9, 3),
                        "median_GBps": round(data.nbytes / statistics.median(wall) / 1e9, 3),
                        "seconds": [round(x, 4) for x in wall],
                        "redis_cpu_ms_median": round(statistics.median(server_cpu) * 1e3, 1),
                        "reader_cpu_ms_median": round(statistics.median(reader_cpu) * 1e3, 1)})
    result = {"bench": "remote_read", "pages": args.pages, "payload_bytes": payload_bytes,
              "read_bytes": data.nbytes, "redis": f"redis-server {version}", "results": results}
    _print(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print(r: dict) -> None:
    print(f"=== remote tier reads: {r['pages']} entries of {r['payload_bytes'] / 2**20:.2f} MiB "
          f"({r['read_bytes'] / 2**20:.0f} MiB a read), {r['redis']} on 127.0.0.1; GB/s best / median ===")
    settings = list(dict.fromkeys((x["io_threads"], x["shards"]) for x in r["results"]))
    print("| reader | " + " | ".join(f"io-threads {n}, {s} server{'s' * (s > 1)}" for n, s in settings) + " |")
    print("|---|" + "---|" * len(settings))
    for reader, connections in dict.fromkeys((x["reader"], x["connections"]) for x in r["results"]):
        cells = [next((f"{x['best_GBps']:.2f} / {x['median_GBps']:.2f}" for x in r["results"]
                       if (x["reader"], x["connections"], x["io_threads"], x["shards"]) == (reader, connections, n, s)),
                      "-") for n, s in settings]
        label = "MGET (redis-py)" if reader == "mget" else f"RESP reader, {connections} conn. per server"
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("median ms of one read: wall / redis-servers' CPU / reader CPU (all its threads)")
    for x in r["results"]:
        wall = statistics.median(x["seconds"]) * 1e3
        print(f"  io-threads {x['io_threads']}, {x['shards']} server(s), {x['reader']} x{x['connections']}: "
              f"{wall:.0f} / {x['redis_cpu_ms_median']:.0f} / {x['reader_cpu_ms_median']:.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda_engine.bench.remote_read", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    run_remote_read(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

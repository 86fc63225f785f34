"""`python -m pagoda_engine.bench.remote_read`: how fast the remote KV tier reads pages out of
Redis into host rows, through `worker.kv_stores.RedisStore.read_into`, with its two readers:
  mget: redis-py's MGET (hiredis when installed): one bytes object per entry, checked, then copied
        into its row (the only reader before; rediss:// still uses it);
  resp: the store's own RESP reader: K connections, each in a thread of its own, pipeline GETs for
        their share of the keys, receive each payload straight into its row and check it there.

For each `--io-threads` setting it starts a `redis-server` (`--redis-server`, else the one on PATH;
as `pagoda bench kv-share` does: 127.0.0.1, no persistence), writes `--pages` entries of
`--page-mib` (256 x 2 MiB: a 4,096-token Llama-3.1-8B context on one rank) through the store, and
reads them all back `--repeats` times with each reader into the same host rows (pinned on CUDA, as
the engine's). Printed: payload GB/s over the wall time of one `read_into` call (best and median of
the repeats). Every read is checked against what was written, byte for byte.
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
from pagoda_engine.worker.kv_stores import RedisStore

_FINGERPRINT = b"remote-read-bench"[:16]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pages", type=int, default=256, help="entries written and read back per read")
    p.add_argument("--page-mib", type=float, default=2.0, help="one entry's payload (Llama-3.1-8B, one rank: 2 MiB)")
    p.add_argument("--connections", type=int, nargs="+", default=[1, 2, 4, 8], help="the RESP reader's connections")
    p.add_argument("--io-threads", type=int, nargs="+", default=[1, 4],
                   help="redis-server --io-threads settings to measure (1: the main thread only)")
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


def _measure(store: RedisStore, keys: list[bytes], data: np.ndarray, rows: np.ndarray, reader: str,
             connections: int, repeats: int) -> dict:
    store.resp_reads = reader == "resp"
    store.read_connections = connections
    seconds = []
    for _ in range(repeats):
        rows.fill(0)
        t0 = time.perf_counter()
        intact, corrupt = store.read_into(keys, list(rows))
        seconds.append(time.perf_counter() - t0)
        if intact != len(keys) or corrupt is not None or not np.array_equal(rows, data):
            raise RuntimeError(f"{reader} x{connections}: {intact} of {len(keys)} entries intact ({corrupt}); "
                               f"store errors {store.errors}")
    return {"reader": reader, "connections": connections if reader == "resp" else 1,
            "best_GBps": round(data.nbytes / min(seconds) / 1e9, 3),
            "median_GBps": round(data.nbytes / statistics.median(seconds) / 1e9, 3),
            "seconds": [round(s, 4) for s in seconds]}


def run_remote_read(args: argparse.Namespace) -> dict:
    binary = args.redis_server or shutil.which("redis-server")
    if binary is None:
        raise SystemExit("error: no redis-server on PATH: install it (Debian: apt-get install redis-server) or give "
                         "--redis-server PATH")
    payload_bytes = int(args.page_mib * (1 << 20))
    data = np.frombuffer(np.random.default_rng(0).bytes(args.pages * payload_bytes), dtype=np.uint8)
    data = data.reshape(args.pages, payload_bytes)
    keys = [i.to_bytes(16, "big") for i in range(args.pages)]
    rows = _rows(args.pages, payload_bytes)
    maxmemory_gb = 2 * data.nbytes / (1 << 30) + 1
    results = []
    for io_threads in args.io_threads:
        server = RedisServer(binary, maxmemory_gb, io_threads=io_threads)
        server.start()
        try:
            store = RedisStore(server.url, _FINGERPRINT, timeout_s=args.timeout_s)
            for start in range(0, args.pages, 16):
                if not store.write([(keys[i], memoryview(data[i])) for i in range(start, min(start + 16, args.pages))]):
                    raise RuntimeError(f"writing the entries to {server.url} failed")
            version = server.version()
            runs = [_measure(store, keys, data, rows, "mget", 1, args.repeats)]
            runs += [_measure(store, keys, data, rows, "resp", k, args.repeats) for k in args.connections]
        finally:
            server.stop()
        for run in runs:
            results.append({"io_threads": io_threads, **run})
            print(f"io-threads {io_threads}: {run['reader']} x{run['connections']}: best {run['best_GBps']:.3f} GB/s, "
                  f"median {run['median_GBps']:.3f} GB/s", flush=True)
    result = {"bench": "remote_read", "pages": args.pages, "payload_bytes": payload_bytes,
              "read_bytes": data.nbytes, "redis": f"redis-server {version}", "results": results}
    _print(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print(r: dict) -> None:
    print(f"=== remote tier reads: {r['pages']} entries of {r['payload_bytes'] / 2**20:.2f} MiB "
          f"({r['read_bytes'] / 2**20:.0f} MiB a read), {r['redis']} on 127.0.0.1; GB/s best / median ===")
    settings = sorted({x["io_threads"] for x in r["results"]})
    print("| reader | " + " | ".join(f"io-threads {n}" for n in settings) + " |")
    print("|---|" + "---|" * len(settings))
    for reader, connections in dict.fromkeys((x["reader"], x["connections"]) for x in r["results"]):
        cells = [next((f"{x['best_GBps']:.2f} / {x['median_GBps']:.2f}" for x in r["results"]
                       if (x["reader"], x["connections"], x["io_threads"]) == (reader, connections, n)), "-")
                 for n in settings]
        label = "MGET (redis-py)" if reader == "mget" else f"RESP reader, {connections} conn."
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda_engine.bench.remote_read", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    run_remote_read(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

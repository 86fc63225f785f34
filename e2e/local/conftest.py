"""Everything on one machine: two `pagoda serve` replicas (built-in tiny model, CPU), `pagoda
route` in front of them, a second router whose only replica is started on demand (scale from
zero), and a real Prometheus scraping all of them every second with the labels a ServiceMonitor
would give them (namespace, service). Started once per module; stopped after it.

Keys as the operator sets them: every engine requires the internal key (PAGODA_API_KEY), the
routers send it (PAGODA_BACKEND_API_KEY) and accept clients holding a key of their
--api-key-file; /health and /metrics (probes, Prometheus) need none."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagoda_e2e import (PROMETHEUS, free_port, prometheus_config, start_engine, start_pagoda,  # noqa: E402
                        start_prometheus, start_router)

# Small and quick: a 512-page KV pool, and at most two running requests so a burst queues.
ENGINE_ARGS = ["--model", "pagoda-tiny", "--num-kv-pages", "512", "--max-num-seqs", "2"]
NAMESPACE = "default"
INTERNAL_KEY = "e2e-internal-key"
CLIENT_KEY = "e2e-client-key"
ENGINE_ENV = {"PAGODA_API_KEY": INTERNAL_KEY}
ROUTER_ENV = {"PAGODA_BACKEND_API_KEY": INTERNAL_KEY}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install -y prometheus)")
    tmp = tmp_path_factory.mktemp("e2e")
    ports = {k: free_port() for k in ("a", "b", "late", "router", "zero_router", "prom")}
    url = {k: f"http://127.0.0.1:{p}" for k, p in ports.items()}
    procs = []
    client_keys = tmp / "client-keys"
    client_keys.write_text(CLIENT_KEY + "\n")
    router_args = ["--health-interval", "0.5", "--api-key-file", str(client_keys)]
    try:
        # both engines boot at once (the slow part: imports and model load)
        engines = [start_pagoda(["serve", "--host", "127.0.0.1", "--port", str(ports[k]), *ENGINE_ARGS],
                                tmp / f"engine_{k}.log", env=ENGINE_ENV) for k in ("a", "b")]
        procs += engines
        for k, proc in zip(("a", "b"), engines):
            proc.wait_http(url[k] + "/health", timeout=600)
        procs.append(start_router(ports["router"], [url["a"], url["b"]], tmp / "router.log",
                                  ["--policy", "prefix-aware", *router_args], env=ROUTER_ENV))
        procs.append(start_router(ports["zero_router"], [url["late"]], tmp / "zero_router.log",
                                  ["--queue-timeout", "300", *router_args], env=ROUTER_ENV))
        label = lambda service: {"namespace": NAMESPACE, "service": service}  # noqa: E731
        config = prometheus_config({
            "engines": [(f"127.0.0.1:{ports['a']}", label("tiny-engine")), (f"127.0.0.1:{ports['b']}", label("tiny-engine")),
                        (f"127.0.0.1:{ports['late']}", label("zero-engine"))],
            "routers": [(f"127.0.0.1:{ports['router']}", label("tiny")),
                        (f"127.0.0.1:{ports['zero_router']}", label("zero"))],
        }, interval_s=1.0)
        prom = start_prometheus(ports["prom"], config, tmp / "prometheus")
        procs.append(prom)
        yield {"tmp": tmp, "url": url, "ports": ports, "engines": dict(zip(("a", "b"), engines)), "prom": prom,
               "start_late_engine": lambda: start_engine(ports["late"], tmp / "engine_late.log", ENGINE_ARGS,
                                                         env=ENGINE_ENV)}
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(tmp / "prometheus" / "data", ignore_errors=True)

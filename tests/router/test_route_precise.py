"""`pagoda route` with KV events: the prefix-aware policy routes by the engines' own prefix caches
(`scorer.PrecisePrefix`, the ranking `pagoda epp` uses) over two real engines: a prompt whose
prefix one engine holds goes there, whichever engine the approximate policy's hash ring names."""

from __future__ import annotations

import httpx
import pytest
from pagoda_e2e import engines_with_kv_events, free_port, start_router, until
from prometheus_client.parser import text_string_to_metric_families

MODEL = "pagoda-tiny"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("route")
    events = free_port()
    with engines_with_kv_events(tmp, 2, events, MODEL) as (_, urls):
        router_port = free_port()
        router = start_router(router_port, urls, tmp / "route.log", extra=[
            "--health-interval", "0.2", "--model", MODEL, "--kv-events-bind", f"tcp://127.0.0.1:{events}"])
        yield {"urls": urls, "router": f"http://127.0.0.1:{router_port}"}
        router.stop()


def _served(router: str) -> dict[str, float]:
    text = httpx.get(f"{router}/metrics", timeout=10).text
    return {s.labels["backend"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "pagoda_router:requests_total"}


def _index_pages(router: str) -> dict[str, float]:
    """pod -> pages the router's KV-event index has for it."""
    text = httpx.get(f"{router}/metrics", timeout=10).text
    return {s.labels["pod"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "pagoda_router:kv_index_pages"}


def _prefix(tenant: int) -> str:
    return " ".join(f"tenant{tenant} keeps this context line {i}." for i in range(8))


def test_a_prefix_goes_to_the_engine_whose_events_show_it(cluster):
    router, urls = cluster["router"], cluster["urls"]
    for tenant in range(6):
        holder = urls[tenant % 2]
        pod = holder.removeprefix("http://")
        held_before = _index_pages(router).get(pod, 0)
        httpx.post(f"{holder}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": _prefix(tenant) + " warm", "max_tokens": 1}).raise_for_status()
        # The holder's events for the prefix are in the router's index before any routed request
        # (one sent earlier could land elsewhere and put the prefix there too).
        until(lambda: _index_pages(router).get(pod, 0) > held_before, 60, f"{pod}'s events for tenant {tenant}")

        def routed_to_holder() -> bool:
            before = _served(router)
            httpx.post(f"{router}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": _prefix(tenant) + " a question", "max_tokens": 1}).raise_for_status()
            after = _served(router)
            return after.get(holder, 0) == before.get(holder, 0) + 1

        for _ in range(4):
            assert routed_to_holder(), tenant


def test_kv_event_flags_need_the_prefix_aware_policy_and_a_model(tmp_path):
    for extra, says in ((["--policy", "least-load", "--model", MODEL, "--kv-events-port", "5557"], "prefix-aware"),
                        (["--kv-events-port", "5557"], "--model")):
        proc = start_router(free_port(), ["http://127.0.0.1:1"], tmp_path / "bad.log", extra=extra, wait=False)
        until(lambda: not proc.alive(), 60, "the router to refuse")
        assert proc.popen.returncode == 2 and says in proc.log_text(), proc.log_text()
        proc.stop()

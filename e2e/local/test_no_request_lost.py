"""No request lost to a dying or retiring replica (issue 53's proof), with real parts on one
machine: three `pagoda serve` engines (the built-in tiny model, a Hermes tool template and parser)
behind a real `pagoda route`.

1. 200 streamed requests (chat and completions, greedy and seeded sampling, some with tools, some
   with a JSON schema) run once undisturbed and once while one engine is SIGTERMed (its drain
   deadline, 0.5 s, ends what it still runs) and started again, and another is SIGKILLed. Every
   response of the disturbed run is the undisturbed one: the same text and tool calls, each token
   once, one finish, one response id, one usage.
2. A rollout under steady load as Kubernetes makes it, with the router discovering the engines
   from their EndpointSlices in the emulated API server: for each old engine a new one starts
   (while the load runs) and joins its Service's endpoints (maxSurge 1), then the old one's
   endpoint turns not ready and terminating, it gets SIGTERM after the preStop pause and leaves
   (maxUnavailable 0). Zero failed requests. Printed: the TTFT p99 of 200 steady requests, of
   the rollout's and of a second rollout whose new engines started before the load (on one
   shared 2-core machine a new engine's start-up competes with the load for the same cores,
   which a cluster's new pod on its own node does not: that figure shows what is left without
   it), with the slowest requests, the replica each went to and what the rollout was doing then.
   Figures, not checks: other processes on the machine move them.

Tests run in file order on one module's engines."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from k8s_emulator import emulated_cluster
from pagoda_e2e import PYTHON, Proc, free_port, routed_engines, start_engine, start_pagoda, until
from streams import assert_whole, cores_paused, metric, metric_text, read, run_all, until_engine, until_in_flight

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
MODEL = "pagoda-tiny"
TEMPLATE = REPO / "tests" / "server" / "templates" / "hermes_tools.jinja"
# The tiny model's 512-token vocabulary spells a tool-laden prompt in ~600 tokens. Two sequences
# at a time: requests queue behind them on a fast machine too (what the drain deadline needs).
ENGINE = ["--model", MODEL, "--num-kv-pages", "2048", "--max-model-len", "2048", "--max-num-seqs", "2",
          "--drain-timeout", "0.1", "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
          "--tool-call-parser", "hermes"]
REQUESTS = 200
MAX_TOKENS = 40
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}}]
FOX = {"type": "json_schema", "json_schema": {"name": "fox", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "story": {"type": "string",
                                                                                         "maxLength": 40}},
    "required": ["name", "story"], "additionalProperties": False}}}


def requests(n: int, max_tokens: int = MAX_TOKENS) -> list[tuple[str, dict]]:
    """Streamed chat and completions, greedy and seeded, some asking for usage or token ids, every
    twentieth chat one with a required tool call and every tenth one with a JSON schema."""
    out = []
    for i in range(n):
        chat = i % 2 == 0
        body: dict = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        body.update({"temperature": 0} if i % 3 else {"temperature": 0.9, "seed": 1000 + i})
        if i % 4 == 1:
            body["stream_options"] = {"include_usage": True}
        if i % 5 == 2:
            body["return_token_ids"] = True
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell story number {i} about a fox."}]
        else:
            body["prompt"] = f"Story {i}: once upon a time"
        if i % 20 == 4:  # a required tool call: the grammar makes the random model write one
            body.update(tools=TOOLS, tool_choice="required", max_tokens=120, ignore_eos=False)
        elif i % 10 == 7:  # completions and chat alike: the continuation's grammar replays what was streamed
            body.update(response_format=FOX, max_tokens=120, ignore_eos=False)
        out.append(("/v1/chat/completions" if chat else "/v1/completions", body))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with routed_engines(tmp_path_factory.mktemp("no-request-lost"), 3, ENGINE,
                        ["--health-interval", "0.5", "--policy", "least-load"]) as state:
        yield state


def test_200_streams_survive_a_sigkill_and_a_restart_with_sigterm(stack):
    base, engines, urls = stack["router"], stack["engines"], stack["urls"]
    reqs = requests(REQUESTS)
    started = time.monotonic()
    reference = run_all(base, reqs)
    undisturbed_s = time.monotonic() - started
    for (path, body), got in zip(reqs, reference):
        assert got["errors"] == [] and len(got["finishes"]) == 1, (path, body, got)
        if body.get("tools"):
            assert got["calls"] and got["calls"][0]["name"] == "get_weather", got
    restarted = {}

    def disturb(progress):
        # Once streams are under way, engine 1 is told to stop (drain deadline 0.1 s) while it
        # generates with streams queued behind, then engine 0 dies while it generates (read from
        # the engines, not the clients: the engines run far ahead of 200 clients, and a fast one
        # has its queue empty by the time the clients have read much); engine 1 is started again
        # on its port meanwhile. The cores wait until engine 1 holds 50 streams (least-load gives
        # each engine about a third), so that every engine has seconds of work queued however
        # slowly the 200 clients send on a loaded machine.
        until_in_flight(base, urls[1], 50)
        paused.close()
        until_engine(urls[1], running=1, waiting=1)
        engines[1].popen.send_signal(signal.SIGTERM)
        until_engine(urls[0], running=1)
        engines[0].kill()
        assert engines[1].popen.wait(30) == 0  # drained and exited cleanly
        restarted["at_frames"] = progress.frames
        engines[1] = start_engine(int(urls[1].rsplit(":", 1)[1]), stack["tmp"] / "engine1-restarted.log", ENGINE)

    started = time.monotonic()
    with contextlib.ExitStack() as paused:
        paused.enter_context(cores_paused([e.pid for e in engines]))
        disturbed = run_all(base, reqs, disturb)
    disturbed_s = time.monotonic() - started
    for (path, body), want, got in zip(reqs, reference, disturbed):
        assert_whole(path, body, want, got)
    migrated = {cause: metric(base, "pagoda_router:migrations_total", f'{{cause="{cause}"}}')
                for cause in ("connection_error", "drain_deadline", "server_error")}
    print(f"{REQUESTS} streams: undisturbed {undisturbed_s:.1f} s, disturbed {disturbed_s:.1f} s "
          f"; migrations {migrated}; continuation tokens "
          f"{metric(base, 'pagoda_router:continuation_tokens_total'):.0f}; engine 1 back after "
          f"{restarted.get('at_frames')} frames")
    assert migrated["connection_error"] >= 1 and migrated["drain_deadline"] >= 1, migrated
    assert metric(base, "pagoda_router:stream_errors_total") == 0


# --- a rollout as Kubernetes makes it ------------------------------------------------------------

SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
SERVICE = "tiny-engine"
LOAD_CLIENTS = 4
# Requests measured before the rollout: a p99 of 200 is their second largest TTFT (of 17, as
# before, it was the largest, about a p94, which made every later tail look worse).
STEADY = 200
PRESTOP_S = 1.0


def _slice(name: str, port: int, ready: bool = True, terminating: bool = False) -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": SERVICE}},
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": ["127.0.0.1"],
                           "conditions": {"ready": ready, "serving": ready, "terminating": terminating}}]}


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


class _Timeline:
    """What the rollout is doing (its steps, stamped), which phase a request started in and what
    step it started under: the evidence printed beside the figures."""

    def __init__(self):
        self.t0 = time.monotonic()
        self.phase = "steady"
        self.steps: list[tuple[float, str]] = [(0.0, "steady load")]

    def step(self, what: str) -> None:
        self.steps.append((time.monotonic() - self.t0, what))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def under(self, at: float) -> str:
        return [what for when, what in self.steps if when <= at][-1]


class _Rollout:
    """The engine pods of one Service as a Deployment's rollout replaces them (maxSurge 1,
    maxUnavailable 0): for each old pod a new one joins the endpoints once ready, then the old
    one's endpoint turns not ready and terminating, preStop waits, SIGTERM, and it leaves."""

    def __init__(self, api: str, router: str, timeline: _Timeline):
        self.api, self.router, self.timeline = api, router, timeline

    def add(self, name: str, port: int) -> None:
        httpx.post(self.api, json=_slice(name, port)).raise_for_status()

    def replace(self, old_name: str, old: Proc, old_port: int, new_name: str, new_port: int, serving: int) -> None:
        self.add(new_name, new_port)
        until(lambda: httpx.get(self.router + "/health").json()["ready_backends"] == serving + 1, 30,
              f"{new_name} in rotation")
        self.timeline.step(f"{new_name} in rotation")
        retiring = {"endpoints": _slice(old_name, old_port, ready=False, terminating=True)["endpoints"]}
        httpx.patch(f"{self.api}/{old_name}", json=retiring,
                    headers={"content-type": "application/merge-patch+json"}).raise_for_status()
        self.timeline.step(f"{old_name} terminating")
        time.sleep(PRESTOP_S)
        # What SIGTERM finds on the leaving engine (the router stopped sending it work a preStop ago).
        text = httpx.get(f"http://127.0.0.1:{old_port}/metrics", timeout=10).text
        self.timeline.step(f"{old_name} SIGTERM with {metric_text(text, 'pagoda:num_requests_running'):.0f} running, "
                           f"{metric_text(text, 'pagoda:num_requests_waiting'):.0f} waiting")
        assert old.stop() == 0  # drained (0.1 s) and exited cleanly
        self.timeline.step(f"{old_name} gone")
        httpx.delete(f"{self.api}/{old_name}").raise_for_status()


def test_a_rollout_of_every_engine_under_load_fails_no_request(stack, tmp_path):
    """Steady load, then the rollout as a cluster makes it (each new engine starts while the
    load runs: the issue's figure), then a second rollout whose new engines started before its
    window (on this machine their start-up competes with the load for the same cores, which a
    cluster's new pods on their own nodes or CPU requests do not: the figure beside it)."""
    old = [(e, int(u.rsplit(":", 1)[1])) for e, u in zip(stack["engines"], stack["urls"]) if e.alive()]
    reqs = [(path, dict(body, stream_options={"include_usage": True})) for path, body in requests(12, max_tokens=32)]
    with emulated_cluster(tmp_path) as cluster:
        cluster.apiserver.api.declare("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice")
        api = cluster.url + SLICES
        for i, (_, port) in enumerate(old):
            httpx.post(api, json=_slice(f"old-{i}", port)).raise_for_status()
        router_port = free_port()
        router = Proc([PYTHON, "-m", "pagoda_engine.router.app", "--host", "127.0.0.1", "--port", str(router_port),
                       "--k8s-service", f"default/{SERVICE}", "--kubeconfig", str(cluster.kubeconfig),
                       "--policy", "least-load", "--health-interval", "0.5"], tmp_path / "router.log")
        base = f"http://127.0.0.1:{router_port}"
        started: list[Proc] = []
        try:
            router.wait_http(base + "/health")
            until(lambda: httpx.get(base + "/health").json()["ready_backends"] == len(old), 30, "the old engines")
            reference = [read(base, path, body) for path, body in reqs]
            # The second rollout's engines, started before the load (and idle until their turn).
            ports = [free_port() for _ in old]
            procs = [start_pagoda(["serve", "--host", "127.0.0.1", "--port", str(p), *ENGINE], tmp_path / f"next-{i}.log")
                     for i, p in enumerate(ports)]
            started.extend(procs)
            for proc, port in zip(procs, ports):
                proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
            timeline = _Timeline()
            rollout = _Rollout(api, base, timeline)
            results: list[tuple[int, dict, str, float]] = []  # (request, response, phase, start)
            stop = threading.Event()

            def load(worker: int):
                i = worker
                while not stop.is_set():
                    path, body = reqs[i % len(reqs)]
                    phase, at = timeline.phase, timeline.now()
                    results.append((i % len(reqs), read(base, path, body), phase, at))
                    i += LOAD_CLIENTS

            def count(phase: str) -> int:
                return sum(1 for r in results if r[2] == phase)

            def start(name: str) -> tuple[Proc, int]:
                port = free_port()
                started.append(start_engine(port, tmp_path / f"{name}.log", ENGINE))
                return started[-1], port

            with concurrent.futures.ThreadPoolExecutor(LOAD_CLIENTS) as pool:
                workers = [pool.submit(load, w) for w in range(LOAD_CLIENTS)]
                until(lambda: count("steady") >= STEADY, 300, "the steady sample")
                timeline.phase = "rollout"
                current = []
                for i, (engine, port) in enumerate(old):
                    timeline.step(f"new-{i} starting")
                    proc, new_port = start(f"new-{i}")
                    rollout.replace(f"old-{i}", engine, port, f"new-{i}", new_port, len(old))
                    current.append((f"new-{i}", proc, new_port))
                timeline.phase = "after"
                timeline.step("after")
                until(lambda: count("after") >= LOAD_CLIENTS, 60, "load on the new set")
                timeline.phase = "prestarted"
                for i, ((name, engine, port), new_port) in enumerate(zip(current, ports)):
                    rollout.replace(name, engine, port, f"next-{i}", new_port, len(current))
                timeline.phase = "done"
                stop.set()
                for w in workers:
                    w.result()
            served = sorted(b["url"] for b in httpx.get(base + "/router/backends").json()["backends"])
            assert served == sorted(f"http://127.0.0.1:{p}" for p in ports)
            for i, got, _, _ in results:
                assert_whole(*reqs[i], reference[i], got)
            assert metric(base, "pagoda_router:stream_errors_total") == 0
            latency = {p: [got["ttft"] for _, got, when, _ in results if when == p]
                       for p in ("steady", "rollout", "after", "prestarted")}
            steady = _p99(latency["steady"])

            def slowest(phase: str) -> str:
                worst = sorted((r for r in results if r[2] == phase), key=lambda r: -r[1]["ttft"])[:4]
                return ", ".join(f"{got['ttft'] * 1000:.0f} ms at {at:.1f} s on :{got['backend'].rsplit(':', 1)[1]} "
                                 f"({timeline.under(at)})" for _, got, _, at in worst)

            print("rollout: " + ", ".join(f"{p} {len(v)} requests, TTFT p99 {_p99(v) * 1000:.0f} ms"
                                          + ("" if p == "steady" else f" ({_p99(v) / steady:.2f} x steady)")
                                          for p, v in latency.items())
                  + f"; migrations {metric(base, 'pagoda_router:migrations_total'):.0f}"
                  + f"; load average {os.getloadavg()[0]:.1f}")
            print(f"slowest of the rollout: {slowest('rollout')}; of the prestarted one: {slowest('prestarted')}")
            print("rollout steps: " + ", ".join(f"{when:.1f} s {what}" for when, what in timeline.steps))
        finally:
            router.stop()
            stack["engines"] += started  # stopped with the module's

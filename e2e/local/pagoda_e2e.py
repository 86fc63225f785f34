"""Process harness for tests that run Pagoda's parts for real on one machine: free ports,
subprocesses with their output in a log file (shown when a start fails), HTTP readiness waits,
`pagoda serve`, `pagoda route` and a Prometheus with a generated scrape config.

Shared by e2e/local and tests/router (their conftests put this directory on sys.path).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(predicate, timeout: float, what: str, step: float = 0.2):
    """Poll `predicate` until it returns something truthy (returned); a KeyError or TypeError
    counts as "not yet" (a field not written yet). AssertionError naming `what` on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (KeyError, TypeError):
            value = None
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Proc:
    """A child process whose stdout+stderr go to `log_path`; stop() is SIGTERM, then SIGKILL."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, cwd: str | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL to the whole process group: a replica dying, not shutting down."""
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the process drains and takes its children down), SIGKILL after `timeout`;
        then whatever of its process group is left."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # orphans of a process that did not clean up
        except ProcessLookupError:
            pass
        self._log.close()
        return self.popen.returncode

    def wait_http(self, url: str, timeout: float = 60.0, status: int = 200) -> None:
        """Wait until GET url answers `status`; fail with the process log if it exits first."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.args[:3]} exited with {self.popen.returncode}:\n{self.log_text()[-4000:]}")
            try:
                code, _ = http_get(url, timeout=1.0)
                if code == status:
                    return
                last = code
            except OSError as e:
                last = e
            time.sleep(0.1)
        raise TimeoutError(f"{url} not answering {status} after {timeout}s (last: {last}):\n{self.log_text()[-4000:]}")


def start_pagoda(verb_args: list[str], log_path: Path, env: dict | None = None) -> Proc:
    """`pagoda <verb> ...` with the interpreter running the tests."""
    if verb_args[0] == "route":  # the router alone: it must not depend on the engine server importing
        return Proc([PYTHON, "-m", "pagoda_engine.router.app", *verb_args[1:]], log_path, env=env)
    return Proc([PYTHON, "-m", "pagoda_engine.cli", *verb_args], log_path, env=env)


def start_engine(port: int, log_path: Path, extra: list[str] | None = None, env: dict | None = None) -> Proc:
    """`pagoda serve` on 127.0.0.1 with the `extra` flags (tests name their model there: --model pagoda-tiny
    for the built-in tiny one), ready when this returns."""
    proc = start_pagoda(["serve", "--host", "127.0.0.1", "--port", str(port), *(extra or [])], log_path, env=env)
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
    return proc


def start_router(port: int, backends: list[str], log_path: Path, extra: list[str] | None = None,
                 wait: bool = True, env: dict | None = None) -> Proc:
    proc = start_pagoda(["route", "--host", "127.0.0.1", "--port", str(port), "--backends", ",".join(backends),
                         *(extra or [])], log_path, env=env)
    if wait:
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
    return proc


def start_engines(tmp: Path, count: int, args, env: dict | None = None) -> tuple[list[Proc], list[str]]:
    """`count` engines (`pagoda serve` on 127.0.0.1, free ports) started together and waited for
    after, so they load in parallel: their processes and URLs, in port order. `args`: the flags
    of each, or a function of its port giving them. A start that fails stops the others."""
    ports = sorted(free_port() for _ in range(count))
    engines = []
    try:
        for port in ports:
            flags = args(port) if callable(args) else args
            engines.append(start_pagoda(["serve", "--host", "127.0.0.1", "--port", str(port), *flags],
                                        tmp / f"engine-{port}.log", env=env))
        for proc, port in zip(engines, ports):
            proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
    except BaseException:
        for proc in engines:
            proc.stop()
        raise
    return engines, [f"http://127.0.0.1:{p}" for p in ports]


@contextlib.contextmanager
def routed_engines(tmp: Path, count: int, engine_args: list[str], router_args: list[str]):
    """`count` engines (`start_engines`) behind one `pagoda route`: yields {"tmp", "router" (its
    URL), "engines", "urls"}. A test may replace processes in "engines" (a restart, a rollout)
    or add its own there: every one listed at the end is stopped with the router."""
    engines, urls = start_engines(tmp, count, engine_args)
    state = {"tmp": tmp, "engines": engines, "urls": urls}
    router = None
    try:
        port = free_port()
        router = start_router(port, urls, tmp / "router.log", router_args)
        state["router"] = f"http://127.0.0.1:{port}"
        yield state
    finally:
        if router is not None:
            router.stop()
        for proc in state["engines"]:
            proc.stop()


@contextlib.contextmanager
def engines_with_kv_events(tmp: Path, count: int, events_port: int, model: str = "pagoda-tiny",
                           extra: tuple[str, ...] = ()):
    """`count` engines of `model` publishing their KV events to the subscriber bound on
    127.0.0.1:`events_port` (a router's or a picker's --kv-events-bind), each under llm-d's topic
    `kv@<ip:port>@<model>` (`start_engines`). Yields their processes and URLs in port order;
    stops them on the way out."""
    def flags(port: int) -> list[str]:
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{events_port}",
                             "topic": f"kv@127.0.0.1:{port}@{model}"})
        return ["--model", model, "--num-kv-pages", "256", "--max-model-len", "512", *extra,
                "--kv-events-config", config]

    engines, urls = start_engines(tmp, count, flags)
    try:
        yield engines, urls
    finally:
        for proc in engines:
            proc.stop()


PROMETHEUS = shutil.which("prometheus")


def prometheus_config(jobs: dict[str, list[tuple[str, dict]]], interval_s: float = 1.0) -> str:
    """A scrape config: job name -> [(host:port, extra labels)]. YAML is a JSON superset."""
    return json.dumps({
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "scrape_configs": [
            {"job_name": job, "scrape_interval": f"{interval_s:g}s", "scrape_timeout": f"{interval_s:g}s",
             "static_configs": [{"targets": [t], "labels": labels} for t, labels in targets]}
            for job, targets in jobs.items()
        ],
    }, indent=1)


def start_prometheus(port: int, config: str, workdir: Path) -> Proc:
    if PROMETHEUS is None:
        raise RuntimeError("prometheus is not installed (apt-get install -y prometheus)")
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "prometheus.yml"
    cfg.write_text(config)
    proc = Proc([PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h",
                 "--query.lookback-delta=15s"], workdir / "prometheus.log")
    proc.wait_http(f"http://127.0.0.1:{port}/-/ready", timeout=60)
    return proc


def prom_query(base_url: str, promql: str) -> list[dict]:
    code, body = http_get(f"{base_url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    data = json.loads(body)
    if code != 200 or data.get("status") != "success":
        raise RuntimeError(f"query {promql!r} failed: {code} {body[:300]!r}")
    return data["data"]["result"]

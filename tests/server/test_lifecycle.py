"""Process life cycle of `pagoda serve`: SIGTERM drains in-flight requests and exits 0 with no
orphan, a dead core turns /health to 503 and fails requests fast, a lost parent takes the core
with it, a model that cannot load is a clear error before any port opens, and a taken port is
refused before any model loads."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import DEFAULT_ARGS, core_pid, launch, pid_alive
from pagoda_e2e import free_port


def _stream(url: str, max_tokens: int, started: list, n: int = 1) -> dict:
    body = {"prompt": "Tell a story", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "n": n}
    text, finish, error, done = "", None, None, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        status = resp.status_code
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                    continue
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0]["finish_reason"] or finish
                started.append(True)
    return {"status": status, "finish": finish, "error": error, "done": done, "chunks": len(started)}


def _wait_exit(proc, timeout: float) -> int:
    proc.popen.wait(timeout)
    return proc.popen.returncode


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_sigterm_drains_then_exits_zero_without_orphans(tmp_path):
    # Without the growth reservation every sequence is admitted at once (so all start streaming).
    srv = launch(tmp_path, "--model", "pagoda-tiny", "--num-kv-pages", "512", "--max-model-len", "2048", "--drain-timeout", "2",
                 "--no-kv-growth-reservation")
    try:
        core = core_pid(srv.proc.pid)
        with ThreadPoolExecutor(6) as pool:
            started = [[] for _ in range(6)]
            # Four short requests finish within the drain window; two long ones cannot: 16 sequences
            # of 2,000 tokens each, and the 511 pages (8,176 tokens) hold four such at a time, so they
            # need at least 8 rounds of 2,000 decode steps, far beyond the 2 s window however fast the
            # model is (2,000 steps alone took under 2 s here).
            lengths = [(12, 1)] * 4 + [(2000, 16)] * 2
            futures = [pool.submit(_stream, srv.url, max_tokens, s, n) for (max_tokens, n), s in zip(lengths, started)]
            deadline = time.monotonic() + 60
            while not all(started) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert all(started), "requests did not start"
            srv.proc.popen.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            # Still listening while it drains: health says so, and asks clients to hang up.
            health = httpx.get(f"{srv.url}/health", timeout=2)
            assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
            assert health.headers["connection"] == "close"
            refused = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            results = [f.result(timeout=60) for f in futures]
        for r in results[:4]:
            assert r["status"] == 200 and r["finish"] == "length" and r["error"] is None and r["done"]
        for r in results[4:]:
            assert r["status"] == 200 and r["error"] is not None and r["done"]
            assert r["error"]["code"] == "shutting_down" and "shutting down" in r["error"]["message"]
        assert _wait_exit(srv.proc, 30) == 0
        assert _wait_gone(core), "engine core outlived the server"
    finally:
        srv.proc.stop()


def test_dead_core_fails_fast_with_503(tmp_path):
    srv = launch(tmp_path, *DEFAULT_ARGS)
    try:
        core = core_pid(srv.proc.pid)
        with ThreadPoolExecutor(1) as pool:
            started: list = []
            future = pool.submit(_stream, srv.url, 500, started)
            while not started:
                time.sleep(0.02)
            os.kill(core, signal.SIGKILL)
            r = future.result(timeout=30)
        # The stream was already 200: it ends with an in-band error frame.
        assert r["status"] == 200 and r["done"] and r["error"]["code"] == "engine_dead"

        health = httpx.get(f"{srv.url}/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        t0 = time.monotonic()
        resp = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert resp.status_code == 503 and time.monotonic() - t0 < 2
        assert "engine" in resp.json()["error"]["message"].lower()
        srv.proc.popen.send_signal(signal.SIGTERM)
        assert _wait_exit(srv.proc, 30) == 0
    finally:
        srv.proc.stop()


def test_core_exits_when_the_server_is_killed(tmp_path):
    srv = launch(tmp_path, *DEFAULT_ARGS)
    core = core_pid(srv.proc.pid)
    srv.proc.kill()  # SIGKILL: no chance to clean up
    assert _wait_gone(core), "engine core orphaned after its server was killed"


def test_missing_model_is_a_clear_error_before_any_port(tmp_path):
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--host", "127.0.0.1", "--port",
                           str(port), "--model", str(tmp_path / "no-such-model")],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


@pytest.mark.parametrize("servers", ["1", "2"])
def test_a_taken_port_is_refused_at_once_naming_the_address_before_any_model_loads(servers):
    """A second `pagoda serve` on a busy port exits 2 naming the address, without loading the
    model first (it used to load it, for ~20 s on a real model, and only then fail to bind)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", "pagoda-tiny", "--host",
                              "127.0.0.1", "--port", str(port), "--api-server-count", servers],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"pagoda serve: cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    # Nothing started: no engine core, no model, no KV pool.
    assert "KV cache capacity" not in out.stdout and "engine core" not in out.stderr.lower()


def test_a_port_another_server_listens_on_first_while_the_model_loads_is_a_clear_error():
    """The port is bound before the model loads but listened on after; a server that bound it too
    (both with SO_REUSEADDR, as uvicorn binds) and listens first wins it: exit 3, naming the address."""
    import socket

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", 0))
        port = other.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", "pagoda-tiny", "--host",
                                 "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        seen = []
        for line in proc.stderr:  # the engine core's first words: the port was bound before it started
            seen.append(line)
            if "pagoda_engine.core" in line:
                break
        other.listen()
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 3, "".join(seen) + err
    assert "KV cache capacity" in out  # it got as far as the listen
    assert f"pagoda serve: cannot listen on 127.0.0.1:{port}: Address already in use" in err


# `pagoda serve` up to the moment it spawns its engine core, with the spawn replaced by a report of
# the heavy libraries imported so far (the tokenizer's thread, which imports transformers beside the
# core's start-up, is held until then).
_SPAWN_PROBE = """
import argparse, sys, threading
from pagoda_engine import serve
from pagoda_engine.api.server import async_engine, core_client

spawned = threading.Event()

def start(self):
    heavy = [m for m in ("torch", "transformers", "triton", "flashinfer", "numpy") if m in sys.modules]
    print("imported before the spawn:", heavy, flush=True)
    spawned.set()
    raise KeyboardInterrupt

def load_tokenizer_and_defaults(config):
    spawned.wait(60)
    raise RuntimeError("not needed")

core_client.CoreProcess.start = start
async_engine._load_tokenizer_and_defaults = load_tokenizer_and_defaults
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
sys.exit(serve.run(parser.parse_args(["--model", "pagoda-tiny", "--host", "127.0.0.1", "--port", "0"])))
"""


def test_the_engine_core_is_spawned_before_torch_is_imported():
    """The engine core's start-up (imports, model, KV sizing, graphs) is the path to ready; the API
    process spawns it first. Importing torch (and numpy) in the API process before the spawn cost a
    fresh H100 machine 6 s of start to ready (docs/benchmarks.md, 2026-11-25)."""
    proc = subprocess.run([sys.executable, "-c", _SPAWN_PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr  # the probe's stop: interrupted while starting
    assert "imported before the spawn: []" in proc.stdout, proc.stdout + proc.stderr

"""`pagoda serve --profiler-config`: POST /start_profile and /stop_profile profile every rank of
the engine (tensor parallelism over gloo: two processes), each writing its own trace and summary;
max_iterations stops the profiler by itself; a bad config stops the CLI before any engine starts."""

import gzip
import json
import subprocess
import sys
import time

import httpx
import pytest

from conftest import DEFAULT_ARGS, launch

MAX_ITERATIONS = 3


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def server(tmp_path_factory, trace_dir):
    config = {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "torch_profiler_with_stack": False,
              "max_iterations": MAX_ITERATIONS}
    srv = launch(tmp_path_factory.mktemp("serve"), *DEFAULT_ARGS, "--tensor-parallel-size", "2",
                 "--profiler-config", json.dumps(config))
    yield srv
    srv.proc.stop()


def _complete(server, max_tokens: int) -> None:
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"model": "pagoda-tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": max_tokens,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text


def _op_names(trace_path: str) -> set[str]:
    with gzip.open(trace_path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_every_rank_writes_a_trace_of_the_model_and_a_summary(server, trace_dir):
    assert httpx.post(f"{server.url}/start_profile", timeout=60).json() == {"traces": [], "summaries": []}
    _complete(server, max_tokens=2)  # two steps: under the limit, so /stop_profile stops it
    files = httpx.post(f"{server.url}/stop_profile", timeout=120).json()
    traces, summaries = files["traces"], files["summaries"]
    assert [t.split("/")[-1].split(".")[0] for t in traces] == ["dp0_pp0_tp0_rank0", "dp0_pp0_tp1_rank1"]
    assert len({t.split("/")[-1].split(".")[1] for t in traces}) == 1  # one tag shared by the ranks of a profile
    for trace, summary in zip(traces, summaries):
        assert trace.startswith(str(trace_dir)) and trace.endswith(".pt.trace.json.gz")
        names = _op_names(trace)
        assert "aten::mm" in names and "gloo:all_reduce" in names  # the rank's shard and its collective
        text = open(summary).read()
        assert "no GPU" in text and "aten::mm" in text


def test_max_iterations_stops_the_profiler_by_itself(server, trace_dir):
    before = set(trace_dir.glob("*.pt.trace.json.gz"))
    assert httpx.post(f"{server.url}/start_profile", timeout=60).status_code == 200
    _complete(server, max_tokens=3 * MAX_ITERATIONS)
    deadline = time.monotonic() + 30
    while len(set(trace_dir.glob("*.pt.trace.json.gz")) - before) < 2:  # both ranks, before any /stop_profile
        assert time.monotonic() < deadline, "max_iterations did not stop the profiler"
        time.sleep(0.1)
    written = set(trace_dir.glob("*.pt.trace.json.gz")) - before
    assert sorted(httpx.post(f"{server.url}/stop_profile", timeout=60).json()["traces"]) == sorted(map(str, written))


def test_start_while_running_and_stop_while_stopped_are_refused(server):
    r = httpx.post(f"{server.url}/stop_profile", timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "profiler_state"
    assert "not running" in r.json()["error"]["message"]
    assert httpx.post(f"{server.url}/start_profile", timeout=60).status_code == 200
    r = httpx.post(f"{server.url}/start_profile", timeout=60)
    assert r.status_code == 400 and "already running" in r.json()["error"]["message"]
    assert httpx.post(f"{server.url}/stop_profile", timeout=120).status_code == 200


@pytest.mark.parametrize("config, message", [
    ('{"profiler": "torch", "torch_profiler_dir": "t", "max_iters": 3}', "unknown field(s) max_iters"),
    ('{"profiler": "torch", "torch_profiler_dir": "t", "max_iterations": true}', "max_iterations must be a whole"),
    ('{"profiler": "torch", "torch_profiler_dir": ""}', "torch_profiler_dir must be set"),
])
def test_a_bad_profiler_config_stops_the_cli_before_the_engine(config, message):
    # A model that does not exist: had the engine started, the error would be about the model.
    proc = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", "no-such-model",
                           "--profiler-config", config], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "pagoda serve: profiler config" in proc.stderr

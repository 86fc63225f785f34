"""`pagoda serve --api-server-count 2`: a launcher, the engine core(s) and two API server processes
on one port. Every request is answered by one API process (its index in the X-Pagoda-API-Server
header) with the tokens one process would give; every core serves both processes; /metrics of
either process counts each request once; a dead core makes both unhealthy, a dead API process
stops the server (exit 1), and SIGTERM drains and stops every process. Either process starts and
stops the profiler on every core, and the core answers the process that asked."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.conftest import (DEFAULT_ARGS, api_server_pids, child_pids, core_pids, launch, pid_alive,
                                   scrape)

MODEL = "pagoda-tiny"
HEADER = "x-pagoda-api-server"


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def asc_server(request, tmp_path_factory):
    dp = request.param
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path_factory.mktemp("traces")),
                "torch_profiler_with_stack": False}
    # --max-model-len 2048 (the tiny model's): a stream long enough that it cannot end while a test
    # sends its request id again through the other API process.
    srv = launch(tmp_path_factory.mktemp(f"serve-asc-dp{dp}"), *DEFAULT_ARGS, "--max-model-len", "2048",
                 "--api-server-count", "2", "--data-parallel-size", str(dp), "--profiler-config", json.dumps(profiler))
    srv.dp = dp
    wait_for_every_api_server(srv.url)
    yield srv
    srv.proc.stop()


def wait_for_every_api_server(url: str, count: int = 2, timeout: float = 120) -> None:
    """/health answered by each API process (a fresh connection each time: the processes race
    to accept it, and one may still be loading its tokenizer when the first serves)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < count:
        assert time.monotonic() < deadline, f"only API servers {seen} answered"
        r = httpx.get(f"{url}/health", timeout=10)
        if r.status_code == 200:
            seen.add(r.headers[HEADER])
        time.sleep(0.02)


def test_either_api_process_profiles_every_core(asc_server):
    """Whichever API process takes /stop_profile stops every core's profiler and returns every
    core's traces. The processes race to accept each connection and one may win many in a row:
    fresh connections are probed with /health (cheap, as `wait_for_every_api_server` does) until
    one lands on a process that has not profiled yet, and that connection (kept alive) starts and
    stops the profiler."""
    answered_by: set[str] = set()
    deadline = time.monotonic() + 150
    while answered_by != {"0", "1"}:
        assert time.monotonic() < deadline, f"only API servers {answered_by} stopped the profiler"
        with httpx.Client(base_url=asc_server.url, timeout=120) as client:
            if client.get("/health").headers[HEADER] in answered_by:
                continue
            assert client.post("/start_profile").status_code == 200
            r = client.post("/stop_profile")
            assert r.status_code == 200 and len(r.json()["traces"]) == asc_server.dp  # one rank per core
            answered_by.add(r.headers[HEADER])


def _client_on(url: str, index: str, timeout: float = 120) -> httpx.Client:
    """A kept-alive connection that API process `index` accepted (fresh ones probed with /health)."""
    deadline = time.monotonic() + timeout
    while True:
        assert time.monotonic() < deadline, f"API server {index} accepted no connection"
        client = httpx.Client(base_url=url, timeout=120)
        if client.get("/health").headers[HEADER] == index:
            return client
        client.close()


def test_stops_through_both_api_processes_at_once_stop_every_core_once(asc_server):
    """Two /stop_profile at once, one through each API process, can reach the cores in opposite
    orders. Every core's trace is returned once over the two answers; an answer is 400 only when
    its process stopped no core."""
    clients = [_client_on(asc_server.url, "0"), _client_on(asc_server.url, "1")]
    try:
        for _ in range(3):
            assert clients[0].post("/start_profile").status_code == 200

            async def stop_both():
                return await asyncio.gather(*(asyncio.to_thread(c.post, "/stop_profile") for c in clients))

            answers = asyncio.run(stop_both())
            traces = [t for r in answers if r.status_code == 200 for t in r.json()["traces"]]
            assert len(traces) == len(set(traces)) == asc_server.dp, [r.text for r in answers]
            assert all(r.status_code == 200 or r.json()["error"]["code"] == "profiler_state" for r in answers)
    finally:
        for client in clients:
            client.close()


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _engines(samples: dict[str, float], name: str, dp: int, **labels: str) -> list[float]:
    extra = "".join(f",{k}={v}" for k, v in sorted(labels.items()))
    return [samples.get(f"{name}{{engine={engine}{extra}}}", 0.0) for engine in range(dp)]


def _wait_idle(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m["pagoda:num_requests_running"] == m["pagoda:num_requests_waiting"] == 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


PROMPTS = [f"Request number {i} says" for i in range(48)]


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None, str]:
    """(text, finish reason, the API server that answered) of one streamed completion."""
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True})
    text, finish = "", None
    async for chunk in raw.parse():
        for choice in chunk.choices:
            text += choice.text or ""
            finish = choice.finish_reason or finish
    return text, finish, raw.headers[HEADER]


def test_concurrent_streams_get_one_process_greedy_tokens_from_both_api_servers(asc_server, server):
    _wait_idle(asc_server.url)
    before = scrape(asc_server.url, per_engine=True)

    async def run():
        client = openai.AsyncOpenAI(base_url=asc_server.base_url, api_key="none", max_retries=0, timeout=300,
                                    http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)))
        async with client:
            return await asyncio.gather(*(_stream(client, p, 12) for p in PROMPTS))

    results = asyncio.run(run())
    assert all(finish == "length" for _, finish, _ in results)
    served_by = {who for _, _, who in results}

    async def one_more():
        async with openai.AsyncOpenAI(base_url=asc_server.base_url, api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await _stream(client, PROMPTS[0], 12)

    extra = 0  # the processes share one listening socket: on a loaded machine one may accept a whole burst
    while served_by != {"0", "1"} and extra < 30:
        _, finish, who = asyncio.run(one_more())
        assert finish == "length"
        served_by.add(who)
        extra += 1
    assert served_by == {"0", "1"}, served_by  # both API processes answered some of them

    async def reference():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300) as client:
            outs = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                                                    temperature=0, extra_body={"ignore_eos": True})
                                          for p in PROMPTS))
        return [o.choices[0].text for o in outs]

    assert [text for text, _, _ in results] == asyncio.run(reference())

    _wait_idle(asc_server.url)
    dp = asc_server.dp
    deadline = time.monotonic() + 10
    while True:  # API process 0 records the steps: its last stats may trail the idle state another one shows
        after = scrape(asc_server.url, per_engine=True)
        delta = {name: [a - b for a, b in zip(_engines(after, name, dp, **labels),
                                              _engines(before, name, dp, **labels))]
                 for name, labels in (("pagoda:request_success_total", {"finished_reason": "length"}),
                                      ("pagoda:generation_tokens_total", {}), ("pagoda:prompt_tokens_total", {}),
                                      ("pagoda:iteration_tokens_total_sum", {}))}
        steps_done = sum(delta["pagoda:iteration_tokens_total_sum"]) >= (sum(delta["pagoda:prompt_tokens_total"])
                                                                         + (len(PROMPTS) + extra) * 11)
        if steps_done or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    # Every request counted once, whichever API process served it and scrape answered.
    assert sum(delta["pagoda:request_success_total"]) == len(PROMPTS) + extra
    assert sum(delta["pagoda:generation_tokens_total"]) == (len(PROMPTS) + extra) * 12
    # Each step's tokens once (not once per API process): each prompt token, and every output
    # token but the last, was scheduled in some step.
    assert sum(delta["pagoda:iteration_tokens_total_sum"]) == (sum(delta["pagoda:prompt_tokens_total"])
                                                               + (len(PROMPTS) + extra) * 11)
    if dp == 2:
        assert all(n > 0 for n in delta["pagoda:request_success_total"]), delta  # both cores served


def test_metrics_of_either_api_server_are_the_whole_pods(asc_server):
    _wait_idle(asc_server.url)
    by_server: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while len(by_server) < 2:
        assert time.monotonic() < deadline, by_server.keys()
        r = httpx.get(f"{asc_server.url}/metrics", timeout=10)
        by_server.setdefault(r.headers[HEADER], r.text)
    texts = list(by_server.values())
    for text in texts:
        # The cores' gauges and info once per core, not once per API process.
        assert text.count("pagoda:cache_config_info{") == asc_server.dp
        assert text.count("pagoda:num_requests_running{") == asc_server.dp
    # The counters and histograms sum every process's files: the same figures from both.
    def counters(text: str) -> list[str]:
        return sorted(line for line in text.splitlines()
                      if line.startswith(("pagoda:request_success_total", "pagoda:generation_tokens_total",
                                          "pagoda:e2e_request_latency_seconds_count")))

    assert counters(texts[0]) == counters(texts[1])


def test_a_refusal_and_an_abort_reach_only_the_api_server_that_sent_the_request(asc_server):
    """A request id in use on one API process, sent again through the other: the core refuses
    it, and the refusal must come back to the second process (a refusal sent to the first would
    leave the second request hanging). Closing the first stream aborts it in its core."""
    _wait_idle(asc_server.url)
    before = scrape(asc_server.url)

    async def run() -> int:
        for attempt in range(1, 41):
            body = {"model": MODEL, "prompt": "Long story", "max_tokens": 2000, "ignore_eos": True,
                    "request_id": f"shared-{attempt}"}
            pin = {"X-data-parallel-rank": "0"}  # with two cores: the same core sees both
            async with (httpx.AsyncClient(timeout=60, headers=pin) as first,
                        httpx.AsyncClient(timeout=60, headers=pin) as second):
                async with first.stream("POST", f"{asc_server.base_url}/completions",
                                        json={**body, "stream": True}) as stream:
                    lines = stream.aiter_lines()
                    while not (await lines.__anext__()).startswith("data:"):
                        pass
                    again = await second.post(f"{asc_server.base_url}/completions", json=body)
                    assert again.status_code == 400, again.text
                    assert again.json()["error"]["param"] == "request_id"
                    crossed = again.headers[HEADER] != stream.headers[HEADER]
            if crossed:
                return attempt
        raise AssertionError("40 pairs of connections all went to one API process")

    streams = asyncio.run(run())
    deadline = time.monotonic() + 30
    while True:
        m = scrape(asc_server.url)
        if m["pagoda:num_requests_running"] == m["pagoda:kv_cache_usage_perc"] == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    aborted = m["pagoda:request_success_total{finished_reason=abort}"] - before["pagoda:request_success_total{finished_reason=abort}"]
    finished = m["pagoda:request_success_total{finished_reason=length}"] - before["pagoda:request_success_total{finished_reason=length}"]
    # Each closed stream is an abort; so is the refused request (as any refusal by a core is), once.
    assert (aborted, finished) == (streams + 1, 0)


def test_api_server_count_below_one_is_refused():
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", MODEL,
                          "--api-server-count", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--api-server-count must be >= 1" in out.stderr


def test_api_server_count_on_a_headless_node_is_refused():
    # A headless node serves no API, so the flag would be accepted and ignored: refused, as vLLM does.
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", MODEL, "-tp", "2",
                          "--nnodes", "2", "--node-rank", "1", "--headless", "--api-server-count", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--api-server-count=2 cannot be used with --headless" in out.stderr


def test_a_taken_port_fails_at_once_before_any_model_loads():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", MODEL, "--host", "127.0.0.1",
                              "--port", str(port), "--api-server-count", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "KV cache capacity" not in out.stdout and time.monotonic() - started < 60


def test_a_dead_core_makes_every_api_server_unhealthy_and_a_dead_api_server_stops_the_server(tmp_path):
    srv = launch(tmp_path, *DEFAULT_ARGS, "--api-server-count", "2", "--data-parallel-size", "2")
    try:
        wait_for_every_api_server(srv.url)
        cores, servers = core_pids(srv.proc.pid), api_server_pids(srv.proc.pid)
        assert len(cores) == 2 and len(servers) == 2
        os.kill(cores[1], signal.SIGKILL)
        unhealthy: set[str] = set()
        deadline = time.monotonic() + 30
        while unhealthy != {"0", "1"}:
            assert time.monotonic() < deadline, f"only API servers {unhealthy} report the dead core"
            r = httpx.get(f"{srv.url}/health", timeout=10)
            if r.status_code == 503:
                assert "data-parallel engine core 1" in r.json()["error"]["message"]
                unhealthy.add(r.headers[HEADER])
            time.sleep(0.02)
        refused = httpx.post(f"{srv.base_url}/completions", timeout=10, json={"model": MODEL, "prompt": "hi",
                                                                             "max_tokens": 4})
        assert refused.status_code == 503

        everything = descendants(srv.proc.pid)
        os.kill(servers[0], signal.SIGKILL)
        assert srv.proc.popen.wait(60) == 1  # never a silent half-server
        assert "API server process 0 exited unexpectedly" in srv.proc.log_text()
        deadline = time.monotonic() + 10
        while alive := [p for p in everything if pid_alive(p)]:
            assert time.monotonic() < deadline, f"left behind: {alive}"
            time.sleep(0.1)
    finally:
        srv.proc.stop()


def test_sigterm_drains_a_stream_then_stops_every_process(asc_server):
    """Last in the module: it stops the module's server."""
    launcher = asc_server.proc
    everything = descendants(launcher.pid)
    assert len(api_server_pids(launcher.pid)) == 2 and len(core_pids(launcher.pid)) == asc_server.dp

    async def run():
        async with openai.AsyncOpenAI(base_url=asc_server.base_url, api_key="none", max_retries=0,
                                      timeout=300) as client:
            stream = await client.completions.create(model=MODEL, prompt="Keep going", max_tokens=150,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
            chunks = stream.__aiter__()
            await chunks.__anext__()
            launcher.popen.send_signal(signal.SIGTERM)
            finish = None
            async for chunk in chunks:
                finish = chunk.choices[0].finish_reason or finish if chunk.choices else finish
            return finish

    assert asyncio.run(run()) == "length"  # the in-flight stream finished during the drain
    assert launcher.popen.wait(60) == 0
    deadline = time.monotonic() + 10
    while alive := [p for p in everything if pid_alive(p)]:
        assert time.monotonic() < deadline, f"left behind: {alive}"
        time.sleep(0.1)
    # New connections are refused, not queued on a socket nobody accepts from.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{asc_server.url}/health", timeout=5)

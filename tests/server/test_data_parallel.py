"""`pagoda serve --data-parallel-size 2`: two engine-core processes behind one API server. Each
request goes to the least-loaded core, aborts reach the core that holds the request, /metrics
reports every core under vLLM's `engine` label, /start_profile and /stop_profile reach every core,
and one dead core makes the pod unhealthy."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagoda_engine import capabilities
from pagoda_engine.api.llm import LLM
from pagoda_engine.api.server.dp_client import DPEngineCoreClient
from pagoda_engine.config import EngineConfig
from pagoda_engine.messages import EngineCoreOutputs, ProfileReply, SchedulerStats
from pagoda_engine.profiler import ProfilerStateError
from tests.server.conftest import DEFAULT_ARGS, core_pids, free_port, kill_core_and_wait_unhealthy, launch, scrape

MODEL = "pagoda-tiny"


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    # A context long enough for the abort test's long stream (the later flag wins).
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path_factory.mktemp("traces")),
                "torch_profiler_with_stack": False}
    srv = launch(tmp_path_factory.mktemp("serve-dp"), *DEFAULT_ARGS, "--max-model-len", "2048",
                 "--data-parallel-size", "2", "--profiler-config", json.dumps(profiler))
    yield srv
    srv.proc.stop()


# As long as the context allows (2,048 positions), so that it cannot end on its own before its
# close reaches the server (a fresh clone's suite on 2 loaded cores once counted no abort).
DROPPED_MAX_TOKENS = 2030
# The kept stream must still run when the gauges are first read: a fresh clone's suite on 2
# loaded cores once saw a 400-token stream end before that, and both gauges at 0.
KEPT_MAX_TOKENS = 1600


def _engines(samples: dict[str, float], name: str, **labels: str) -> list[float]:
    """The per-core values of one sample, engine 0 first."""
    extra = "".join(f",{k}={v}" for k, v in sorted(labels.items()))
    return [samples[f"{name}{{engine={engine}{extra}}}"] for engine in ("0", "1")]


def _wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m["pagoda:num_requests_running"] == m["pagoda:num_requests_waiting"] == m["pagoda:kv_cache_usage_perc"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


async def _stream(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None, int]:
    """(text, finish reason, number of chunks carrying text) of one streamed completion."""
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    text, finish, chunks = "", None, 0
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.text:
                text += choice.text
                chunks += 1
            finish = choice.finish_reason or finish
    return text, finish, chunks


def test_64_concurrent_streams_are_all_answered_and_both_cores_serve_them(dp_server):
    before = scrape(dp_server.url, per_engine=True)

    async def run():
        client = openai.AsyncOpenAI(base_url=dp_server.base_url, api_key="none", max_retries=0, timeout=300,
                                    http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=64)))
        async with client:
            return await asyncio.gather(*(_stream(client, f"Request number {i} says", 12) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(finish == "length" for _, finish, _ in results)
    assert all(chunks >= 1 for _, _, chunks in results)
    _wait_idle(dp_server.url)
    after = scrape(dp_server.url, per_engine=True)
    generated = [a - b for a, b in zip(_engines(after, "pagoda:generation_tokens_total"),
                                       _engines(before, "pagoda:generation_tokens_total"))]
    finished = [a - b for a, b in zip(_engines(after, "pagoda:request_success_total", finished_reason="length"),
                                      _engines(before, "pagoda:request_success_total", finished_reason="length"))]
    assert sum(generated) == 64 * 12 and sum(finished) == 64  # none lost, none counted twice
    assert all(n > 0 for n in generated), generated  # both cores did work
    assert all(n >= 16 for n in finished), finished  # and the load was spread, not one straggler
    prompts = [a - b for a, b in zip(_engines(after, "pagoda:prompt_tokens_total"),
                                     _engines(before, "pagoda:prompt_tokens_total"))]
    assert all(n > 0 for n in prompts), prompts


def test_profiling_reaches_every_core(dp_server):
    assert httpx.post(f"{dp_server.url}/start_profile", timeout=60).status_code == 200
    for rank in (0, 1):
        r = httpx.post(f"{dp_server.base_url}/completions", headers={"X-data-parallel-rank": str(rank)}, timeout=60,
                       json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200, r.text
    traces = httpx.post(f"{dp_server.url}/stop_profile", timeout=120).json()["traces"]
    assert [t.rsplit("/", 1)[1].split(".")[0] for t in traces] == ["dp0_pp0_tp0_rank0", "dp1_pp0_tp0_rank0"]


def test_greedy_outputs_equal_one_cores(dp_server, server):
    prompts = [f"The {word} of the story" for word in ("start", "middle", "end", "moral", "hero", "twist")]

    async def complete_all(url: str) -> list[str]:
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300) as client:
            outs = await asyncio.gather(*(client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0,
                                                                    extra_body={"ignore_eos": True}) for p in prompts))
        return [o.choices[0].text for o in outs]

    before = scrape(dp_server.url, per_engine=True)
    dp_texts = asyncio.run(complete_all(dp_server.base_url))
    after = scrape(dp_server.url, per_engine=True)
    served = [a - b for a, b in zip(_engines(after, "pagoda:request_success_total", finished_reason="length"),
                                    _engines(before, "pagoda:request_success_total", finished_reason="length"))]
    assert all(n > 0 for n in served), served  # both cores answered some of them
    assert dp_texts == asyncio.run(complete_all(server.base_url))


def test_aborting_a_stream_frees_it_on_the_core_that_holds_it(dp_server):
    """Two long streams, one per core; closing one mid-way ends it on its core (pages freed, an
    abort counted there, fewer tokens than asked for) and leaves the other to finish. An abort
    sent to the wrong core would leave the dropped request running to its last token.

    The tiny model decodes a token in well under a millisecond, so on a loaded machine a stream
    can end on its own before its close reaches the server: such a round proves nothing and is
    run again (up to four rounds)."""

    async def run():
        async with openai.AsyncOpenAI(base_url=dp_server.base_url, api_key="none", max_retries=0, timeout=300) as client:
            kept = await client.completions.create(model=MODEL, prompt="Kept going", max_tokens=KEPT_MAX_TOKENS, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
            kept_chunks = kept.__aiter__()
            await kept_chunks.__anext__()
            # The gauges follow the cores' stats, which may trail the first chunk by a step.
            deadline = time.monotonic() + 10
            while sorted(running := _engines(scrape(dp_server.url, per_engine=True), "pagoda:num_requests_running")) != [0, 1]:
                assert time.monotonic() < deadline, running
                await asyncio.sleep(0.05)
            kept_on = running.index(1)
            dropped = await client.completions.create(model=MODEL, prompt="Dropped soon", max_tokens=DROPPED_MAX_TOKENS,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True})
            received = 0
            async for _ in dropped:
                received += 1
                if received == 3:
                    break
            # The router sends it to the idle core (least loaded): running there when it is closed.
            holding = _engines(scrape(dp_server.url, per_engine=True), "pagoda:num_requests_running")
            await dropped.close()
            # The dropped stream's core goes idle with its pages freed.
            deadline = time.monotonic() + 30
            while True:
                m = scrape(dp_server.url, per_engine=True)
                running = _engines(m, "pagoda:num_requests_running")
                kv = _engines(m, "pagoda:kv_cache_usage_perc")
                if running[1 - kept_on] == 0 and kv[1 - kept_on] == 0:
                    break
                assert time.monotonic() < deadline, m
                await asyncio.sleep(0.05)
            async for _ in kept_chunks:
                pass
            return kept_on, holding

    rounds = []
    for _ in range(4):
        _wait_idle(dp_server.url)
        before = scrape(dp_server.url, per_engine=True)
        kept_on, holding = asyncio.run(run())
        dropped_on = 1 - kept_on
        _wait_idle(dp_server.url)
        after = scrape(dp_server.url, per_engine=True)

        def delta(name: str, **labels: str) -> list[float]:
            return [a - b for a, b in zip(_engines(after, name, **labels), _engines(before, name, **labels))]

        aborted = delta("pagoda:request_success_total", finished_reason="abort")
        finished = delta("pagoda:request_success_total", finished_reason="length")
        generated = delta("pagoda:generation_tokens_total")
        counted = (f"aborted {aborted}, finished {finished}, generated {generated}, kept on core {kept_on}, "
                   f"running when closed {holding}")
        rounds.append(counted)
        if holding[dropped_on] == 1 and generated[dropped_on] < DROPPED_MAX_TOKENS:
            break  # it was running on the other core when its close arrived
    else:
        pytest.fail("no round closed the dropped stream while it ran: " + "; ".join(rounds))
    assert aborted[dropped_on] == 1 and aborted[kept_on] == 0, counted
    assert finished[kept_on] == 1 and finished[dropped_on] == 0, counted
    assert generated[kept_on] == KEPT_MAX_TOKENS, counted


@pytest.mark.parametrize("rank", [0, 1])
def test_the_data_parallel_rank_header_sends_every_request_to_that_core(dp_server, rank):
    _wait_idle(dp_server.url)
    before = scrape(dp_server.url, per_engine=True)
    headers = {"X-data-parallel-rank": str(rank)}
    for i in range(3):  # least-loaded routing would take turns between the idle cores
        r = httpx.post(f"{dp_server.base_url}/completions", headers=headers, timeout=60,
                       json={"model": MODEL, "prompt": f"Pinned {i}", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
    chat = httpx.post(f"{dp_server.base_url}/chat/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                            "stream": True, "ignore_eos": True})
    assert chat.status_code == 200 and "[DONE]" in chat.text
    _wait_idle(dp_server.url)
    after = scrape(dp_server.url, per_engine=True)
    served = [a - b for a, b in zip(_engines(after, "pagoda:request_success_total", finished_reason="length"),
                                    _engines(before, "pagoda:request_success_total", finished_reason="length"))]
    assert served[rank] == 4 and served[1 - rank] == 0, served


@pytest.mark.parametrize("value", ["2", "-1", "one", "", "1.0"])
@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
def test_a_data_parallel_rank_header_naming_no_core_is_a_400(dp_server, value, path):
    body = ({"model": MODEL, "prompt": "hi", "max_tokens": 2} if path == "/completions" else
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = httpx.post(f"{dp_server.base_url}{path}", headers={"X-data-parallel-rank": value}, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "X-data-parallel-rank" in error["message"] and "[0, 2)" in error["message"]
    assert error["code"] == "invalid_data_parallel_rank"


def test_a_dead_core_makes_the_pod_unhealthy_at_once(tmp_path):
    srv = launch(tmp_path, *DEFAULT_ARGS, "--data-parallel-size", "2")
    try:
        pids = core_pids(srv.proc.pid)
        assert len(pids) == 2
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        health = kill_core_and_wait_unhealthy(srv, pids[1])
        assert "data-parallel engine core" in health["error"]["message"]
        # New requests are refused at once, not queued on the dead core or left hanging.
        refused = httpx.post(f"{srv.base_url}/completions", timeout=10,
                             json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert refused.status_code == 503
    finally:
        srv.proc.stop()


def test_requests_go_to_the_core_with_the_fewest_requests_then_the_emptiest_kv_pool():
    seen = []
    client = DPEngineCoreClient(EngineConfig.from_kwargs(model="pagoda-tiny", data_parallel_size=3), on_outputs=lambda *a: seen.append(a),
                                on_refused=None, on_dead=None)

    def report(rank: int, running: int, waiting: int, kv: float) -> None:
        client._on_outputs(rank, EngineCoreOutputs(stats=SchedulerStats(num_running=running, num_waiting=waiting,
                                                                         kv_cache_usage=kv)))

    report(0, running=4, waiting=1, kv=0.1)
    report(1, running=2, waiting=0, kv=0.9)
    report(2, running=1, waiting=0, kv=0.95)
    assert len(seen) == 3  # every core's outputs still reach the engine
    assert client.least_loaded() == 2  # the fewest requests, though its pool is the fullest
    report(2, running=2, waiting=0, kv=0.5)
    assert client.least_loaded() == 2  # as many requests as core 1, and the emptier pool
    report(2, running=3, waiting=0, kv=0.1)
    assert client.least_loaded() == 1
    for rank in range(3):
        report(rank, running=0, waiting=0, kv=0.0)
    assert [client.least_loaded() for _ in range(4)] == [2, 0, 1, 2]  # idle cores take turns


@pytest.mark.parametrize("replies, expected", [
    # Another API process's stop reached core 1 first: this one stopped core 0, and says so.
    ([ProfileReply(paths=["t0"]), ProfileReply(error="the profiler is not running", already=True)], ["t0"]),
    # Nothing was running: refused.
    ([ProfileReply(error="not running", already=True), ProfileReply(error="not running", already=True)],
     "engine core 0: not running"),
    # A core that failed for another reason is never excused.
    ([ProfileReply(paths=["t0"]), ProfileReply(error="cannot write traces to /x")], "engine core 1: cannot write"),
])
def test_a_profile_call_stands_for_the_cores_it_moved_when_another_api_process_moved_the_rest(replies, expected):
    """With two API processes, a /stop_profile through each can reach the two cores in opposite
    orders: each stops one core and finds the other stopped. Both answer 200 with the traces of the
    core they stopped, not 400 (the profile did stop); a call that moved no core is refused."""
    client = DPEngineCoreClient(EngineConfig.from_kwargs(model="pagoda-tiny", data_parallel_size=2), on_outputs=None,
                                on_refused=None, on_dead=None)
    for core, reply in zip(client.cores, replies):
        async def profile(start, tag="", reply=reply):
            return reply
        core.profile = profile
    if isinstance(expected, list):
        assert asyncio.run(client.profile(start=False)) == expected
    else:
        with pytest.raises(ProfilerStateError, match=expected):
            asyncio.run(client.profile(start=False))


def test_expert_parallelism_across_cores_is_accepted_but_not_under_pipeline_parallelism():
    config = EngineConfig.from_kwargs(data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=2)
    assert capabilities.refusal(config, {}) is None
    piped = EngineConfig.from_kwargs(data_parallel_size=2, enable_expert_parallel=True, pipeline_parallel_size=2)
    reason = capabilities.refusal(piped, {})
    assert reason is not None
    assert "expert parallelism across data-parallel engine cores under pipeline parallelism" in reason
    assert "--pipeline-parallel-size 2 with --data-parallel-size 2 with --enable-expert-parallel" in reason


def test_pagoda_serve_with_expert_parallelism_across_pipelined_cores_exits_with_the_reason():
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--host", "127.0.0.1",
                          "--port", str(free_port()), "--model", "pagoda-tiny", "--data-parallel-size", "2",
                          "--enable-expert-parallel", "--pipeline-parallel-size", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "the engine could not start" in out.stderr
    assert "expert parallelism across data-parallel engine cores under pipeline parallelism" in out.stderr


def test_the_offline_llm_points_data_parallelism_to_pagoda_serve():
    with pytest.raises(ValueError, match="pagoda serve --data-parallel-size 2"):
        LLM("pagoda-tiny", data_parallel_size=2)

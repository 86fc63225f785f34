"""Many concurrent streaming clients, some of which go away: every finished stream is complete
and in order, nothing fails with a 5xx, and every page is freed afterwards."""

import asyncio
import json
import os
import socket
import time

import httpx

from conftest import core_pid, scrape

PROMPTS = ["Once upon a time", "The river runs", "In the beginning there was", "A quick test of"]
MAX_TOKENS = 32


async def _stream(client: httpx.AsyncClient, prompt: str, disconnect_after: int | None) -> dict:
    # A client that leaves asks for many tokens, so that it surely leaves before its request ends.
    max_tokens = MAX_TOKENS if disconnect_after is None else 450
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    pieces, usage, finish = [], None, None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        status = resp.status_code
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                pieces.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
            if chunk.get("usage"):
                usage = chunk["usage"]
            if disconnect_after is not None and len(pieces) >= disconnect_after:
                break  # leaving the block closes the connection mid-stream
    return {"status": status, "text": "".join(pieces), "usage": usage, "finish": finish,
            "disconnected": disconnect_after is not None}


async def _run_clients(url: str, references: dict[str, str]) -> list[dict]:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as client:
        jobs = [_stream(client, PROMPTS[i % len(PROMPTS)], disconnect_after=(3 + i % 5) if i % 4 == 0 else None)
                for i in range(64)]
        return await asyncio.gather(*jobs)


def _wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = (m["pagoda:num_requests_running"] == 0 and m["pagoda:num_requests_waiting"] == 0
                and m["pagoda:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_64_streams_with_a_quarter_disconnecting(server):
    references = {}
    for p in PROMPTS:
        r = httpx.post(f"{server.base_url}/completions", timeout=60,
                       json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        references[p] = r.json()["choices"][0]["text"]
    before = scrape(server.url)

    results = asyncio.run(_run_clients(server.url, references))

    assert all(r["status"] == 200 for r in results)
    finished = [r for r in results if not r["disconnected"]]
    assert len(finished) == 48
    for i, r in enumerate(results):
        if r["disconnected"]:
            continue
        assert r["text"] == references[PROMPTS[i % len(PROMPTS)]], f"client {i}: tokens missing or out of order"
        assert r["usage"]["completion_tokens"] == MAX_TOKENS and r["finish"] == "length"

    after = _wait_idle(server.url)
    assert after["pagoda:num_requests_running"] == 0
    assert after["pagoda:num_requests_waiting"] == 0
    assert after["pagoda:kv_cache_usage_perc"] == 0
    aborted = after["pagoda:request_success_total{finished_reason=abort}"] - \
        before["pagoda:request_success_total{finished_reason=abort}"]
    assert aborted == 16
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_non_streaming_client_that_goes_away_is_aborted(server):
    before = scrape(server.url)
    body = json.dumps({"prompt": "Long story", "max_tokens": 480, "temperature": 0, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    clients = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    for c in clients:
        c.sendall(request)
    deadline = time.monotonic() + 30
    while scrape(server.url)["pagoda:num_requests_running"] < 3:  # all three are generating
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for c in clients:
        c.close()  # gone before any response
    after = _wait_idle(server.url)
    assert after["pagoda:kv_cache_usage_perc"] == 0 and after["pagoda:num_requests_running"] == 0
    assert after["pagoda:request_success_total{finished_reason=abort}"] - \
        before["pagoda:request_success_total{finished_reason=abort}"] == 3
    # The aborted requests never ran to their 480 tokens.
    assert after["pagoda:generation_tokens_total"] - before["pagoda:generation_tokens_total"] < 3 * 480


def _cpu_seconds(pid: int) -> float:
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_idle_core_does_not_spin(server):
    core = core_pid(server.proc.pid)
    _wait_idle(server.url)
    before = _cpu_seconds(core)
    time.sleep(3)
    assert _cpu_seconds(core) - before < 0.3, "the idle engine core is busy-waiting"

"""Data-parallel engine cores on two "nodes" of one machine (`dp_nodes`): a leader
(`--data-parallel-size 2 --nnodes 2 --node-rank 0`: the API server and core 0) and a headless node
(`--node-rank 1 --headless`: core 1), separate `pagoda serve` processes on 127.0.0.1 whose cores
meet over TCP. Requests go to both cores and come back as one process's; with a tiny Qwen3-MoE
and --enable-expert-parallel the experts span both nodes' cores, which step in lockstep. Either
side going away fails the other (the leader's /health 503, the node's exit 1), never a hang; a
graceful stop of the leader stops the node with 0."""

from __future__ import annotations

import asyncio
import random
import socket

import httpx
import pytest

from pagoda_e2e import free_port, start_pagoda, until
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.tiny import build_tiny_model
from tests.server.conftest import scrape

PROMPTS = [[5, 6, 7], [(3 * i + 1) % 400 + 5 for i in range(30)], [100 + i for i in range(11)], [42] * 9]
MAX_TOKENS = 10
ARGS = ("--num-kv-pages", "64", "--max-model-len", "256", "--data-parallel-size", "2", "--nnodes", "2",
        "--master-addr", "127.0.0.1")


def free_ports(count: int) -> int:
    """The first of `count` consecutive ports free now (the leader listens on 2 × D + 1 from
    --data-parallel-rpc-port)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, 30000)  # below the ephemeral ports other tests are handed
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports")


class Nodes:
    def __init__(self, tmp_path, model: str, *extra: str, env: dict | None = None):
        self.port = free_port()
        rpc = free_ports(5)
        flags = ["serve", "--model", model, *ARGS, "--master-port", str(free_port()), "--data-parallel-rpc-port",
                 str(rpc), *extra]
        self.leader = start_pagoda([*flags, "--host", "127.0.0.1", "--port", str(self.port)], tmp_path / "leader.log",
                                   env=env)
        self.node = start_pagoda([*flags, "--node-rank", "1", "--headless"], tmp_path / "node.log", env=env)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.leader.stop()
        self.node.stop()


async def _complete(url: str, prompt: list[int]) -> str:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _complete_all(url: str, prompts: list[list[int]]) -> list[str]:
    async def run():
        return await asyncio.gather(*(_complete(url, p) for p in prompts))
    return asyncio.run(run())


def _one_process(model: str) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    with LLM(model, num_kv_pages=64, max_model_len=256) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


def _served_per_core(url: str) -> list[float]:
    m = scrape(url, per_engine=True)
    return [m.get(f"pagoda:request_success_total{{engine={e},finished_reason=length}}", 0.0) for e in ("0", "1")]


@pytest.fixture(scope="module")
def dense_nodes(tmp_path_factory):
    nodes = Nodes(tmp_path_factory.mktemp("dp-nodes"), "pagoda-tiny")
    try:
        nodes.leader.wait_http(f"{nodes.url}/health", timeout=300)
        yield nodes
    finally:
        nodes.stop()


def test_both_nodes_cores_serve_one_process_s_tokens(dense_nodes):
    texts = _complete_all(dense_nodes.url, PROMPTS * 4)
    assert texts == _one_process("pagoda-tiny") * 4
    per_core = _served_per_core(dense_nodes.url)
    assert all(n > 0 for n in per_core) and sum(per_core) == len(PROMPTS) * 4, per_core
    assert "node-rank 1 of 2: starting data-parallel engine cores [1]" in dense_nodes.node.log_text()


def test_the_node_going_away_makes_the_leader_report_dead(dense_nodes):
    dense_nodes.node.kill()
    until(lambda: httpx.get(f"{dense_nodes.url}/health", timeout=5).status_code == 503, 30, "/health 503")
    body = httpx.get(f"{dense_nodes.url}/health", timeout=5).text
    assert "data-parallel engine core 1: the engine core on node-rank 1 disconnected" in body, body


@pytest.mark.parametrize("stop, code", [("kill", 1), ("stop", 0)], ids=["leader-killed", "leader-stopped"])
def test_the_leader_going_away_stops_the_node(tmp_path, stop, code):
    """Killed: the node notices its connection drop, stops its cores, exits 1. Stopped (SIGTERM):
    the leader shuts the node's cores down, and the node exits 0."""
    nodes = Nodes(tmp_path, "pagoda-tiny")
    try:
        nodes.leader.wait_http(f"{nodes.url}/health", timeout=300)
        getattr(nodes.leader, stop)()
        assert nodes.node.popen.wait(60) == code
        if code:
            assert "the leader at 127.0.0.1" in nodes.node.log_text() and "went away" in nodes.node.log_text()
    finally:
        nodes.stop()


def test_a_node_that_never_comes_fails_the_leader_naming_it(tmp_path):
    port = free_port()
    leader = start_pagoda(["serve", "--model", "pagoda-tiny", *ARGS, "--master-port", str(free_port()),
                           "--data-parallel-rpc-port", str(free_ports(5)), "--host", "127.0.0.1", "--port", str(port)],
                          tmp_path / "leader.log", env={"PAGODA_DIST_TIMEOUT_S": "5"})
    try:
        assert leader.popen.wait(120) == 1
        assert "the engine core on node-rank 1 did not connect and report ready within 5 s" in leader.log_text()
    finally:
        leader.stop()


def test_experts_span_both_nodes_cores(tmp_path_factory):
    """A tiny Qwen3-MoE, 4 of its 8 experts on each node's core: lockstep over the nodes, each
    request's greedy tokens as one process's."""
    moe = str(build_tiny_model(tmp_path_factory.mktemp("qwen3-moe") / "model", arch="qwen3_moe", seed=5))
    expected = _one_process(moe)
    nodes = Nodes(tmp_path_factory.mktemp("dp-ep-nodes"), moe, "--enable-expert-parallel", "--max-num-seqs", "16")
    try:
        nodes.leader.wait_http(f"{nodes.url}/health", timeout=300)
        assert _complete_all(nodes.url, PROMPTS) == expected
        assert all(n > 0 for n in _served_per_core(nodes.url))
    finally:
        nodes.stop()

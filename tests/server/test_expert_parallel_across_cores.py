"""`pagoda serve --data-parallel-size 2 --enable-expert-parallel` with a tiny Qwen3-MoE: the
experts span both engine cores (4 each of 8), so the cores step in lockstep, an idle core running
dummy batches while the other works. Greedy tokens equal one process's wherever a request runs,
an idle pod wakes for a new request at once, and a killed core fails the pod (and its sibling)
instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from lockstep_cores import add_greedy, finish, run_lockstep, start_core
from spawned_ranks import run_ranks
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.tiny import build_tiny_model
from tests.server.conftest import core_pids, kill_core_and_wait_unhealthy, launch, scrape
from warm_up_steps import warm_up_step_tokens

MAX_TOKENS = 12
PROMPTS = [[5, 6, 7], [(3 * i + 1) % 400 + 5 for i in range(30)], [100 + i for i in range(11)], [42] * 9]
ARGS = ("--num-kv-pages", "64", "--max-model-len", "256", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3-moe") / "model", arch="qwen3_moe", seed=5)


@pytest.fixture(scope="module")
def one_process_texts(moe_dir) -> list[str]:
    llm = LLM(str(moe_dir), num_kv_pages=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def dp_ep_server(moe_dir, tmp_path_factory):
    srv = launch(tmp_path_factory.mktemp("serve-dp-ep"), "--model", str(moe_dir), *ARGS,
                 "--data-parallel-size", "2", "--enable-expert-parallel")
    yield srv
    srv.proc.stop()


def _served_per_core(url: str) -> list[float]:
    m = scrape(url, per_engine=True)
    return [m.get(f"pagoda:request_success_total{{engine={e},finished_reason=length}}", 0.0) for e in ("0", "1")]


async def _complete(base_url: str, prompt: list[int], rank: int | None = None, max_tokens: int = MAX_TOKENS) -> str:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{base_url}/completions", headers=headers,
                              json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _complete_all(base_url: str, ranks: list[int | None]) -> list[str]:
    async def run():
        return await asyncio.gather(*(_complete(base_url, p, rank) for p, rank in zip(PROMPTS, ranks)))

    return asyncio.run(run())


def _wait_idle(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (m := scrape(url))["pagoda:num_requests_running"] + m["pagoda:num_requests_waiting"] > 0:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def test_concurrent_requests_on_both_cores_give_one_process_greedy_tokens(dp_ep_server, one_process_texts):
    before = _served_per_core(dp_ep_server.url)
    assert _complete_all(dp_ep_server.base_url, [None] * len(PROMPTS)) == one_process_texts
    middle = _served_per_core(dp_ep_server.url)
    # Least-loaded routing used both cores: 2 + 2 when the four arrive together, 3 + 1 when one
    # finished before the last arrived (a loaded CI machine spreads the arrivals).
    first_round = [a - b for a, b in zip(middle, before)]
    assert sum(first_round) == 4 and min(first_round) >= 1, first_round
    # Pinned the other way round: each prompt's tokens do not depend on which core runs it.
    assert _complete_all(dp_ep_server.base_url, [1, 0, 1, 0]) == one_process_texts
    after = _served_per_core(dp_ep_server.url)
    assert [a - b for a, b in zip(after, middle)] == [2, 2]


@pytest.mark.parametrize("busy", [0, 1])
def test_one_core_works_while_the_other_has_nothing(dp_ep_server, one_process_texts, busy):
    """Every request on one core: its MoE layers need the idle core's experts at every step, which
    the idle core provides by running dummy batches (without them the first step would hang)."""
    _wait_idle(dp_ep_server.url)
    before = _served_per_core(dp_ep_server.url)
    assert _complete_all(dp_ep_server.base_url, [busy] * len(PROMPTS)) == one_process_texts
    served = [a - b for a, b in zip(_served_per_core(dp_ep_server.url), before)]
    assert served[busy] == len(PROMPTS) and served[1 - busy] == 0, served


def test_the_experts_load_is_exported_per_layer_and_expert(dp_ep_server, moe_dir):
    """`pagoda:moe_expert_tokens`: the tokens each expert took, per MoE layer, counted by the core
    holding it (read every 5 s while busy, and at rest). Every layer sees the same tokens: at rest
    its experts' counts sum to top-k pairs of each, the same in every layer."""
    import json

    asyncio.run(_complete(dp_ep_server.base_url, PROMPTS[1], 0))
    _wait_idle(dp_ep_server.url)
    deadline = time.monotonic() + 10  # the idle core's read comes with its wave's end, just after
    while True:
        per_layer: dict[int, dict[int, float]] = {}
        for key, value in scrape(dp_ep_server.url).items():
            if key.startswith("pagoda:moe_expert_tokens_total{"):
                labels = dict(part.split("=") for part in key[key.index("{") + 1:-1].split(","))
                per_layer.setdefault(int(labels["layer"]), {})[int(labels["expert"])] = value
        totals = {sum(experts.values()) for experts in per_layer.values()}
        if len(totals) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    config = json.loads((moe_dir / "config.json").read_text())
    assert sorted(per_layer) == list(range(config["num_hidden_layers"]))
    assert all(sorted(experts) == list(range(config["num_local_experts"])) for experts in per_layer.values())
    assert len(totals) == 1, per_layer
    total = totals.pop()
    assert total > 0 and total % config["num_experts_per_tok"] == 0, total


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_pod_does_not_spin_and_wakes_at_once_for_a_new_request(dp_ep_server, one_process_texts):
    """Both cores idle for several agreement periods (they wait for input a second at a time,
    burning next to no CPU), then one request: the other core is woken (StartDPWave) and the
    request is served promptly."""
    _wait_idle(dp_ep_server.url)
    cores = core_pids(dp_ep_server.proc.pid)
    for rank in (0, 1, 0):
        cpu = [_cpu_seconds(pid) for pid in cores]
        time.sleep(2.5)
        spent = [_cpu_seconds(pid) - before for pid, before in zip(cores, cpu)]
        assert max(spent) < 0.5, spent  # a spinning loop would take the whole 2.5 s
        start = time.monotonic()
        assert asyncio.run(_complete(dp_ep_server.base_url, PROMPTS[0], rank)) == one_process_texts[0]
        assert time.monotonic() - start < 20


def test_a_killed_core_fails_the_pod_and_its_sibling_instead_of_hanging(moe_dir, tmp_path):
    srv = launch(tmp_path, "--model", str(moe_dir), *ARGS, "--data-parallel-size", "2", "--enable-expert-parallel")
    try:
        pids = core_pids(srv.proc.pid)
        assert len(pids) == 2
        # A long stream keeps both cores in their collectives (one stepping, one in dummy
        # batches) while one is killed.
        with httpx.stream("POST", f"{srv.base_url}/completions", timeout=60, headers={"X-data-parallel-rank": "0"},
                          json={"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}) as long:
            assert long.status_code == 200
            lines = long.iter_lines()
            next(lines)
            health = kill_core_and_wait_unhealthy(srv, pids[1], timeout=20)
            assert "data-parallel engine core" in health["error"]["message"]
            rest = "\n".join(lines)
            assert '"error"' in rest and "engine" in rest  # the stream ends with the engine's error
        deadline = time.monotonic() + 20
        # The surviving core's next collective fails (gloo sees the closed connection): it exits.
        while any(os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) for pid in pids):
            assert time.monotonic() < deadline, "the surviving core hangs in a collective"
            time.sleep(0.2)
    finally:
        srv.proc.stop()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_two_cores_of_two_tensor_parallel_ranks_give_one_process_greedy_tokens(moe_dir, one_process_texts, tmp_path):
    """TP 2 × DP 2 with EP: four ranks of 2 experts each; the dispatch runs over each TP
    position's DP group and the TP all-reduce sums the rest."""
    srv = launch(tmp_path, "--model", str(moe_dir), *ARGS, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                 "--enable-expert-parallel")
    try:
        assert _complete_all(srv.base_url, [0, 1, 1, 1]) == one_process_texts
    finally:
        srv.proc.stop()


# --- the warm-up of cores in lockstep --------------------------------------------------------------

def _lockstep_core(rank: int, port: int, model_dir: str, num_kv_pages: int, prompt: list[int], results) -> None:
    """One of two engine cores whose experts span both: its start-up warm-up (run by hand: CPU
    engines skip it), then one greedy request of its own served as `CoreLoop.run_lockstep` serves
    (the other core's warm-up may still be going)."""
    core = start_core(rank, port, model=model_dir, num_kv_pages=num_kv_pages, max_model_len=256, max_num_seqs=16)
    step_tokens = warm_up_step_tokens(core)
    left = core.has_unfinished_requests()
    [req] = add_greedy(core, rank, [(prompt, MAX_TOKENS)])
    run_lockstep(core)
    finish(core, results, (rank, step_tokens, left, list(req.output_token_ids)))


def test_cores_in_lockstep_warm_up_together_and_serve_greedy_tokens_after(moe_dir):
    """A GPU engine warms up at start-up (every kernel variant compiled before the first request);
    cores whose experts span each other must do it in lockstep, each step of one paired with a step
    or a dummy batch of the other. Here the two cores' pools differ, so their warm-ups differ (six
    and five prompt sizes): without agreeing on every turn, their forwards fall out of step and
    the request after hangs or computes with the wrong experts' outputs."""

    prompts = [PROMPTS[1], PROMPTS[2]]
    with LLM(str(moe_dir), num_kv_pages=64) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    pools = (64, 32)  # long prompts of 236 and 108 tokens: sizes up to 129 and up to 65
    got = {rank: rest for rank, *rest in run_ranks(
        _lockstep_core, (0, 1), lambda rank: (str(moe_dir), pools[rank], prompts[rank]), timeout=120)}
    for rank, sizes in ((0, {5, 9, 17, 33, 65, 129}), (1, {5, 9, 17, 33, 65})):
        step_tokens, left, tokens = got[rank]
        assert sizes <= set(step_tokens), (rank, step_tokens)  # each size class alone
        assert not left
        assert tokens == list(expected[rank]), rank
    assert 129 not in got[1][0]  # the smaller pool's warm-up stops at its long prompt's length

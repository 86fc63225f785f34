"""Data-parallel padding where MoE experts span the engine cores (`worker/dp_padding.py`): the
agreement's rules, and two real engine cores (gloo, one process each) stepping in lockstep as
`CoreLoop.run_lockstep` does, on CPU, where padded decode steps run eagerly through the same
logic the CUDA graphs replay. Core 0 decodes three requests that finish at different steps
(batches of 3, 2 and 1 rows padded to 4, 2 and 1) while core 1 decodes one short request and then
sits idle, running padded dummy batches; the MoE layers exchange tokens by all-to-all
(`--all2all-backend alltoallv`, two micro-batches overlapped: `--enable-dbo`), or by all-gather with EPLB re-placing the experts (two redundant)
every 4 forwards. Every greedy token equals one process's: neither padding nor the experts'
re-placement changes a token; and the experts' counted load is exactly top-k pairs per token fed,
padding and dummy rows never counted."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lockstep_cores import add_greedy, finish, run_lockstep, start_core
from spawned_ranks import run_ranks
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.config import EngineConfig
from pagoda_engine.tiny import build_tiny_model
from pagoda_engine.worker.dp_padding import common_size, eager_counts
from pagoda_engine.worker.executor import dp_padded_sizes

SIZES = [1, 2, 4, 8]
# (prompt, max_tokens) per core: core 0's three end after 5, 8 and 12 tokens; core 1's after 4.
REQUESTS = {0: [([5, 6, 7], 12), ([(3 * i + 1) % 400 + 5 for i in range(30)], 8), ([100 + i for i in range(11)], 5)],
            1: [([42] * 9, 4)]}


def test_decode_steps_pad_to_the_largest_cores_size_rounded_up():
    assert common_size([(3, True), (1, True)], SIZES) == 4
    assert common_size([(3, True), (0, True)], SIZES) == 4  # an idle core joins the padded decode
    assert common_size([(0, True), (0, True)], SIZES) == 1
    assert common_size([(8, True), (2, True)], SIZES) == 8


def test_a_prefill_anywhere_or_a_batch_past_the_graphs_runs_every_core_eagerly():
    assert common_size([(3, True), (17, False)], SIZES) is None
    assert common_size([(9, True), (1, True)], SIZES) is None
    assert common_size([(3, True), (1, True)], []) is None  # no padded sizes: never padded
    assert eager_counts([(17, False), (0, True)]) == [17, 1]  # the idle core's one dummy token


def test_padding_follows_the_decode_graphs_and_enforce_eager_turns_it_off():
    config = EngineConfig.from_kwargs(model="pagoda-tiny", max_num_seqs=24, data_parallel_size=2,
                                      enable_expert_parallel=True)
    assert dp_padded_sizes(config) == (1, 2, 4, 8, 16, 24)
    eager = dataclasses.replace(config, model=dataclasses.replace(config.model, enforce_eager=True))
    assert dp_padded_sizes(eager) == ()


def test_the_dispatch_flags_are_refused_where_they_would_do_nothing():
    across = dict(model="pagoda-tiny", data_parallel_size=2, enable_expert_parallel=True)
    for kwargs, why in [(dict(model="pagoda-tiny", all2all_backend="alltoallv"), "--all2all-backend .* needs"),
                        (dict(across, enable_dbo=True), "--enable-dbo .* needs --all2all-backend alltoallv"),
                        (dict(across, enable_eplb=True, tensor_parallel_size=2), "--enable-eplb .* --tensor-parallel"),
                        (dict(model="pagoda-tiny", enable_eplb=True), "--enable-eplb .* needs"),
                        (dict(across, eplb_config={"num_redundant_experts": 2}), "--eplb-config .* needs --enable-eplb")]:
        with pytest.raises(ValueError, match=why):
            EngineConfig.from_kwargs(**kwargs)
    EngineConfig.from_kwargs(**across, all2all_backend="alltoallv", enable_dbo=True, enable_eplb=True,
                             eplb_config={"num_redundant_experts": 2})


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen3-moe") / "model", arch="qwen3_moe", seed=5)


EPLB = {"num_redundant_experts": 2, "window_size": 3, "step_interval": 4}


def _core(rank: int, port: int, model_dir: str, backend: str, eplb: dict | None, results) -> None:
    core = start_core(rank, port, model=model_dir, num_kv_pages=64, max_model_len=256, max_num_seqs=8,
                      all2all_backend=backend, enable_eplb=eplb is not None, eplb_config=eplb,
                      enable_dbo=backend == "alltoallv")
    requests = add_greedy(core, rank, REQUESTS[rank])
    run_lockstep(core)
    worker = core.executor.worker
    agreement = worker.dp_padding
    core._expert_load_read_at = 0.0  # due now
    rebalances = worker.balancer.rebalances if worker.balancer is not None else 0
    finish(core, results, (rank, [list(r.output_token_ids) for r in requests], agreement.sizes,
                           agreement.padded_forwards, agreement.eager_forwards, core.get_stats().expert_load,
                           rebalances))


@pytest.mark.parametrize("backend, eplb", [("alltoallv", None), ("allgather_reducescatter", EPLB)],
                         ids=["alltoallv", "allgather-eplb"])
def test_padding_and_idle_dummy_batches_never_change_a_token(moe_dir, backend, eplb):
    with LLM(str(moe_dir), num_kv_pages=64) as llm:
        expected = {rank: [list(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                                [0].outputs[0].token_ids) for prompt, n in reqs] for rank, reqs in REQUESTS.items()}
    got = {rank: rest for rank, *rest in run_ranks(_core, (0, 1), lambda rank: (str(moe_dir), backend, eplb))}
    for rank in (0, 1):
        tokens, sizes, padded, eager, _, _ = got[rank]
        assert tokens == expected[rank], rank
        assert sizes == SIZES
        # Prefills run eagerly at each core's own count; the 11 decode steps after core 0's
        # prefill (its longest request's 12 tokens) ran padded on both cores, the idle one too.
        assert padded >= 11 and eager >= 1, (rank, padded, eager)
    assert got[0][2:4] == got[1][2:4]  # one agreement, the same on both cores
    # Each core counts the experts it holds: together, top-k pairs per token fed to the model
    # (a prompt, then every output token but the last), in every MoE layer.
    top_k = json.loads((moe_dir / "config.json").read_text())["num_experts_per_tok"]
    fed = sum(len(prompt) + n - 1 for reqs in REQUESTS.values() for prompt, n in reqs)
    loads = [got[rank][4] for rank in (0, 1)]
    assert len(loads[0]) == len(loads[1]) > 0
    for layer in zip(*loads):
        assert sum(sum(counts) for counts in layer) == top_k * fed
    if eplb is not None:  # 20 forwards or so: re-placed every 4
        assert got[0][5] == got[1][5] >= 3

"""Expert-parallel load balancing (`--enable-eplb`): the placement arithmetic and the config's
checks, and two real gloo ranks (data-parallel cores of one rank each) with a router skewed on
purpose, so that every token picks experts 2 and 3, both on rank 0 as the experts start: after
one rebalance from the measured counts the hot experts have copies on both ranks, the ranks'
counted load is even where it was all on rank 0, and the layer's output is still the whole
layer's (through the all-gather and the all-to-all alike), before and after."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import run_ranks
from test_fused_moe import BLOCKS, EXPERTS, HIDDEN, INTER, TOP_K, _hub_checkpoint, _load

from pagoda_engine import eplb
from pagoda_engine.worker.eplb import ExpertBalancer, ExpertLoad, moe_layers
from pagoda_engine.worker.model.layers import TPGroup
from pagoda_engine.worker.model.moe import DataParallelDispatch, FusedMoE, attach_dp_dispatch

ARCH = "qwen3_moe"
HOT = (2, 3)
REDUNDANT = 2  # 10 slots, 5 per rank
TOKENS = (6, 4)


def test_the_busiest_experts_get_the_copies_and_the_ranks_even_out():
    load = [0, 0, 50, 50, 0, 0, 0, 0]
    assert eplb.replicate(load, 10) == [1, 1, 2, 2, 1, 1, 1, 1]
    placement = eplb.rebalance(load, 10, 2)
    assert sorted(placement) == sorted([0, 1, 2, 2, 3, 3, 4, 5, 6, 7])
    assert set(placement[:5]) >= {2, 3} and set(placement[5:]) >= {2, 3}  # a copy of each hot one on each rank
    assert eplb.rank_loads(load, placement, 2) == [50, 50]
    assert eplb.balancedness(eplb.rank_loads(load, eplb.default_placement(8, 10), 2)) == 0.5
    assert eplb.default_placement(8, 10) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_the_config_takes_vllms_keys_and_refuses_the_rest():
    assert eplb.parse_eplb_config('{"num_redundant_experts": 16, "window_size": 10, "step_interval": 20}') == \
        eplb.EPLBConfig(window_size=10, step_interval=20, num_redundant_experts=16)
    assert eplb.parse_eplb_config(None) == eplb.EPLBConfig()
    for bad, why in [('{"policy": "x"}', "not implemented"), ('{"windows": 1}', "unknown key 'windows'"),
                     ('{"step_interval": 0}', "step_interval must be a whole number >= 1"),
                     ('{"window_size": 5, "step_interval": 4}', "cannot exceed step_interval"),
                     ('{"log_balancedness": 1}', "true or false"), ("[1]", "JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(eplb.InvalidEPLBConfigError, match=why):
            eplb.parse_eplb_config(bad)


def _checkpoint() -> dict[str, torch.Tensor]:
    block, names, _ = BLOCKS[ARCH]()
    ckpt = _hub_checkpoint(block, names)
    for expert in HOT:
        ckpt["mlp.gate.weight"][expert] += 50.0
    return ckpt


def _tokens(core: int) -> torch.Tensor:
    return torch.rand(TOKENS[core], HIDDEN, generator=torch.Generator().manual_seed(core)) + 0.1


def _rank(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    group = TPGroup(dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60)), rank, 2)
    _, _, kwargs = BLOCKS[ARCH]()
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, expert_parallel=True, data_parallel=(2, rank), **kwargs)
    _load(moe, _checkpoint())
    dispatch = DataParallelDispatch(group, group)
    attach_dp_dispatch(moe, dispatch)
    layers = moe_layers(moe)
    load = ExpertLoad(layers)
    balancer = ExpertBalancer.setup(layers, load, group, eplb.EPLBConfig(num_redundant_experts=REDUNDANT))
    x = _tokens(rank)

    def forward(backend: str) -> list:
        dispatch.backend = backend
        with torch.no_grad():
            dispatch.begin_forward(x.shape[0])
            return moe(x).tolist()

    def slot_load() -> int:
        return int(moe.load[:-1].sum())

    outs = {"before": {b: forward(b) for b in ("allgather_reducescatter", "alltoallv")}}
    placement_before, load_before = list(moe.expert_map.placement), slot_load()
    balancer.rebalance()
    counted = load.read()[0]
    outs["after"] = {b: forward(b) for b in ("allgather_reducescatter", "alltoallv")}
    results.put((rank, outs, placement_before, list(moe.expert_map.placement), load_before, slot_load(), counted,
                 moe.experts.w13.shape[0]))
    results.close()
    results.join_thread()


def test_a_skewed_router_spreads_over_the_copies_and_keeps_the_output():
    got = {rank: rest for rank, *rest in run_ranks(_rank, (0, 1), lambda rank: ())}
    _, _, kwargs = BLOCKS[ARCH]()
    whole = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, **kwargs)
    _load(whole, _checkpoint())
    pairs = TOP_K * sum(TOKENS)
    for rank in (0, 1):
        outs, before, after, load_before, load_after, counted, slots = got[rank]
        assert before == eplb.default_placement(EXPERTS, EXPERTS + REDUNDANT) and slots == 5
        with torch.no_grad():
            expected = whole(_tokens(rank))
        for phase in ("before", "after"):
            for backend, out in outs[phase].items():
                torch.testing.assert_close(torch.tensor(out), expected, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {rank} {phase} {backend}: {m}")
    assert got[0][2] == got[1][2]  # both ranks computed the same placement
    after = got[0][2]
    assert set(after[:5]) >= set(HOT) and set(after[5:]) >= set(HOT)
    # Before: every pair (two backends' forwards) on rank 0, which held both hot experts; after,
    # half on each rank.
    assert (got[0][3], got[1][3]) == (2 * pairs, 0)
    assert got[0][4] == got[1][4] == pairs
    # The counted load per logical expert survived the re-placement: all on the hot ones.
    assert [c for e, c in enumerate(got[0][5]) if e not in HOT] == [0] * (EXPERTS - 2)
    assert sum(got[0][5]) == 2 * pairs

"""Expert parallelism across data-parallel cores by all-to-all (`--all2all-backend alltoallv`):
real gloo processes, one per rank, each core with its own batch (of different sizes, one of them
empty). On the same weights, each core's layer output through the all-to-all equals the one
through the all-gather / reduce-scatter and the whole layer's in one process (float32), with
one micro-batch and with two overlapped (`--enable-dbo`), for 2
cores, 4 cores, and 2 cores of 2 tensor-parallel ranks (where a rank sends only the pairs of its
TP position's experts); and with a router skewed so that every token picks experts of core 0, the
other ranks receive nothing and the output is still the whole layer's."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from spawned_ranks import run_ranks
from test_fused_moe import BLOCKS, EXPERTS, HIDDEN, INTER, TOP_K, _hub_checkpoint, _load

from pagoda_engine.worker.model.layers import TPGroup, attach_tp_group
from pagoda_engine.worker.model.moe import DataParallelDispatch, FusedMoE, attach_dp_dispatch

ARCH = "qwen2_moe"  # routed experts and the shared one
TOKENS = (3, 0, 7, 2)  # per core: the largest sets the all-gather's padding; one core has none


def _checkpoint(skewed: bool) -> dict[str, torch.Tensor]:
    block, names, _ = BLOCKS[ARCH]()
    ckpt = _hub_checkpoint(block, names)
    if skewed:  # experts 0 and 1 (core 0's) win every token's top 2
        gate = ckpt["mlp.gate.weight"]
        gate[:2] += 50.0 * torch.sign(torch.ones(HIDDEN))
    return ckpt


def _tokens(core: int) -> torch.Tensor:
    # Positive features, so that the skewed router's bias always wins.
    return torch.rand(TOKENS[core], HIDDEN, generator=torch.Generator().manual_seed(core)) + 0.1


def _group(store, name: str, members: list[int], rank: int) -> TPGroup:
    prefixed = dist.PrefixStore(f"{name}/{members[0]}", store)
    backend = dist.ProcessGroupGloo(prefixed, members.index(rank), len(members), datetime.timedelta(seconds=60))
    return TPGroup(backend, members.index(rank), len(members), tuple(members))


def _rank(rank: int, port: int, dp: int, tp: int, skewed: bool, results) -> None:
    """Rank `rank` of dp cores × tp ranks: its experts, its core's tokens, both exchanges."""
    torch.set_num_threads(1)
    core, tp_rank = divmod(rank, tp)
    store = dist.TCPStore("127.0.0.1", port, dp * tp, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dp_group = _group(store, "dp", [d * tp + tp_rank for d in range(dp)], rank)
    _, _, kwargs = BLOCKS[ARCH]()
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, tp_size=tp, tp_rank=tp_rank, expert_parallel=True,
                   data_parallel=(dp, core), **kwargs)
    _load(moe, _checkpoint(skewed))
    if tp > 1:
        attach_tp_group(moe, _group(store, "tp", [core * tp + t for t in range(tp)], rank))
    x = _tokens(core)
    outs = {}
    for backend, microbatches in (("allgather_reducescatter", 1), ("alltoallv", 1), ("alltoallv", 2)):
        dispatch = DataParallelDispatch(dp_group, dp_group, backend, microbatches=microbatches)
        attach_dp_dispatch(moe, dispatch)
        with torch.no_grad():
            dispatch.begin_forward(x.shape[0])
            outs[f"{backend} ×{microbatches}"] = moe(x).tolist()  # plain numbers cross the queue (see test_fused_moe)
    results.put((rank, outs))
    results.close()
    results.join_thread()


def _run(dp: int, tp: int, skewed: bool = False) -> dict[int, dict[str, list]]:
    return dict(run_ranks(_rank, range(dp * tp), lambda rank: (dp, tp, skewed)))


def _whole(skewed: bool) -> FusedMoE:
    _, _, kwargs = BLOCKS[ARCH]()
    whole = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, **kwargs)
    _load(whole, _checkpoint(skewed))
    return whole


@pytest.mark.parametrize("dp,tp", [(2, 1), (4, 1), (2, 2)], ids=["dp2", "dp4", "dp2-tp2"])
def test_all_to_all_gives_the_gathers_and_one_process_output(dp, tp):
    got = _run(dp, tp)
    whole = _whole(skewed=False)
    for rank, outs in got.items():
        core = rank // tp
        with torch.no_grad():
            expected = whole(_tokens(core))
        assert expected.shape[0] == TOKENS[core]
        for backend, out in outs.items():
            torch.testing.assert_close(torch.tensor(out).reshape(expected.shape), expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"core {core} rank {rank} {backend}: {m}")


def test_a_router_skewed_to_one_core_sends_the_others_nothing_and_keeps_the_output():
    whole = _whole(skewed=True)
    with torch.no_grad():
        _, ids = torch.topk(whole.gate(_tokens(2)), TOP_K)
    assert set(ids.flatten().tolist()) == {0, 1}  # the skew holds: every pair is core 0's
    got = _run(2, 1, skewed=True)
    for rank, outs in got.items():
        with torch.no_grad():
            expected = whole(_tokens(rank))
        for out in outs.values():
            torch.testing.assert_close(torch.tensor(out).reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)

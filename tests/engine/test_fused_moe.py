"""FusedMoE against transformers' sparse MoE blocks (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE with and without norm_topk_prob), on the same random weights, loaded through the
per-expert checkpoint names the Hub uses; its tensor-parallel shards summing to the whole; and
expert parallelism across two data-parallel cores (two gloo processes with different batches),
each core getting the whole layer's output for its own tokens."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from pagoda_engine.worker.model.layers import TPGroup
from pagoda_engine.worker.model.moe import (DataParallelDispatch, FusedMoE, attach_dp_dispatch,
                                            expert_checkpoint_piece, select_experts)

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 2


def _mixtral():
    cfg = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return MixtralSparseMoeBlock(cfg), ("w1", "w3", "w2"), dict(renormalize=True)


def _qwen2_moe():
    cfg = Qwen2MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         shared_expert_intermediate_size=40, norm_topk_prob=False)
    return (Qwen2MoeSparseMoeBlock(cfg), ("gate_proj", "up_proj", "down_proj"),
            dict(renormalize=False, shared_expert_intermediate_size=40))


def _qwen3_moe(norm: bool):
    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         norm_topk_prob=norm)
    return Qwen3MoeSparseMoeBlock(cfg), ("gate_proj", "up_proj", "down_proj"), dict(renormalize=norm)


BLOCKS = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe,
          "qwen3_moe": lambda: _qwen3_moe(True), "qwen3_moe_unnormalised": lambda: _qwen3_moe(False)}


def _hub_checkpoint(block, names) -> dict[str, torch.Tensor]:
    """The block's weights under the Hub's names: one tensor per expert and projection."""
    torch.manual_seed(0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    gate, up, down = names
    ckpt = {"mlp.gate.weight": block.gate.weight.detach().clone()}
    for e in range(EXPERTS):
        w_gate, w_up = block.experts.gate_up_proj[e].detach().chunk(2, dim=0)
        ckpt[f"mlp.experts.{e}.{gate}.weight"] = w_gate.clone()
        ckpt[f"mlp.experts.{e}.{up}.weight"] = w_up.clone()
        ckpt[f"mlp.experts.{e}.{down}.weight"] = block.experts.down_proj[e].detach().clone()
    shared = getattr(block, "shared_expert", None)
    if shared is not None:
        ckpt["mlp.shared_expert.gate_up_proj.weight"] = torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach()
        ckpt["mlp.shared_expert.down_proj.weight"] = shared.down_proj.weight.detach().clone()
        ckpt["mlp.shared_expert_gate.weight"] = block.shared_expert_gate.weight.detach().clone()
    return ckpt


def _load(moe: FusedMoE, ckpt: dict[str, torch.Tensor]) -> None:
    """Fill `moe` (standing at `mlp`) the way the loader does: each tensor through its parameter's
    weight_loader, per-expert tensors onto the stacked parameters."""
    params = {f"mlp.{name}": p for name, p in moe.named_parameters()}
    filled = set()
    local = range(moe.experts.first, moe.experts.first + moe.experts.num_local)
    with torch.no_grad():
        for name, tensor in ckpt.items():
            piece = expert_checkpoint_piece(name)
            if piece is not None:
                param_name, shard = piece
            elif name.endswith("gate_up_proj.weight"):  # the shared expert's merged projection, in two pieces
                param = params[name]
                half = tensor.shape[0] // 2
                for i in (0, 1):
                    param.weight_loader(param, tensor[i * half:(i + 1) * half], i)
                    filled.add((name, i))
                continue
            else:
                param_name, shard = name, None
            params[param_name].weight_loader(params[param_name], tensor, shard)
            if piece is None or shard[0] in local:  # the loader hands every rank every expert
                filled.add((param_name, shard))
    expected = {(name, s) for name, p in params.items() for s in p.shard_ids}
    assert filled == expected


@pytest.mark.parametrize("arch", sorted(BLOCKS))
def test_fused_moe_matches_transformers_block(arch):
    block, names, kwargs = BLOCKS[arch]()
    ckpt = _hub_checkpoint(block, names)
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, **kwargs)
    _load(moe, ckpt)
    x = torch.randn(1, 13, HIDDEN)
    with torch.no_grad():
        expected = block(x)
        if isinstance(expected, tuple):
            expected = expected[0]
        got = moe(x[0])
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


class _SumAcrossShards:
    """Stands in for the all-reduce when both shards run in this one process: the test adds the
    shards' partial outputs itself (the multi-process TP tests cover the real collective)."""

    def all_reduce(self, x):
        return x


def _whole_and_two_ranks(arch: str, expert_parallel: bool) -> tuple[FusedMoE, list[FusedMoE]]:
    """The unsharded layer and its two ranks, all loaded from the same Hub-format checkpoint."""
    block, names, kwargs = BLOCKS[arch]()
    ckpt = _hub_checkpoint(block, names)
    whole = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, **kwargs)
    _load(whole, ckpt)
    ranks = []
    for rank in (0, 1):
        moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, tp_size=2, tp_rank=rank, expert_parallel=expert_parallel, **kwargs)
        _load(moe, ckpt)
        moe.tp_group = _SumAcrossShards()
        ranks.append(moe)
    return whole, ranks


def _assert_ranks_sum_to_the_whole(whole: FusedMoE, ranks: list[FusedMoE]) -> None:
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_tensor_parallel_shards_sum_to_the_whole(arch):
    whole, shards = _whole_and_two_ranks(arch, expert_parallel=False)
    assert shards[0].experts.w13.shape == (EXPERTS, INTER, HIDDEN)  # half of each expert's 2 × INTER rows
    _assert_ranks_sum_to_the_whole(whole, shards)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_expert_parallel_ranks_sum_to_the_whole(arch):
    """Each of two ranks holds half the experts, whole; their outputs sum to the unsharded layer."""
    whole, ranks = _whole_and_two_ranks(arch, expert_parallel=True)
    assert ranks[1].experts.w13.shape == (EXPERTS // 2, 2 * INTER, HIDDEN)
    torch.testing.assert_close(ranks[1].experts.w2[0], whole.experts.w2[EXPERTS // 2])
    _assert_ranks_sum_to_the_whole(whole, ranks)


CORE_TOKENS = (3, 7)  # the two cores' batches differ: the dispatch pads to the larger


def _core_of_two(rank: int, port: int, arch: str, results) -> None:
    """Data-parallel core `rank` of two: half the experts, its own tokens, the real gloo collectives."""
    torch.set_num_threads(1)
    block, names, kwargs = BLOCKS[arch]()
    ckpt = _hub_checkpoint(block, names)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    group = TPGroup(dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60)), rank, 2)
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, expert_parallel=True, data_parallel=(2, rank), **kwargs)
    _load(moe, ckpt)
    attach_dp_dispatch(moe, DataParallelDispatch(group, group))
    x = torch.randn(CORE_TOKENS[rank], HIDDEN, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        moe.dp_dispatch.begin_forward(x.shape[0])
        out = moe(x)
    # Plain numbers, not the tensor: a tensor crosses the queue as shared memory that the parent
    # fetches from this process, which may have exited by then (FileNotFoundError in
    # multiprocessing's resource_sharer). float32 -> Python float -> float32 is exact.
    results.put((rank, moe.experts.first, out.tolist()))
    results.close()
    results.join_thread()  # the result has left this process


@pytest.mark.parametrize("arch", ["qwen2_moe"])  # routed experts and the shared one
def test_expert_parallel_across_two_cores_gives_each_core_the_whole_layers_output(arch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_core_of_two, args=(rank, port, arch, results)) for rank in (0, 1)]
    for p in procs:
        p.start()
    got = dict((rank, (first, out)) for rank, first, out in (results.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    block, names, kwargs = BLOCKS[arch]()
    whole = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, **kwargs)
    _load(whole, _hub_checkpoint(block, names))
    assert [got[rank][0] for rank in (0, 1)] == [0, EXPERTS // 2]  # each core holds half the experts
    for rank in (0, 1):
        x = torch.randn(CORE_TOKENS[rank], HIDDEN, generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            torch.testing.assert_close(torch.tensor(got[rank][1]), whole(x), rtol=1e-5, atol=1e-5)


def test_select_experts_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.softmax(logits, -1)[:, :2])
    w_norm, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w_norm.sum(-1), torch.ones(1))


def test_checkpoint_names_map_to_stacked_pieces():
    assert expert_checkpoint_piece("model.layers.3.block_sparse_moe.experts.7.w3.weight") == (
        "model.layers.3.block_sparse_moe.experts.w13", (7, 1))
    assert expert_checkpoint_piece("model.layers.0.mlp.experts.12.down_proj.weight") == ("model.layers.0.mlp.experts.w2", (12, None))
    assert expert_checkpoint_piece("model.layers.0.mlp.shared_expert.gate_proj.weight") is None
    assert expert_checkpoint_piece("model.layers.0.mlp.experts.1.bias") is None


def test_top_k_outside_the_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(4, 5, HIDDEN, INTER, renormalize=True)

"""The Triton fused-MoE experts against the exact CPU loop, at Qwen3-30B-A3B's layer shapes
(hidden 2048, 128 experts of intermediate 768, 8 per token) and Mixtral-like ones, bf16; and its
alignment step under a CUDA graph (routing changes between replays, shapes do not)."""

from __future__ import annotations

import pytest
import torch

from gpu_support import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

SHAPES = {  # (hidden, intermediate, experts, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-like": (1024, 3584, 8, 2),
}


def _weights(hidden, inter, experts, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g).mul_(hidden ** -0.5).bfloat16()
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=g).mul_(inter ** -0.5).bfloat16()
    return w13, w2


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 5, 64, 300, 2048, 6000])
def test_triton_experts_match_the_reference_loop(shape, num_tokens):
    from pagoda_engine.worker.model.fused_moe_triton import fused_experts
    from pagoda_engine.worker.model.moe import fused_experts_reference, select_experts

    hidden, inter, experts, top_k = SHAPES[shape]
    w13, w2 = _weights(hidden, inter, experts)
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    weights, ids = select_experts(torch.randn(num_tokens, experts, device="cuda").bfloat16(), top_k, True)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
    got = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("inter", [768, 712])
@pytest.mark.parametrize("num_tokens", [5, 64, 300, 2048, 6000])
def test_gate_up_gemm_with_the_silu_equals_the_separate_kernels(inter, num_tokens):
    """The gate+up grouped GEMM that applies SiLU-and-mul itself gives the activation the plain
    GEMM and FlashInfer's SiLU-and-mul give: each product rounded to bf16, then silu(gate) × up
    in float32, rounded once. At most one bf16 step apart (the exponential's last float32 bit may
    differ), and at few places. One pair goes to an expert another rank holds: zeros."""
    from pagoda_engine.worker.model import fused_moe_triton as kernels
    from pagoda_engine.worker.model.moe import select_experts

    hidden, experts, top_k = 2048, 32, 8
    w13, _ = _weights(hidden, inter, experts)
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    _, ids = select_experts(torch.randn(num_tokens, experts, device="cuda").bfloat16(), top_k, True)
    ids[0, 0] = experts
    cfg = kernels._configs(num_tokens)[0]
    aligned = kernels.align_by_expert(ids, experts + 1, cfg["BLOCK_M"])
    pairs = num_tokens * top_k
    gate_up = torch.empty(pairs, 2 * inter, dtype=torch.bfloat16, device="cuda")
    kernels._grouped_gemm(x, w13, gate_up, None, aligned, top_k, pairs, cfg)
    expected = kernels._SILU_AND_MUL(gate_up)
    act = torch.full((pairs, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels._grouped_gemm(x, w13, act, None, aligned, top_k, pairs, cfg, silu_and_mul=True)
    assert torch.equal(act[0], torch.zeros_like(act[0]))
    torch.testing.assert_close(act.float(), expected.float(), rtol=2 ** -7, atol=1e-5)
    assert (act != expected).float().mean() < 0.01


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_matrix_vector_experts_on_uneven_shapes_and_remote_experts(num_tokens):
    """The one-to-four-token kernels where neither K divides their tiles, with one slot routed to an
    expert another rank holds (id = the local count): its share is left out."""
    from pagoda_engine.worker.model.fused_moe_triton import GEMV_MAX_TOKENS, fused_experts
    from pagoda_engine.worker.model.moe import fused_experts_reference

    assert num_tokens <= GEMV_MAX_TOKENS
    hidden, inter, experts, top_k = 1032, 712, 16, 4
    w13, w2 = _weights(hidden, inter, experts)
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    ids = torch.stack([torch.randperm(experts, device="cuda")[:top_k] for _ in range(num_tokens)])
    ids[0, 1] = experts
    weights = torch.softmax(torch.randn(num_tokens, top_k, device="cuda"), dim=-1).bfloat16()
    local = ids < experts
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), (weights * local).float(),
                                       torch.where(local, ids, 0))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids).float(), expected, rtol=2e-2, atol=2e-2)


def test_fused_experts_replay_in_a_cuda_graph_with_new_routing():
    from pagoda_engine.worker.model.fused_moe_triton import fused_experts
    from pagoda_engine.worker.model.moe import fused_experts_reference, select_experts

    hidden, inter, experts, top_k = SHAPES["qwen3-30b-a3b"]
    w13, w2 = _weights(hidden, inter, experts)
    x = torch.randn(16, hidden, device="cuda").bfloat16()
    logits = torch.randn(16, experts, device="cuda").bfloat16()
    fused_experts(x, w13, w2, *select_experts(logits, top_k, True))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, *select_experts(logits, top_k, True))
    for seed in range(3):
        torch.manual_seed(seed)
        logits.copy_(torch.randn_like(logits))
        x.copy_(torch.randn_like(x))
        graph.replay()
        weights, ids = select_experts(logits, top_k, True)
        expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), ids)
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 2, 200])
def test_triton_experts_skip_the_experts_another_rank_holds(num_tokens):
    """Expert parallelism: ids in this rank's numbering, E_local for pairs routed elsewhere; the
    pairs this rank holds match the reference loop over the same local experts (one and two
    tokens take the matrix-vector kernels)."""
    from pagoda_engine.worker.model.fused_moe_triton import fused_experts
    from pagoda_engine.worker.model.moe import fused_experts_reference, select_experts

    hidden, inter, experts, top_k = SHAPES["qwen3-30b-a3b"]
    w13, w2 = _weights(hidden, inter, experts // 4)  # this rank: experts 32..63 of 128
    x = torch.randn(num_tokens, hidden, device="cuda").bfloat16()
    weights, ids = select_experts(torch.randn(num_tokens, experts, device="cuda").bfloat16(), top_k, True)
    local = ids - 32
    local = local.masked_fill((local < 0) | (local >= 32), 32)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights.float(), local)
    got = fused_experts(x, w13, w2, weights, local)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("num_tokens,top_k,experts,block_m", [
    (1, 8, 129, 16), (64, 8, 129, 16), (200, 8, 65, 32), (512, 8, 129, 64), (2048, 2, 9, 128),
    (513, 8, 129, 64), (3000, 8, 33, 64), (16384, 8, 129, 128)])
def test_alignment_matches_the_torch_one(num_tokens, top_k, experts, block_m):
    """Same padded length, same expert per block, same pairs in each expert's run (their order
    inside a run is free: each pair's row is computed on its own); padding holds the sentinel.
    Up to 4,096 pairs one launch of a program per expert (whatever the tile), past it the grid of
    programs."""
    from pagoda_engine.worker.model.fused_moe_triton import align_by_expert, align_by_expert_reference

    ids = torch.randint(0, experts, (num_tokens, top_k), device="cuda")
    pairs, block_experts, padded = align_by_expert(ids, experts, block_m)
    ref_pairs, ref_block_experts, ref_padded = align_by_expert_reference(ids, experts, block_m)
    n = int(ref_padded)
    assert int(padded) == n
    assert torch.equal(block_experts[: n // block_m], ref_block_experts[: n // block_m])
    experts_of_blocks = ref_block_experts[: n // block_m].repeat_interleave(block_m)
    for expert in experts_of_blocks.unique().tolist():
        run = experts_of_blocks == expert
        assert torch.equal(pairs[:n][run].sort().values, ref_pairs[:n][run].sort().values)


@pytest.mark.parametrize("experts,top_k,renormalize", [(128, 8, True), (60, 4, False), (8, 2, True)])
def test_one_launch_routing_matches_the_torch_one(experts, top_k, renormalize):
    from pagoda_engine.worker.model.moe import select_experts, select_experts_reference

    # Distinct logits in every row (exact in bf16), so the top k has no ties to break either way.
    logits = (torch.stack([torch.randperm(experts) for _ in range(333)]).float() / 8).cuda().bfloat16()
    weights, ids = select_experts(logits, top_k, renormalize)
    ref_weights, ref_ids = select_experts_reference(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights)


def test_the_dispatch_across_cores_runs_its_nccl_collectives_around_the_triton_experts():
    """One GPU, so a DP group of one (NCCL all-gather and reduce-scatter, gloo counts): the
    dispatch path of `FusedMoE` (padding mask, local expert ids, the collectives' list forms on
    NCCL) gives the layer's own output; the two-core exchange itself is tests/gpu/test_multi_gpu.py's."""
    import datetime
    import socket

    import torch.distributed as dist

    from pagoda_engine.worker.model.layers import TPGroup
    from pagoda_engine.worker.model.moe import DataParallelDispatch, FusedMoE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
    nccl = TPGroup(dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), 0, 1), 0, 1)
    gloo = TPGroup(dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), 0, 1, datetime.timedelta(seconds=30)), 0, 1)
    hidden, inter, experts, top_k = SHAPES["qwen3-30b-a3b"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = FusedMoE(experts, top_k, hidden, inter, renormalize=True, expert_parallel=True).bfloat16()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=hidden ** -0.5)
    x = torch.randn(37, hidden, device="cuda").bfloat16()
    with torch.inference_mode():
        expected = moe(x)
        moe.across_cores, moe.dp_dispatch = True, DataParallelDispatch(nccl, gloo)
        moe.dp_dispatch.begin_forward(x.shape[0])
        got = moe(x)
    torch.testing.assert_close(got, expected)

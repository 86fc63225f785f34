"""The fused rotary + K/V-write kernel (`attention/rope_kv_triton.py`) on the GPU in bf16: at
Llama-3.1-8B's shapes against its torch reference and FlashInfer's rotary kernel (which it
replaces); at Qwen3-30B-A3B's, with the per-head q/k norms fused in, against its reference and
against the separate kernels it replaces (FlashInfer's RMSNorm, then the rotary + write); eagerly
and replayed from a CUDA graph with new positions and slots."""

from __future__ import annotations

import pytest
import torch
from gpu_support import CUDA, LLAMA_SIZED_CONFIG, requires_gpu
from pagoda_engine.worker.model.layers import RMSNorm, RotaryEmbedding

pytestmark = [pytest.mark.gpu, requires_gpu]

HQ, HKV, D = LLAMA_SIZED_CONFIG["num_attention_heads"], LLAMA_SIZED_CONFIG["num_key_value_heads"], 128
PAGE, NUM_PAGES, MAX_POS = 16, 2048, 8192


def llama_rotary() -> RotaryEmbedding:
    return RotaryEmbedding(D, MAX_POS, LLAMA_SIZED_CONFIG["rope_theta"], LLAMA_SIZED_CONFIG["rope_scaling"]).to(CUDA)


# Qwen3-30B-A3B's attention: 32 query heads over 4 KV heads of 128, q/k norms with eps 1e-6.
QWEN3_MOE_HQ, QWEN3_MOE_HKV, QWEN3_EPS = 32, 4, 1e-6


def inputs(num_tokens: int, seed: int, fused: bool = True, heads: tuple[int, int] = (HQ, HKV)):
    hq, hkv = heads
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    if fused:  # slices of one qkv projection output, as the Llama-family layers give them
        qkv = torch.randn(num_tokens, (hq + 2 * hkv) * D, generator=gen, device=CUDA).bfloat16()
        q, k, v = (x.view(num_tokens, -1, D) for x in qkv.split([hq * D, hkv * D, hkv * D], dim=-1))
    else:  # tensors of their own
        q, k, v = (torch.randn(num_tokens, h, D, generator=gen, device=CUDA).bfloat16() for h in (hq, hkv, hkv))
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device=CUDA)
    slots = torch.randperm(NUM_PAGES * PAGE - PAGE, generator=gen, device=CUDA)[:num_tokens] + PAGE
    cache = torch.randn(NUM_PAGES, 2, PAGE, hkv, D, generator=gen, device=CUDA).bfloat16()
    return q, k, v, positions, slots, cache


@pytest.mark.parametrize("fused", [True, False], ids=["qkv-slices", "separate-tensors"])
@pytest.mark.parametrize("num_tokens", [1, 7, 300, 4096])
def test_kernel_matches_rotate_then_scatter_at_llama_shapes(num_tokens, fused):
    from pagoda_engine.worker.attention.rope_kv_triton import (
        rope_and_write_kv,
        rope_and_write_kv_reference,
    )

    rotary = llama_rotary()
    q, k, v, positions, slots, cache = inputs(num_tokens, seed=num_tokens, fused=fused)
    want_cache = cache.clone()
    want_q = rope_and_write_kv_reference(want_cache, slots, q.clone(), k, v, positions, rotary.cos_cache,
                                         rotary.sin_cache)
    rope_and_write_kv(cache, slots, q, k, v, positions, rotary.cos_cache, rotary.sin_cache)
    # Both rotate in float32 and round once; at most a rounding step apart where the GPU fuses a
    # multiply-add.
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(cache, want_cache)
    assert torch.equal(cache[slots // PAGE, 1, slots % PAGE], v)
    written = torch.zeros(NUM_PAGES * PAGE, dtype=torch.bool, device=CUDA)
    written[slots] = True
    untouched = ~written.view(NUM_PAGES, PAGE)
    assert torch.equal(cache.transpose(1, 2)[untouched], want_cache.transpose(1, 2)[untouched])


def test_kernel_agrees_with_flashinfer_rotary():
    """The rotation FlashInfer's kernel applied before (same float32 cos/sin cache): within bf16 rounding."""
    import flashinfer
    from pagoda_engine.worker.attention.rope_kv_triton import rope_and_write_kv

    rotary = llama_rotary()
    q, k, v, positions, slots, cache = inputs(513, seed=5)
    fq, fk = q.clone(), k.clone()
    cos_sin = torch.cat((rotary.cos_cache, rotary.sin_cache), dim=-1).contiguous()
    flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, fq, fk, D, cos_sin, is_neox=True)
    rope_and_write_kv(cache, slots, q, k, v, positions, rotary.cos_cache, rotary.sin_cache)
    torch.testing.assert_close(q, fq, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(cache[slots // PAGE, 0, slots % PAGE], fk, atol=2e-2, rtol=1e-2)


def test_kernel_replays_from_a_cuda_graph_with_new_positions_and_slots():
    """Captured once over fixed buffers (as in a decode graph), replayed after the buffers change:
    the replay rotates and writes for the new positions and slots."""
    from pagoda_engine.worker.attention.rope_kv_triton import (
        rope_and_write_kv,
        rope_and_write_kv_reference,
    )

    rotary = llama_rotary()
    q, k, v, positions, slots, cache = inputs(32, seed=7)
    q_in = q.clone()
    rope_and_write_kv(cache, slots, q, k, v, positions, rotary.cos_cache, rotary.sin_cache)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_and_write_kv(cache, slots, q, k, v, positions, rotary.cos_cache, rotary.sin_cache)
    _, _, _, new_positions, new_slots, _ = inputs(32, seed=8)
    positions.copy_(new_positions)
    slots.copy_(new_slots)
    q.copy_(q_in)
    want_cache = cache.clone()
    want_q = rope_and_write_kv_reference(want_cache, new_slots, q_in.clone(), k, v, new_positions,
                                         rotary.cos_cache, rotary.sin_cache)
    graph.replay()
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(cache, want_cache)


def qwen3_rotary() -> RotaryEmbedding:
    return RotaryEmbedding(D, MAX_POS, 1000000.0).to(CUDA)


def qwen3_norms(seed: int) -> tuple[RMSNorm, RMSNorm]:
    """q_norm and k_norm in bf16 on the GPU, weights spread around 1."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    norms = tuple(RMSNorm(D, QWEN3_EPS).requires_grad_(False).to(CUDA) for _ in range(2))
    for norm in norms:
        norm.weight.copy_(1 + 0.2 * torch.randn(D, generator=gen, device=CUDA))
    return tuple(norm.to(torch.bfloat16) for norm in norms)


def kernel_norms(norms: tuple[RMSNorm, RMSNorm]) -> dict:
    return dict(q_norm=(norms[0].weight, norms[0].eps), k_norm=(norms[1].weight, norms[1].eps))


def assert_within_bf16_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Both round the norm's output to bf16, then the rotation's: where their float32 values
    straddle a rounding boundary (a different order of the sum of squares, a fused multiply-add),
    an element may end a rounding step or two apart at the normalised values' scale; few do."""
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    assert (got != want).float().mean().item() < 0.01


@pytest.mark.parametrize("num_tokens", [1, 7, 300, 4096])
def test_fused_qk_norm_matches_its_reference_at_qwen3_30b_a3b_shapes(num_tokens):
    from pagoda_engine.worker.attention.rope_kv_triton import (
        rope_and_write_kv,
        rope_and_write_kv_reference,
    )

    rotary, norms = qwen3_rotary(), qwen3_norms(seed=num_tokens)
    q, k, v, positions, slots, cache = inputs(num_tokens, seed=num_tokens, heads=(QWEN3_MOE_HQ, QWEN3_MOE_HKV))
    want_cache = cache.clone()
    want_q = rope_and_write_kv_reference(want_cache, slots, q.clone(), k, v, positions, rotary.cos_cache,
                                         rotary.sin_cache, **kernel_norms(norms))
    rope_and_write_kv(cache, slots, q, k, v, positions, rotary.cos_cache, rotary.sin_cache, **kernel_norms(norms))
    assert_within_bf16_rounding(q, want_q)
    assert_within_bf16_rounding(cache, want_cache)
    assert torch.equal(cache[slots // PAGE, 1, slots % PAGE], v)


def test_fused_qk_norm_matches_the_separate_norm_kernels_it_replaces():
    """The path before the fusion: the layer's RMSNorm modules (FlashInfer's kernel on CUDA, over a
    copy of the strided heads), then the rotary + write kernel without norms. Same formula: the
    same values but where the float32 sums round differently."""
    from pagoda_engine.worker.attention.rope_kv_triton import rope_and_write_kv

    rotary, (q_norm, k_norm) = qwen3_rotary(), qwen3_norms(seed=11)
    q, k, v, positions, slots, cache = inputs(513, seed=11, heads=(QWEN3_MOE_HQ, QWEN3_MOE_HKV))
    separate_cache = cache.clone()
    separate_q = rope_and_write_kv(separate_cache, slots, q_norm(q), k_norm(k), v, positions, rotary.cos_cache,
                                   rotary.sin_cache)
    rope_and_write_kv(cache, slots, q, k, v, positions, rotary.cos_cache, rotary.sin_cache,
                      **kernel_norms((q_norm, k_norm)))
    assert_within_bf16_rounding(q, separate_q)
    assert_within_bf16_rounding(cache, separate_cache)


def test_fused_qk_norm_replays_from_a_cuda_graph_with_new_positions_and_slots():
    from pagoda_engine.worker.attention.rope_kv_triton import (
        rope_and_write_kv,
        rope_and_write_kv_reference,
    )

    rotary, norms = qwen3_rotary(), qwen3_norms(seed=12)
    heads = (QWEN3_MOE_HQ, QWEN3_MOE_HKV)
    q, k, v, positions, slots, cache = inputs(32, seed=12, heads=heads)
    q_in = q.clone()
    args = (positions, rotary.cos_cache, rotary.sin_cache)
    rope_and_write_kv(cache, slots, q, k, v, *args, **kernel_norms(norms))  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_and_write_kv(cache, slots, q, k, v, *args, **kernel_norms(norms))
    _, _, _, new_positions, new_slots, _ = inputs(32, seed=13, heads=heads)
    positions.copy_(new_positions)
    slots.copy_(new_slots)
    q.copy_(q_in)
    want_cache = cache.clone()
    want_q = rope_and_write_kv_reference(want_cache, new_slots, q_in.clone(), k, v, new_positions, rotary.cos_cache,
                                         rotary.sin_cache, **kernel_norms(norms))
    graph.replay()
    assert_within_bf16_rounding(q, want_q)
    assert_within_bf16_rounding(cache, want_cache)

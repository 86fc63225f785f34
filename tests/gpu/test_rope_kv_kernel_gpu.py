"""The fused rotary + K/V-write kernel (`attention/rope_kv_triton.py`) on the GPU at Llama-3.1-8B's
shapes in bf16: against its torch reference and FlashInfer's rotary kernel (which it replaces),
eagerly and replayed from a CUDA graph with new positions and slots."""

from __future__ import annotations

import pytest
import torch
from gpu_support import CUDA, LLAMA_SIZED_CONFIG, requires_gpu
from pagoda_engine.worker.model.layers import RotaryEmbedding

pytestmark = [pytest.mark.gpu, requires_gpu]

HQ, HKV, D = LLAMA_SIZED_CONFIG["num_attention_heads"], LLAMA_SIZED_CONFIG["num_key_value_heads"], 128
PAGE, NUM_PAGES, MAX_POS = 16, 2048, 8192


def llama_rotary() -> RotaryEmbedding:
    return RotaryEmbedding(D, MAX_POS, LLAMA_SIZED_CONFIG["rope_theta"], LLAMA_SIZED_CONFIG["rope_scaling"]).to(CUDA)


def inputs(num_tokens: int, seed: int, fused: bool = True):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    if fused:  # slices of one qkv projection output, as the Llama layers give them
        qkv = torch.randn(num_tokens, (HQ + 2 * HKV) * D, generator=gen, device=CUDA).bfloat16()
        q, k, v = (x.view(num_tokens, -1, D) for x in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    else:  # tensors of their own, as after Qwen3's per-head norms
        q, k, v = (torch.randn(num_tokens, h, D, generator=gen, device=CUDA).bfloat16() for h in (HQ, HKV, HKV))
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, device=CUDA)
    slots = torch.randperm(NUM_PAGES * PAGE - PAGE, generator=gen, device=CUDA)[:num_tokens] + PAGE
    cache = torch.randn(NUM_PAGES, 2, PAGE, HKV, D, generator=gen, device=CUDA).bfloat16()
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

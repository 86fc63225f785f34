"""The fused rotary + K/V-write kernel (`attention/rope_kv_triton.py`) under Triton's CPU
interpreter, against its torch reference (rotate, then scatter into the pages) on tiny shapes.

Skips where Triton does not import (CPU CI); the same kernel at Llama-3.1-8B's shapes on a GPU is
tests/gpu/test_rope_kv_kernel_gpu.py.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from pagoda_engine.worker.model.layers import RotaryEmbedding
from triton_interpreter import import_kernels

kernels = import_kernels("pagoda_engine.worker.attention.rope_kv_triton")
NUM_PAGES, PAGE_SIZE = 12, 4


def _inputs(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, fused: bool,
            seed: int = 0):
    """q, k, v (slices of one qkv projection output when `fused`, else tensors of their own), their
    positions, distinct slots in shuffled pages, and a cache already holding other tokens."""
    gen = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
        q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k, v = (x.view(num_tokens, -1, head_dim) for x in (q, k, v))
    else:
        q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
        k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    slots = torch.tensor(random.Random(seed).sample(range(PAGE_SIZE, NUM_PAGES * PAGE_SIZE), num_tokens))
    cache = torch.randn(NUM_PAGES, 2, PAGE_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v, positions, slots, cache


def _run_both(q, k, v, positions, slots, cache, rotary: RotaryEmbedding | None):
    rope = (positions, rotary.cos_cache, rotary.sin_cache) if rotary is not None else ()
    want_cache = cache.clone()
    want_q = kernels.rope_and_write_kv_reference(want_cache, slots, q.clone(), k.clone(), v.clone(), *rope)
    got_q = q.clone()
    returned = kernels.rope_and_write_kv(cache, slots, got_q, k, v, *rope)
    assert returned is got_q  # rotated in place
    return got_q, cache, want_q, want_cache


@pytest.mark.parametrize("fused", [True, False], ids=["qkv-slices", "separate-tensors"])
@pytest.mark.parametrize("shape", [(4, 2, 8), (6, 2, 12), (3, 3, 16)], ids=["pow2", "odd-heads-half-6", "mha"])
def test_fused_rope_and_kv_write_equals_rotate_then_scatter_float32(shape, fused):
    """Float32: the kernel's q and every page slot equal the reference's (rotation in float32 both
    ways); slots the step does not write keep what they held."""
    num_q_heads, num_kv_heads, head_dim = shape
    rotary = RotaryEmbedding(head_dim, 64, 10000.0)
    q, k, v, positions, slots, cache = _inputs(7, num_q_heads, num_kv_heads, head_dim, torch.float32, fused)
    got_q, got_cache, want_q, want_cache = _run_both(q, k, v, positions, slots, cache, rotary)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-6, rtol=1e-6)
    # V is copied, never rotated: bit for bit.
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    assert torch.equal(got_cache[pages, 1, offsets], v)


def test_fused_rope_matches_the_model_rotary_in_bfloat16():
    """bf16 with Llama 3.1's scaled rotary: the kernel rotates in float32 and rounds once, as the
    reference does (within one bf16 step: Triton's interpreter may round the other way than the
    GPU); the model's torch rotary (cos/sin rounded to bf16 first) stays within bf16 rounding of it."""
    params = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=32)
    rotary = RotaryEmbedding(16, 64, 500000.0, params)
    q, k, v, positions, slots, cache = _inputs(5, 4, 2, 16, torch.bfloat16, fused=True, seed=3)
    got_q, got_cache, want_q, want_cache = _run_both(q, k, v, positions, slots, cache, rotary)
    torch.testing.assert_close(got_q, want_q)  # bf16's default tolerance: one rounding step
    torch.testing.assert_close(got_cache, want_cache)
    model_q, model_k = rotary(positions, q.clone(), k.clone())
    torch.testing.assert_close(got_q, model_q, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_cache[slots // PAGE_SIZE, 0, slots % PAGE_SIZE], model_k, atol=2e-2, rtol=2e-2)


def test_without_rotation_the_kernel_only_writes_kv():
    q, k, v, positions, slots, cache = _inputs(6, 4, 2, 8, torch.bfloat16, fused=True, seed=1)
    q_before = q.clone()
    got_q, got_cache, _, want_cache = _run_both(q, k, v, positions, slots, cache, None)
    assert torch.equal(got_q, q_before)
    assert torch.equal(got_cache, want_cache)


def test_padding_rows_write_the_null_slot_only():
    """A decode graph's padding rows (position 0, slot 0) land in page 0's first slot and nowhere else."""
    rotary = RotaryEmbedding(8, 64, 10000.0)
    q, k, v, positions, slots, cache = _inputs(4, 4, 2, 8, torch.float32, fused=True, seed=2)
    positions[2:], slots[2:] = 0, 0
    before = cache.clone()
    kernels.rope_and_write_kv(cache, slots, q, k, v, positions, rotary.cos_cache, rotary.sin_cache)
    changed = (cache != before).flatten(3).any(-1)  # [page, k|v, slot]
    written = {(int(s) // PAGE_SIZE, int(s) % PAGE_SIZE) for s in slots}
    assert {(p, o) for p, _, o in changed.nonzero().tolist()} <= written
    # Both padding rows wrote their V there (which one lands last is a race: nobody reads it).
    assert torch.equal(cache[0, 1, 0], v[2]) or torch.equal(cache[0, 1, 0], v[3])


def test_shape_mismatch_is_refused():
    q, k, v, _, slots, cache = _inputs(2, 4, 2, 8, torch.float32, fused=False)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.rope_and_write_kv(cache, slots, q, k[:, :1], v[:, :1])

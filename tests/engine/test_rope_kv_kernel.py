"""The fused per-head norm + rotary + K/V-write kernel (`attention/rope_kv_triton.py`) under
Triton's CPU interpreter, against its torch reference (normalise, rotate, then scatter into the
pages) and against the reference attention backend's own path, on small shapes.

Skips where Triton does not import (CPU CI); the same kernel at Llama-3.1-8B's and Qwen3-30B-A3B's
shapes on a GPU is tests/gpu/test_rope_kv_kernel_gpu.py (the fused q/k norm too).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")

from pagoda_engine.worker.attention.base import AttentionBatch, KVCacheSpec
from pagoda_engine.worker.attention.torch_ref import TorchRefBackend
from pagoda_engine.worker.model.layers import RMSNorm, RotaryEmbedding
from triton_interpreter import import_kernels

kernels = import_kernels("pagoda_engine.worker.attention.rope_kv_triton")
NUM_PAGES, PAGE_SIZE = 12, 4

# Without a GPU, the norm's kernels need Triton's interpreter switch on for the whole process (run
# with TRITON_INTERPRET=1): Triton's own jitted helpers (`tl.sum`) are interpreted only when it was
# on as Triton was imported, and a launch with a float argument (eps) reads it again.
needs_interpreted_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="without a GPU the norm's kernels run only with TRITON_INTERPRET=1 set for the whole process")


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


def _head_norms(head_dim: int, dtype: torch.dtype, seed: int = 0) -> tuple[RMSNorm, RMSNorm]:
    """Qwen3's q_norm and k_norm: RMSNorms over head_dim, weights spread around 1 (as trained ones are)."""
    gen = torch.Generator().manual_seed(seed)
    norms = (RMSNorm(head_dim, eps=1e-6).requires_grad_(False), RMSNorm(head_dim, eps=1e-6).requires_grad_(False))
    for norm in norms:
        norm.weight.copy_(1 + 0.3 * torch.randn(head_dim, generator=gen))
    return tuple(norm.to(dtype) for norm in norms)


def _kernel_norms(norms: tuple[RMSNorm, RMSNorm] | None) -> dict:
    """The kernel's q_norm / k_norm arguments: (weight, eps) of each module."""
    if norms is None:
        return {}
    return dict(q_norm=(norms[0].weight, norms[0].eps), k_norm=(norms[1].weight, norms[1].eps))


def _run_both(q, k, v, positions, slots, cache, rotary: RotaryEmbedding | None,
              norms: tuple[RMSNorm, RMSNorm] | None = None):
    rope = (positions, rotary.cos_cache, rotary.sin_cache) if rotary is not None else ()
    want_cache = cache.clone()
    want_q = kernels.rope_and_write_kv_reference(want_cache, slots, q.clone(), k.clone(), v.clone(), *rope,
                                                 **_kernel_norms(norms))
    got_q = q.clone()
    returned = kernels.rope_and_write_kv(cache, slots, got_q, k, v, *rope, **_kernel_norms(norms))
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


# (query heads, KV heads, head_dim): grouped-query attention with a power-of-two and an odd group,
# plain multi-head attention, and Qwen3-30B-A3B's attention (32 over 4 heads of 128).
NORM_SHAPES = {"gqa8over2-d64": (8, 2, 64), "gqa6over2-d128": (6, 2, 128), "mha4-d128": (4, 4, 128),
               "qwen3-30b-a3b": (32, 4, 128)}
# bf16 with the norm: the norm's output is rounded to bf16 before the rotation (as the separate
# norm's output was), and Triton's interpreter rounds towards zero where torch and the GPU round to
# nearest: up to two rounding steps apart at the normalised values' scale (1 to 8). Float32: exact
# but for the order of the sum of squares.
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


@needs_interpreted_triton
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", NORM_SHAPES.values(), ids=NORM_SHAPES.keys())
def test_fused_norm_rope_and_kv_write_equals_norm_rotate_then_scatter(shape, dtype, norm):
    """With Qwen3's per-head norm weights, q (in place, in the qkv output) and every page slot
    equal the reference's: normalise each head, rotate, scatter; without them, rotate and scatter
    as before. V is copied bit for bit; slots the step does not write keep what they held."""
    num_q_heads, num_kv_heads, head_dim = shape
    rotary = RotaryEmbedding(head_dim, 64, 1000000.0)
    norms = _head_norms(head_dim, dtype, seed=head_dim + num_q_heads) if norm else None
    q, k, v, positions, slots, cache = _inputs(7, num_q_heads, num_kv_heads, head_dim, dtype, fused=True,
                                               seed=num_q_heads)
    got_q, got_cache, want_q, want_cache = _run_both(q, k, v, positions, slots, cache, rotary, norms)
    tolerance = TOLERANCE[dtype] if norm else {}  # without the norm: one rounding, bf16's default tolerance
    torch.testing.assert_close(got_q, want_q, **tolerance)
    torch.testing.assert_close(got_cache, want_cache, **tolerance)
    pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
    assert torch.equal(got_cache[pages, 1, offsets], v)
    unwritten = torch.ones(NUM_PAGES, PAGE_SIZE, dtype=torch.bool)
    unwritten[pages, offsets] = False
    assert torch.equal(got_cache.transpose(1, 2)[unwritten], want_cache.transpose(1, 2)[unwritten])


@needs_interpreted_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_norm_gives_what_the_reference_backend_computes(dtype):
    """The reference attention backend normalises with the model's RMSNorm modules and rotates
    with its RotaryEmbedding, then writes K/V: the kernel writes the same keys and values into the
    same pages and leaves the same q. Float32: to rounding; bf16: within bf16 rounding (the torch
    path rounds the norm before its weight and cos/sin to bf16, as transformers does)."""
    num_q_heads, num_kv_heads, head_dim = NORM_SHAPES["gqa8over2-d64"]
    rotary = RotaryEmbedding(head_dim, 64, 1000000.0)
    q_norm, k_norm = _head_norms(head_dim, dtype, seed=1)
    q, k, v, *_ = _inputs(7, num_q_heads, num_kv_heads, head_dim, dtype, fused=True, seed=5)
    # One request's 7 new tokens after 3 cached ones, in pages 5 and 2.
    positions = torch.arange(3, 10)
    page_table = [5, 2, 9]
    slots = torch.tensor([page_table[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in positions.tolist()])
    spec = KVCacheSpec(num_layers=1, num_kv_heads=num_kv_heads, num_qo_heads=num_q_heads, head_dim=head_dim,
                       page_size=PAGE_SIZE, dtype=dtype)
    backend = TorchRefBackend(spec, NUM_PAGES, torch.device("cpu"))
    backend.plan(AttentionBatch(query_lens=[7], seq_lens=[10], page_tables=[page_table], slot_mapping=slots))
    backend.forward(0, q.clone(), k.clone(), v.clone(), positions=positions, rotary=rotary, q_norm=q_norm,
                    k_norm=k_norm)
    want_q, _ = rotary(positions, q_norm(q), k_norm(k))
    cache = torch.zeros_like(backend.kv_caches[0])
    got_q = kernels.rope_and_write_kv(cache, slots, q.clone(), k, v, positions, rotary.cos_cache, rotary.sin_cache,
                                      **_kernel_norms((q_norm, k_norm)))
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(got_q, want_q, **tolerance)
    torch.testing.assert_close(cache, backend.kv_caches[0], **tolerance)


@needs_interpreted_triton
def test_norm_without_rotation_normalises_q_in_place_and_k_into_the_pages():
    num_q_heads, num_kv_heads, head_dim = NORM_SHAPES["gqa6over2-d128"]
    norms = _head_norms(head_dim, torch.float32, seed=2)
    q, k, v, positions, slots, cache = _inputs(5, num_q_heads, num_kv_heads, head_dim, torch.float32, fused=True,
                                               seed=4)
    got_q, got_cache, want_q, want_cache = _run_both(q, k, v, positions, slots, cache, None, norms)
    torch.testing.assert_close(got_q, norms[0](q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache[slots // PAGE_SIZE, 0, slots % PAGE_SIZE], norms[1](k), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)


@needs_interpreted_triton
def test_heads_split_across_tensor_parallel_ranks_normalise_as_the_whole():
    """Tensor parallelism gives each rank a share of the heads and the whole norm weight: the
    norm is per head, so each rank's kernel gives its slice of the one-rank result."""
    num_q_heads, num_kv_heads, head_dim = NORM_SHAPES["gqa8over2-d64"]
    rotary = RotaryEmbedding(head_dim, 64, 1000000.0)
    norms = _head_norms(head_dim, torch.float32, seed=3)
    q, k, v, positions, slots, cache = _inputs(6, num_q_heads, num_kv_heads, head_dim, torch.float32, fused=False,
                                               seed=6)
    whole_q, whole_cache, _, _ = _run_both(q, k, v, positions, slots, cache.clone(), rotary, norms)
    q_share, kv_share = num_q_heads // 2, num_kv_heads // 2
    for rank in range(2):
        qs, ks = slice(rank * q_share, (rank + 1) * q_share), slice(rank * kv_share, (rank + 1) * kv_share)
        rank_cache = cache[:, :, :, ks].contiguous()
        rank_q = kernels.rope_and_write_kv(rank_cache, slots, q[:, qs].clone(), k[:, ks], v[:, ks], positions,
                                           rotary.cos_cache, rotary.sin_cache, **_kernel_norms(norms))
        torch.testing.assert_close(rank_q, whole_q[:, qs], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(rank_cache, whole_cache[:, :, :, ks], atol=1e-6, rtol=1e-6)


def test_a_norm_for_q_without_one_for_k_is_refused():
    q, k, v, positions, slots, cache = _inputs(2, 4, 2, 8, torch.float32, fused=False)
    q_norm, _ = _head_norms(8, torch.float32)
    with pytest.raises(ValueError, match="go together"):
        kernels.rope_and_write_kv(cache, slots, q, k, v, q_norm=(q_norm.weight, q_norm.eps))


@needs_interpreted_triton
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 3.0)], ids=["unit-scales", "checkpoint-scales"])
def test_fp8_pages_take_k_and_v_over_their_scale_rounded_to_e4m3(scales):
    """FP8 pages (`--kv-cache-dtype fp8`): the kernel writes K (rotated) and V divided by the
    layer's scales, clamped to e4m3's range, as `base.quantize_kv` does. The kernel quantizes
    the rotated key from float32, the reference from float32 rounded to k's dtype (float32 here):
    the same value, so the pages agree bit for bit but for the odd value that lands a hair either
    side of a rounding midpoint (one e4m3 step)."""
    rotary = RotaryEmbedding(16, 64, 10000.0)
    q, k, v, positions, slots, cache = _inputs(7, 4, 2, 16, torch.float32, fused=True)
    k[0, 0, 0] = 1e4  # beyond e4m3's range: 448, not NaN
    cache = cache.to(torch.float8_e4m3fn)
    rope = (positions, rotary.cos_cache, rotary.sin_cache)
    want_cache = cache.clone()
    want_q = kernels.rope_and_write_kv_reference(want_cache, slots, q.clone(), k.clone(), v.clone(), *rope,
                                                 scales=scales)
    got_q = kernels.rope_and_write_kv(cache, slots, q.clone(), k, v, *rope, scales=scales)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)  # queries are not quantized
    got, want = cache.float(), want_cache.float()
    assert not got.isnan().any() and got.abs().max() == 448
    same = (got == want).float().mean()
    assert same >= 0.99, same
    if torch.cuda.is_available():
        torch.testing.assert_close(got, want, atol=2 ** -9, rtol=2 ** -3)  # within one e4m3 step
        pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE  # V is never rotated: bit for bit
        assert torch.equal(got[pages, 1, offsets], (v.cpu() / scales[1]).to(torch.float8_e4m3fn).float())
    else:
        # Triton's interpreter converts to e4m3 in numpy, losing the carry where a value rounds up
        # (into the exponent, or a subnormal's next step): where it differs from torch, it is
        # smaller in magnitude, of the same sign, and at least half of torch's value.
        differing = got != want
        have, should = got[differing], want[differing]
        assert (have * should >= 0).all() and (have.abs() < should.abs()).all()
        assert (have.abs() >= should.abs() / 2 - 2 ** -9).all()

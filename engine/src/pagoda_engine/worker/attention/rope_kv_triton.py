"""Per-head RMSNorm and rotary embedding of q and k fused with the paged K/V write, on CUDA
(Triton): one launch per layer where FlashInfer's norm and rotary kernels and an index_put made
several (Qwen3: a copy and a norm for each of q and k, then the rotary and the write).

Per token one program normalises and rotates its query heads in place (neox style, halves
rotated, in float32 from the float32 cos/sin cache, as FlashInfer's rotary kernel does) and
another writes its key heads, normalised and rotated, and its value heads into
`cache[slot // page_size, 0 | 1, slot % page_size]` of the layer's
`[num_pages, 2, page_size, num_kv_heads, head_dim]` ("NHD") pages. The rotated keys are written
only to the cache: attention reads them from there. Every shape and stride comes from the tensors,
so q, k and v may be strided views of the fused qkv projection's output or tensors of their own.
Without cos/sin the program does not rotate; without norm weights it does not normalise.

The norm is FlashInfer's RMSNorm, which the separate path ran: over each head's head_dim values in
float32, times the weight in float32, rounded once to q's (k's) dtype; the rotation then starts
from that rounded value, as it did from the separate norm's output.

Static shapes, no host synchronisation: capturable in CUDA graphs. The rows a decode graph pads
with (position 0, slot 0) rotate their own q rows and write the reserved null page 0, which no
request reads. `rope_and_write_kv_reference` is the same in torch operations: normalise, rotate,
then scatter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl
from pagoda_engine.worker.attention.base import scatter_kv, split_slots


@triton.jit
def _cos_sin(positions_ptr, cos_ptr, sin_ptr, t, d, d_ok, HALF: tl.constexpr):
    """Token t's cos and sin [1, HALF_P2], float32."""
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HALF + d, mask=d_ok)[None, :]
    sin = tl.load(sin_ptr + pos * HALF + d, mask=d_ok)[None, :]
    return cos, sin


@triton.jit
def _rms_norm_heads(x1, x2, weight_ptr, eps, d, d_ok, HALF: tl.constexpr):
    """The halves x1, x2 [HEADS_P2, HALF_P2] of each head (float32, zero where masked), normalised
    over the head's 2 * HALF values and times the weight, in float32."""
    mean_sq = tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF)
    r = tl.rsqrt(mean_sq + eps)[:, None]
    w1 = tl.load(weight_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    return x1 * r * w1, x2 * r * w2


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr, cache_ptr, q_norm_ptr, k_norm_ptr,
    q_eps, k_eps, k_scale, v_scale,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    cache_stride_page, cache_stride_kv, cache_stride_slot, cache_stride_h,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_P2: tl.constexpr, KV_HEADS_P2: tl.constexpr,
    HALF: tl.constexpr, HALF_P2: tl.constexpr, PAGE_SIZE: tl.constexpr, ROTATE: tl.constexpr, NORM: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):
    # Program (t, 0) writes token t's K and V, program (t, 1) normalises and rotates its q: two
    # programs per token halve the chain of dependent loads and stores a small decode batch waits on.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF_P2)
    d_ok = d < HALF
    if tl.program_id(1) == 0:
        hk = tl.arange(0, KV_HEADS_P2)
        kv_mask = (hk[:, None] < NUM_KV_HEADS) & d_ok[None, :]
        k_row = k_ptr + t * k_stride_t + hk[:, None] * k_stride_h + d[None, :]
        v_row = v_ptr + t * v_stride_t + hk[:, None] * v_stride_h + d[None, :]
        k1 = tl.load(k_row, mask=kv_mask, other=0.0)
        k2 = tl.load(k_row + HALF, mask=kv_mask, other=0.0)
        v1 = tl.load(v_row, mask=kv_mask)
        v2 = tl.load(v_row + HALF, mask=kv_mask)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if NORM:
            k1, k2 = _rms_norm_heads(k1.to(tl.float32), k2.to(tl.float32), k_norm_ptr, k_eps, d, d_ok, HALF)
            k1, k2 = k1.to(k_ptr.dtype.element_ty), k2.to(k_ptr.dtype.element_ty)
        if ROTATE:
            cos, sin = _cos_sin(positions_ptr, cos_ptr, sin_ptr, t, d, d_ok, HALF)
            k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
            k1 = k1f * cos - k2f * sin
            k2 = k2f * cos + k1f * sin
        dst = cache_ptr + (slot // PAGE_SIZE) * cache_stride_page + (slot % PAGE_SIZE) * cache_stride_slot
        dst = dst + hk[:, None] * cache_stride_h + d[None, :]
        out_ty = cache_ptr.dtype.element_ty
        if FP8:  # `base.quantize_kv`: divided by the layer's scale, clamped to e4m3's range
            k1 = tl.clamp(k1.to(tl.float32) / k_scale, -448.0, 448.0)
            k2 = tl.clamp(k2.to(tl.float32) / k_scale, -448.0, 448.0)
            v1 = tl.clamp(v1.to(tl.float32) / v_scale, -448.0, 448.0)
            v2 = tl.clamp(v2.to(tl.float32) / v_scale, -448.0, 448.0)
        tl.store(dst, k1.to(out_ty), mask=kv_mask)
        tl.store(dst + HALF, k2.to(out_ty), mask=kv_mask)
        tl.store(dst + cache_stride_kv, v1.to(out_ty), mask=kv_mask)
        tl.store(dst + cache_stride_kv + HALF, v2.to(out_ty), mask=kv_mask)
    else:
        hq = tl.arange(0, Q_HEADS_P2)
        q_mask = (hq[:, None] < NUM_Q_HEADS) & d_ok[None, :]
        q_row = q_ptr + t * q_stride_t + hq[:, None] * q_stride_h + d[None, :]
        q_ty = q_ptr.dtype.element_ty
        q1 = tl.load(q_row, mask=q_mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + HALF, mask=q_mask, other=0.0).to(tl.float32)
        if NORM:
            q1, q2 = _rms_norm_heads(q1, q2, q_norm_ptr, q_eps, d, d_ok, HALF)
            q1, q2 = q1.to(q_ty).to(tl.float32), q2.to(q_ty).to(tl.float32)
        if ROTATE:
            cos, sin = _cos_sin(positions_ptr, cos_ptr, sin_ptr, t, d, d_ok, HALF)
            q1, q2 = q1 * cos - q2 * sin, q2 * cos + q1 * sin
        tl.store(q_row, q1.to(q_ty), mask=q_mask)
        tl.store(q_row + HALF, q2.to(q_ty), mask=q_mask)


# A per-head norm as the kernel takes it: (weight [head_dim], eps).
Norm = tuple[torch.Tensor, float]


def rope_and_write_kv(cache: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                      sin: torch.Tensor | None = None, q_norm: Norm | None = None,
                      k_norm: Norm | None = None, scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Normalise and rotate q [T, Hq, D] in place and write k (normalised, rotated) and v
    [T, Hkv, D] into the layer's pages `cache` at `slots` (int64 [T]: page * page_size + offset);
    FP8 pages take them quantized with the layer's (k_scale, v_scale) `scales`.
    `positions` int64 [T] and `cos`/`sin` float32 [max_position, D / 2] give the rotation;
    `q_norm` and `k_norm`, given together, the per-head RMSNorms applied before it. Without them
    q is left alone and k is written as it is. Returns q."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape[2] != head_dim or v.shape != k.shape or cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit pages {tuple(cache.shape)}")
    if any(t.stride(-1) != 1 for t in (q, k, v, cache)):
        raise ValueError("q, k, v and the cache need unit stride along head_dim")
    rotate = cos is not None
    if rotate and (positions is None or sin is None or cos.shape[-1] != head_dim // 2
                   or not (cos.is_contiguous() and sin.is_contiguous())):
        raise ValueError(f"rotation needs positions and cos/sin caches of width {head_dim // 2}")
    norm = q_norm is not None
    if norm != (k_norm is not None) or (norm and any(w.shape != (head_dim,) or not w.is_contiguous()
                                                     for w, _ in (q_norm, k_norm))):
        raise ValueError(f"q and k norms go together, each a contiguous weight of {head_dim} values")
    (q_weight, q_eps), (k_weight, k_eps) = (q_norm, k_norm) if norm else ((cache, 0.0), (cache, 0.0))
    if num_tokens:
        _rope_kv_write_kernel[(num_tokens, 2 if rotate or norm else 1)](
            q, k, v, positions if rotate else slots, slots, cos if rotate else cache, sin if rotate else cache, cache,
            q_weight, k_weight, float(q_eps), float(k_eps), float(scales[0]), float(scales[1]),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_P2=triton.next_power_of_2(num_q_heads),
            KV_HEADS_P2=triton.next_power_of_2(num_kv_heads), HALF=head_dim // 2,
            HALF_P2=triton.next_power_of_2(head_dim // 2), PAGE_SIZE=cache.shape[2], ROTATE=rotate, NORM=norm,
            FP8=cache.dtype == torch.float8_e4m3fn, num_warps=4, **pdl.launch(q.device))
    return q


def rms_norm_heads_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """FlashInfer's RMSNorm over the last dimension, which the kernel fuses: in float32, times the
    weight in float32, rounded once to x's dtype. (`model.layers.RMSNorm`'s torch path rounds
    before the weight, as transformers does: at most a rounding step from this.)"""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rope_and_write_kv_reference(cache: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, positions: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                                sin: torch.Tensor | None = None, q_norm: Norm | None = None,
                                k_norm: Norm | None = None, scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """What the kernel computes, in torch operations: the per-head norms (rounded to q's and k's
    dtype), rotation in float32, rounded once to q's dtype; then the scatter every backend writes
    with (`base.scatter_kv`, quantizing for FP8 pages). Returns the normalised, rotated q. (Into
    FP8 pages the kernel quantizes the rotated key from float32, this from k's dtype: the two may
    round a value to neighbouring e4m3 steps.)"""
    if q_norm is not None:
        q, k = rms_norm_heads_reference(q, *q_norm), rms_norm_heads_reference(k, *k_norm)
    if cos is not None:
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.float().chunk(2, dim=-1)
            return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

        q, k = rotate(q), rotate(k)
    pages, offsets = split_slots(slots, cache.shape[2])
    scatter_kv(cache, pages, offsets, k, v, scales)
    return q

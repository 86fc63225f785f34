"""The attention backend interface: a rank plans once per step, each layer calls forward.

A backend owns the paged KV cache: per layer one tensor `[num_pages, 2, page_size, num_kv_heads,
head_dim]` (FlashInfer's "NHD" layout). Page 0 is the reserved null page; no request owns it.

FP8 pages (`--kv-cache-dtype fp8`, `KVCacheSpec.quantized`) hold each value divided by its layer's
K or V scale, clamped to e4m3's range and rounded (`quantize_kv`); a reader multiplies back
(`dequantize_kv`). Every backend applies the scales the same way outside its kernels: the K scale
folded into the queries (q·(s·k) = (s·q)·k), the V scale into the output (Σp·(s·v) = s·Σp·v), so
the kernels read the stored values as they are and a scale of 1.0 costs nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch

from pagoda_engine.executor_types import AttentionBatch, KVCacheSpec


class Rotary(Protocol):
    """The model's rotary embedding as a backend sees it (`model.layers.RotaryEmbedding`):
    `rotary(positions, q, k) -> (q, k)` rotated, and its float32 cos and sin caches
    `[max_position, head_dim / 2]` for kernels that rotate themselves."""

    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...


class HeadNorm(Protocol):
    """A per-head RMSNorm as a backend sees it (`model.layers.RMSNorm` over head_dim, Qwen3's
    `q_norm` / `k_norm`): `norm(x) -> x` normalised, and its `weight` [head_dim] and `eps` for
    kernels that normalise themselves."""

    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class AttentionBackend(ABC):
    """Paged attention over one KV pool. `plan` once per step, then `forward` once per layer."""

    name: str = "base"
    # Called with the layer's index at the start of `forward` while rank 0 launches a step that
    # asked for it (`Executor.execute_model`'s `layer_hook`): there the engine core may publish
    # the step before this one, between two of this one's layers.
    layer_hook: Callable[[int], None] | None = None

    def __init__(self, spec: KVCacheSpec, num_pages: int, device: torch.device):
        self.spec = spec
        self.num_pages = num_pages
        self.device = device
        self.kv_caches: list[torch.Tensor] = [
            torch.zeros(num_pages, 2, spec.page_size, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype, device=device)
            for _ in range(spec.num_layers)
        ]
        self.scale = spec.head_dim ** -0.5

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> None:
        """Prepare this step's metadata (CPU work, once per step)."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                rotary: Rotary | None = None, q_norm: HeadNorm | None = None,
                k_norm: HeadNorm | None = None) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the step's new tokens → o [T, Hq, D] (into `out` when
        given: piecewise CUDA graphs read it from a fixed buffer).

        With `q_norm` and `k_norm` (given together), q and k are not normalised yet: the backend
        applies them to every head first. With `rotary`, q and k are not rotated yet: the backend
        rotates them to `positions` (int64 [T]) after any norm, as it writes them. The model's
        layers hand both over so that a GPU backend can fuse them with the K/V write; q may be
        normalised and rotated in place. Writes k/v into the layer's pages at the planned slot
        mapping first, then attends causally over each request's cached and new tokens."""

    def write_kv(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter the new tokens' K and V into their pages (one index_put; capturable in a CUDA graph)."""
        pages, offsets = split_slots(slot_mapping, self.spec.page_size)
        scatter_kv(self.kv_caches[layer_id], pages, offsets, k, v, self.spec.kv_scales(layer_id))


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448: e4m3fn has no infinity; beyond it, NaN on CUDA


def quantize_kv(kv: torch.Tensor, k_scale: float, v_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """[T, 2, Hkv, D] of K and V → the values FP8 pages store: divided by the layer's scales,
    clamped to e4m3's range, rounded to nearest."""
    scales = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=kv.device).view(1, 2, 1, 1)
    return (kv.float() / scales).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Values read from FP8 pages back in `dtype`, times their scale (in float32)."""
    return (stored.float() * scale).to(dtype) if scale != 1.0 else stored.to(dtype)


def split_slots(slot_mapping: torch.Tensor, page_size: int, pages_out: torch.Tensor | None = None,
                offsets_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """slot = page * page_size + offset → (page, offset); into `*_out` when given (graph buffers)."""
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor", out=pages_out)
    offsets = torch.remainder(slot_mapping, page_size, out=offsets_out)
    return pages, offsets


def stacked_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[T, 2, Hkv, D] of each token's K and V. When V directly follows K in memory (both slices of
    one fused qkv projection, as in every Llama-family layer) this is a view; otherwise a stack."""
    t, h, d = k.shape
    # One storage as well as adjacent addresses: two tensors the allocator happened to place back to
    # back are not one view.
    adjacent = (v.shape == k.shape and v.stride() == k.stride() and k.stride(2) == 1 and k.stride(1) == d
                and v.data_ptr() == k.data_ptr() + h * d * k.element_size()
                and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())
    if adjacent:
        return k.as_strided((t, 2, h, d), (k.stride(0), h * d, d, 1))
    return torch.stack((k, v), dim=1)


def scatter_kv(cache: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """cache[pages[i], :, offsets[i]] = (k[i], v[i]) for every new token i: one index_put. FP8
    pages take them quantized with the layer's (k_scale, v_scale) `scales`.

    The copy moves 8-byte words where the layouts allow (a bit-exact reinterpretation): the index
    kernel's cost is per element, and 2-byte elements made it several times slower than the memory
    traffic (a 16k-token prefill chunk: 250 us per layer)."""
    src = stacked_kv(k, v)
    src = quantize_kv(src, *scales, cache.dtype) if cache.dtype == torch.float8_e4m3fn else src.to(cache.dtype)
    words_dst, words_src = _as_words(cache), _as_words(src)
    if words_dst is not None and words_src is not None:
        cache, src = words_dst, words_src
    elif cache.dtype == torch.float8_e4m3fn:  # torch's index kernels take no float8 dtype: move the bytes
        cache, src = cache.view(torch.uint8), src.view(torch.uint8)
    cache[pages, :, offsets] = src


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """`t` viewed as int64 along its last dimension, or None when its layout does not allow it."""
    per_word = 8 // t.element_size()
    if t.element_size() > 8 or t.stride(-1) != 1 or t.shape[-1] % per_word or t.storage_offset() % per_word:
        return None
    if any(s % per_word for s in t.stride()[:-1]):
        return None
    return t.view(torch.int64)

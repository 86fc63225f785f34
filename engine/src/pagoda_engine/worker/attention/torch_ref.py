"""The reference attention backend: gather each request's pages, run PyTorch's
`scaled_dot_product_attention`. Slow, exact, any device; GPU kernels are tested against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda_engine.worker.attention.base import AttentionBackend, AttentionBatch, HeadNorm, Rotary, dequantize_kv


@dataclass
class _RequestPlan:
    start: int  # first of this request's new tokens in the step's concatenated q
    query_len: int
    pages: torch.Tensor  # int64 [seq_len]: page of each cached position 0..seq_len-1
    offsets: torch.Tensor  # int64 [seq_len]: slot within that page
    mask: torch.Tensor | None  # bool [query_len, seq_len], True = may attend; None = see is_causal
    is_causal: bool  # no cached tokens: plain causal attention (lets SDPA pick a fused kernel)


class TorchRefBackend(AttentionBackend):
    name = "torch"

    def __init__(self, spec, num_pages, device):
        super().__init__(spec, num_pages, device)
        self._batch: AttentionBatch | None = None
        self._plans: list[_RequestPlan] = []

    def plan(self, batch: AttentionBatch) -> None:
        page_size = self.spec.page_size
        if batch.slot_mapping.numel() != batch.num_tokens:
            raise ValueError(f"slot_mapping has {batch.slot_mapping.numel()} slots for {batch.num_tokens} new tokens")
        plans = []
        start = 0
        for query_len, seq_len, page_table in zip(batch.query_lens, batch.seq_lens, batch.page_tables):
            if not 0 < query_len <= seq_len:
                raise ValueError(f"query_len {query_len} must be in [1, seq_len {seq_len}]")
            num_pages = -(-seq_len // page_size)
            if len(page_table) < num_pages:
                raise ValueError(f"page table of {len(page_table)} pages cannot hold {seq_len} tokens")
            positions = torch.arange(seq_len)
            table = torch.tensor(page_table[:num_pages], dtype=torch.int64)
            pages = table[positions // page_size]
            offsets = positions % page_size
            mask = None
            is_causal = query_len == seq_len and query_len > 1
            if query_len > 1 and not is_causal:
                # Query i sits at absolute position seq_len - query_len + i and sees positions up to it.
                query_pos = torch.arange(seq_len - query_len, seq_len).unsqueeze(1)
                mask = (positions.unsqueeze(0) <= query_pos).to(self.device)
            plans.append(_RequestPlan(start, query_len, pages.to(self.device), offsets.to(self.device), mask, is_causal))
            start += query_len
        self._batch = batch
        self._plans = plans

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                rotary: Rotary | None = None, q_norm: HeadNorm | None = None,
                k_norm: HeadNorm | None = None) -> torch.Tensor:
        if self._batch is None:
            raise RuntimeError("plan(batch) must run before forward")
        if self.layer_hook is not None:
            self.layer_hook(layer_id)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        self.write_kv(layer_id, k, v, self._batch.slot_mapping)
        cache = self.kv_caches[layer_id]
        group = q.shape[1] // self.spec.num_kv_heads
        if out is None:
            out = torch.empty_like(q)
        k_scale, v_scale = self.spec.kv_scales(layer_id)
        # FP8 pages are gathered as bytes (torch's index kernels take no float8 dtype) and
        # dequantized here: the exact reference for the kernels that fold the scales.
        stored = cache.view(torch.uint8) if self.spec.quantized else cache
        for p in self._plans:
            # [seq_len, Hkv, D] → [Hq, seq_len, D]; each KV head serves `group` consecutive q heads.
            keys = dequantize_kv(stored[p.pages, 0, p.offsets].view(cache.dtype), k_scale, q.dtype)
            values = dequantize_kv(stored[p.pages, 1, p.offsets].view(cache.dtype), v_scale, q.dtype)
            keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            values = values.transpose(0, 1).repeat_interleave(group, dim=0)
            query = q[p.start:p.start + p.query_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=p.mask, is_causal=p.is_causal,
                                               scale=self.scale)
            out[p.start:p.start + p.query_len] = o.transpose(0, 1)
        return out

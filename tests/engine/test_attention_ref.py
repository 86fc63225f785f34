"""The reference paged-attention backend equals plain causal attention on contiguous K/V.

Batches mix decodes and prefill chunks that start after cached tokens (prefix hits, earlier
chunks); pages come from a shuffled pool, so a request's pages are neither contiguous nor in order.
The oracle is a float64 softmax over each request's whole sequence, written out here.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagoda_engine.worker.attention import AttentionBatch, KVCacheSpec, get_attention_backend
from pagoda_engine.worker.attention.torch_ref import TorchRefBackend

CPU = torch.device("cpu")
NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [Lq, Hq, D] for the last Lq positions of k/v [L, Hkv, D]; float64 softmax."""
    lq, hq, d = q.shape
    seq_len, hkv, _ = k.shape
    group = hq // hkv
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / d ** 0.5
    query_pos = torch.arange(seq_len - lq, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float()


def slots_for(table: list[int], start: int, end: int, page_size: int) -> torch.Tensor:
    return torch.tensor([table[p // page_size] * page_size + p % page_size for p in range(start, end)])


@pytest.mark.parametrize("page_size", [16, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_equals_contiguous_causal_attention(page_size, seed):
    gen = torch.Generator().manual_seed(seed)
    # (cached tokens, new tokens): decodes first, then prefills from scratch and after a prefix.
    requests = [(7, 1), (16, 1), (33, 1), (0, 13), (8, 11), (page_size, 2 * page_size + 3), (0, 1)]
    num_pages = 64
    spec = KVCacheSpec(num_layers=2, num_kv_heads=NUM_KV_HEADS, num_qo_heads=NUM_QO_HEADS, head_dim=HEAD_DIM,
                       page_size=page_size, dtype=torch.float32)
    backend = TorchRefBackend(spec, num_pages, CPU)
    free = list(range(1, num_pages))
    random.Random(seed).shuffle(free)

    tables, keys, values, queries = [], [], [], []
    for cached, new in requests:
        seq_len = cached + new
        tables.append([free.pop() for _ in range(-(-seq_len // page_size))])
        keys.append(torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        values.append(torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        queries.append(torch.randn(new, NUM_QO_HEADS, HEAD_DIM, generator=gen))

    layer = 1
    # The earlier steps' K/V are already in the pages.
    for (cached, _), table, k, v in zip(requests, tables, keys, values):
        if cached:
            backend.write_kv(layer, k[:cached], v[:cached], slots_for(table, 0, cached, page_size))

    slot_mapping = torch.cat([slots_for(t, c, c + n, page_size) for (c, n), t in zip(requests, tables)])
    batch = AttentionBatch(query_lens=[n for _, n in requests], seq_lens=[c + n for c, n in requests],
                           page_tables=tables, slot_mapping=slot_mapping, num_decodes=3)
    backend.plan(batch)
    out = backend.forward(layer, torch.cat(queries),
                          torch.cat([k[c:] for (c, _), k in zip(requests, keys)]),
                          torch.cat([v[c:] for (c, _), v in zip(requests, values)]))

    assert out.shape == (batch.num_tokens, NUM_QO_HEADS, HEAD_DIM)
    for got, q, k, v in zip(out.split(batch.query_lens), queries, keys, values):
        torch.testing.assert_close(got, causal_attention(q, k, v), atol=1e-5, rtol=1e-5)
    # The new tokens' K/V landed in their pages; the other layer's cache was not touched.
    for (cached, new), table, k, v in zip(requests, tables, keys, values):
        slots = slots_for(table, 0, cached + new, page_size)
        cache = backend.kv_caches[layer]
        torch.testing.assert_close(cache[slots // page_size, 0, slots % page_size], k)
        torch.testing.assert_close(cache[slots // page_size, 1, slots % page_size], v)
    assert not backend.kv_caches[0].any()


def test_page_table_too_short_for_seq_len_is_rejected():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, num_qo_heads=1, head_dim=4, page_size=4, dtype=torch.float32)
    backend = TorchRefBackend(spec, 8, CPU)
    with pytest.raises(ValueError, match="cannot hold 9 tokens"):
        backend.plan(AttentionBatch([9], [9], [[1, 2]], torch.arange(4, 13)))


def test_factory_picks_backends_by_name_and_device():
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, num_qo_heads=2, head_dim=4, page_size=4, dtype=torch.float32)
    assert isinstance(get_attention_backend("torch", spec, 4, CPU), TorchRefBackend)
    assert isinstance(get_attention_backend("auto", spec, 4, CPU), TorchRefBackend)
    backend = get_attention_backend("torch", spec, 4, CPU)
    assert len(backend.kv_caches) == 1 and backend.kv_caches[0].shape == (4, 2, 4, 1, 4)
    # FlashInfer is CUDA-only: on CPU it is refused (not installed, or no CUDA device), never silently replaced.
    with pytest.raises((ImportError, ValueError), match="flashinfer"):
        get_attention_backend("flashinfer", spec, 4, CPU)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        get_attention_backend("triton", spec, 4, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("fused", [True, False], ids=["kv-slices-of-qkv", "separate-k-v"])
def test_write_kv_puts_each_token_k_and_v_in_its_slot(fused, dtype):
    """One scatter writes K and V (as 8-byte words where the layout allows, bit-exact): from a view
    when they are adjacent slices of one qkv output (no copy made), from a stack otherwise; every
    other slot stays untouched."""
    from pagoda_engine.worker.attention.base import stacked_kv

    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, num_qo_heads=4, head_dim=8, page_size=4, dtype=dtype)
    backend = TorchRefBackend(spec, 6, CPU)
    t, kv = 5, 2 * 8
    if fused:
        qkv = torch.randn(t, 4 * 8 + 2 * kv, dtype=dtype)
        _, k, v = qkv.split([4 * 8, kv, kv], dim=-1)
    else:
        k, v = torch.randn(t, kv, dtype=dtype), torch.randn(t, kv, dtype=dtype)
    k, v = k.view(t, 2, 8), v.view(t, 2, 8)
    stacked = stacked_kv(k, v)
    assert torch.equal(stacked[:, 0], k) and torch.equal(stacked[:, 1], v)
    assert (stacked.data_ptr() == k.data_ptr()) == fused
    slots = torch.tensor([5, 6, 22, 3, 12])  # pages 1, 1, 5, 0, 3
    backend.write_kv(0, k, v, slots)
    cache = backend.kv_caches[0]
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(cache[slot // 4, 0, slot % 4], k[i]) and torch.equal(cache[slot // 4, 1, slot % 4], v[i])
    written = torch.zeros(6, 4, dtype=torch.bool)
    written[slots // 4, slots % 4] = True
    assert cache.permute(0, 2, 1, 3, 4)[~written].abs().sum() == 0


def test_word_view_only_where_the_layout_allows():
    from pagoda_engine.worker.attention.base import _as_words

    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert _as_words(x).shape == (3, 2) and torch.equal(_as_words(x).view(torch.bfloat16), x)
    assert _as_words(x[:, 1:5]) is None  # starts mid-word
    assert _as_words(x[:, :6]) is None  # row stride 8, width 6: not whole words
    assert _as_words(x.t()) is None  # last dimension not contiguous
    assert _as_words(torch.randn(3, 5)) is None  # 5 float32 values are not whole words


def test_k_and_v_of_two_storages_placed_back_to_back_are_stacked_not_viewed():
    """K and V that an allocator placed at adjacent addresses but in two storages (separate
    projections) are copied into a stack: a view over both would reach past K's storage."""
    from pagoda_engine.worker.attention.base import stacked_kv

    t, h, d = 1, 2, 8
    buf = bytearray(2 * t * h * d * 4)
    half = len(buf) // 2
    k = torch.frombuffer(memoryview(buf)[:half], dtype=torch.float32).view(t, h, d)
    v = torch.frombuffer(memoryview(buf)[half:], dtype=torch.float32).view(t, h, d)
    k.copy_(torch.randn(t, h, d))
    v.copy_(torch.randn(t, h, d))
    assert v.data_ptr() == k.data_ptr() + h * d * 4
    assert v.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    stacked = stacked_kv(k, v)
    assert stacked.data_ptr() != k.data_ptr()
    assert torch.equal(stacked[:, 0], k) and torch.equal(stacked[:, 1], v)

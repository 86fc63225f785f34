"""What the CUDA-graph code decides on the host, checked without a GPU: the sizes graphs are
captured at, and when a segment's q, k and v can be copied out as the projection's one output."""

import torch

from pagoda_engine.worker.cuda_graphs import MAX_PIECEWISE_TOKENS, _fused_projection, graph_batch_sizes, piecewise_token_sizes


def test_piecewise_sizes_end_at_the_step_budget():
    assert piecewise_token_sizes(MAX_PIECEWISE_TOKENS)[-1] == MAX_PIECEWISE_TOKENS
    assert piecewise_token_sizes(48) == [8, 16, 32, 48]
    assert piecewise_token_sizes(5) == [5]
    assert piecewise_token_sizes(100) == [8, 16, 32, 48, 64, 96, 100]


def test_piecewise_sizes_rise_and_pad_little_at_the_bottom():
    sizes = piecewise_token_sizes(MAX_PIECEWISE_TOKENS)
    assert sizes == sorted(set(sizes))
    # From 16 tokens up a step pads by at most half its tokens (the padding is GEMM rows that cost
    # little when they read the weights anyway).
    assert all(b <= 2 * a for a, b in zip(sizes[1:], sizes[2:]))


def test_decode_graph_sizes_cover_every_batch_up_to_the_largest():
    sizes = graph_batch_sizes(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    assert all(any(s >= n for s in sizes) for n in range(1, 101))


def _qkv(tokens=5, q_heads=4, kv_heads=2, head_dim=8):
    out = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim)
    q, k, v = out.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return out, q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


def test_slices_of_one_fused_projection_are_copied_as_one():
    out, q, k, v = _qkv()
    assert _fused_projection(q, k, v) is out


def test_separate_tensors_or_another_order_are_copied_one_by_one():
    _, q, k, v = _qkv()
    assert _fused_projection(q.clone(), k, v) is None  # q normalised per head (Qwen3): a tensor of its own
    assert _fused_projection(q, v, k) is None  # k and v swapped
    _, q2, k2, v2 = _qkv()
    assert _fused_projection(q, k2, v2) is None  # slices of different projections

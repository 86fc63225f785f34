"""What the CUDA-graph code decides on the host, checked without a GPU: the sizes graphs are
captured at, and when a segment's q, k and v can be copied out as the projection's one output."""

import torch

from pagoda_engine.worker.cuda_graphs import (MAX_PIECEWISE_TOKENS, _fused_projection, drop_slow_sizes,
                                              graph_batch_sizes, piecewise_token_sizes, sizes_to_measure)


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


def test_piecewise_candidates_above_256_tokens_are_32_apart_and_measured():
    sizes = piecewise_token_sizes(512)
    assert sizes[sizes.index(256):] == [256, 288, 320, 352, 384, 416, 448, 480, 512]
    assert sizes_to_measure(sizes) == [288, 320, 352, 384, 416, 448, 480, 512]
    assert sizes_to_measure(piecewise_token_sizes(300)) == [288, 300]
    assert sizes_to_measure(piecewise_token_sizes(200)) == []


def test_a_size_some_larger_one_runs_as_fast_is_left_out():
    # A layer's GEMMs in µs, as an H100 runs Llama-3.1-8B's: cuBLAS is slow at 288, 416, 448
    # and 480 rows; 512 costs less than 448 and 480, and as much as 416's neighbours.
    cost = {288: 280, 320: 265, 352: 287, 384: 288, 416: 330, 448: 452, 480: 324, 512: 317}
    sizes = piecewise_token_sizes(512)
    kept = drop_slow_sizes(sizes, cost)
    assert kept == [8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 352, 384, 512]
    # Every step still has a size to pad to, and the padded size never costs more than the
    # candidate it would have taken before.
    for tokens in range(1, 513):
        before = next(s for s in sizes if s >= tokens)
        after = next(s for s in kept if s >= tokens)
        assert after >= before and cost.get(after, 0) <= cost.get(before, float("inf"))


def test_the_largest_size_and_sizes_without_a_cost_always_stay():
    sizes = [8, 256, 288, 320]
    assert drop_slow_sizes(sizes, {288: 10.0, 320: 99.0}) == [8, 256, 288, 320]  # the largest stays, however dear
    assert drop_slow_sizes(sizes, {288: 50.0, 320: 40.0}) == [8, 256, 320]
    assert drop_slow_sizes(sizes, {320: 40.0}) == [8, 256, 288, 320]  # 288 was not measured
    assert drop_slow_sizes(sizes, {}) == sizes


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

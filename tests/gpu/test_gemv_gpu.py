"""The matrix-vector kernels (`model/gemv_triton.py`), one row and a few, against float32 products of
the same bf16/fp16 weights, at Llama-3.1-8B's and Qwen3-30B-A3B's projection shapes and uneven ones;
the layers' switch (one CUDA row or a few take them, more rows take `F.linear`); and a CUDA-graph
replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_support import CUDA, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

SHAPES = {  # (N, K)
    "llama q/k/v": (6144, 4096),
    "llama down": (4096, 14336),
    "qwen3-moe q/k/v": (5120, 2048),
    "qwen3-moe router": (128, 2048),
    "qwen3-moe lm head": (151936, 2048),
    "uneven": (1001, 1032),
    "uneven tall": (1031, 1032),
    "one column": (1, 2048),
}


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 output rounding on top of float32 sums in another order."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gemv_matches_a_float32_product(shape, dtype):
    from pagoda_engine.worker.model.gemv_triton import gemv, linear_applies

    n, k = SHAPES[shape]
    w = (torch.randn(n, k, device=CUDA) * k ** -0.5).to(dtype)
    x = torch.randn(1, k, device=CUDA).to(dtype)
    b = torch.randn(n, device=CUDA).to(dtype)
    assert linear_applies(x, w)
    _close(gemv(x, w), x.float() @ w.float().T)
    _close(gemv(x, w, b), x.float() @ w.float().T + b.float())


@pytest.mark.parametrize("inter,hidden", [(14336, 4096), (768, 2048), (520, 1032)])
def test_gated_gemv_is_silu_of_gate_times_up(inter, hidden):
    from pagoda_engine.worker.model.gemv_triton import gemv_silu_and_mul

    w = (torch.randn(2 * inter, hidden, device=CUDA) * hidden ** -0.5).bfloat16()
    x = torch.randn(1, hidden, device=CUDA).bfloat16() * 2
    gate, up = (x.float() @ w.float().T).chunk(2, dim=-1)
    _close(gemv_silu_and_mul(x, w), F.silu(gate) * up)


@pytest.mark.parametrize("rows", [2, 6, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["llama q/k/v", "llama down", "qwen3-moe q/k/v", "qwen3-moe lm head", "uneven tall"])
def test_few_rows_match_a_float32_product(shape, dtype, rows):
    """The few-row kernel (`_rows_kernel`) with and without a bias, the rows a strided view."""
    from pagoda_engine.worker.model.gemv_triton import gemv, linear_applies

    n, k = SHAPES[shape]
    w = (torch.randn(n, k, device=CUDA) * k ** -0.5).to(dtype)
    x = torch.randn(rows, 2 * k, device=CUDA).to(dtype)[:, k:]
    b = torch.randn(n, device=CUDA).to(dtype)
    assert linear_applies(x, w)
    _close(gemv(x, w), x.float() @ w.float().T)
    _close(gemv(x, w, b), x.float() @ w.float().T + b.float())


@pytest.mark.parametrize("rows", [2, 6, 16])
@pytest.mark.parametrize("inter,hidden", [(14336, 4096), (520, 1032)])
def test_gated_few_rows_are_silu_of_gate_times_up(inter, hidden, rows):
    from pagoda_engine.worker.model.gemv_triton import gemv_silu_and_mul

    w = (torch.randn(2 * inter, hidden, device=CUDA) * hidden ** -0.5).bfloat16()
    x = torch.randn(rows, hidden, device=CUDA).bfloat16() * 2
    gate, up = (x.float() @ w.float().T).chunk(2, dim=-1)
    _close(gemv_silu_and_mul(x, w), F.silu(gate) * up)


def test_layers_take_the_kernels_for_few_rows_only():
    """One row: the one-row kernel; two to MAX_ROWS against a weight of ROWS_MIN_N rows or more:
    the few-row kernel; more rows, or fewer weight rows: `F.linear`."""
    from pagoda_engine.worker.model.gemv_triton import MAX_ROWS, ROWS_MIN_N, gemv, gemv_silu_and_mul
    from pagoda_engine.worker.model.layers import GatedMLP, LinearBase, linear

    tall = torch.randn(ROWS_MIN_N, 512, device=CUDA).bfloat16()
    many = torch.randn(MAX_ROWS + 1, 512, device=CUDA).bfloat16()
    assert torch.equal(linear(many[:5], tall), gemv(many[:5], tall))
    assert torch.equal(linear(many, tall), F.linear(many, tall))
    w = torch.randn(256, 512, device=CUDA).bfloat16()
    x = torch.randn(2, 512, device=CUDA).bfloat16()
    assert torch.equal(linear(x[:1], w), gemv(x[:1], w))
    assert torch.equal(linear(x, w), F.linear(x, w))
    # Not served (a transposed weight, a float32 row): F.linear, unchanged.
    assert torch.equal(linear(x[:1], w.T.contiguous().T), F.linear(x[:1], w))
    assert torch.equal(linear(x[:1].float(), w.float()), F.linear(x[:1].float(), w.float()))

    mlp = GatedMLP(512, 384).to(device=CUDA, dtype=torch.bfloat16)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=512 ** -0.5)
    one = mlp(x[:1])
    assert torch.equal(one, mlp.down_proj(gemv_silu_and_mul(x[:1], mlp.gate_up_proj.weight)))
    _close(one, mlp(x)[:1].float())
    proj = LinearBase(512, 256, bias=True).to(device=CUDA, dtype=torch.bfloat16)
    torch.nn.init.normal_(proj.weight), torch.nn.init.normal_(proj.bias)
    _close(proj(x[:1]), F.linear(x[:1].float(), proj.weight.float(), proj.bias.float()))


@pytest.mark.parametrize("rows", [1, 8])
def test_gemv_replays_in_a_cuda_graph(rows):
    from pagoda_engine.worker.model.gemv_triton import gemv, gemv_silu_and_mul

    w = torch.randn(2048, 1024, device=CUDA).bfloat16()
    x = torch.randn(rows, 1024, device=CUDA).bfloat16()
    gemv(x, w), gemv_silu_and_mul(x, w)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, act = gemv(x, w), gemv_silu_and_mul(x, w)
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, gemv(x, w)) and torch.equal(act, gemv_silu_and_mul(x, w))


NORM_SHAPES = {  # (N, K, gated)
    "llama q/k/v": (6144, 4096, False),
    "llama gate+up": (14336, 4096, True),
    "qwen3-moe q/k/v": (5120, 2048, False),
    "qwen3-moe router": (128, 2048, False),
    "uneven gated": (520, 1032, True),
}


@pytest.mark.parametrize("first_layer", [False, True], ids=["add-and-norm", "norm"])
@pytest.mark.parametrize("shape", sorted(NORM_SHAPES))
def test_norm_folded_into_the_projection(shape, first_layer):
    """`gemv_rmsnorm`: the layer's add-and-norm and the projection after it in one kernel. The new
    residual is x + residual rounded once, exactly; the normalised row (written for an MoE block)
    is FlashInfer's RMSNorm's, to a rounding step at a few places (its float32 sums run in another
    order); the projection is float32 products of that row."""
    import flashinfer

    from pagoda_engine.worker.model.gemv_triton import gemv_rmsnorm, norm_applies

    n, k, gated = NORM_SHAPES[shape]
    gen = torch.Generator(device=CUDA).manual_seed(n + k)
    w = (torch.randn(2 * n if gated else n, k, device=CUDA, generator=gen) * k ** -0.5).bfloat16()
    x = (torch.randn(1, k, device=CUDA, generator=gen) * 3).bfloat16()
    residual = None if first_layer else (torch.randn(1, k, device=CUDA, generator=gen) * 5).bfloat16()
    norm_w = (1 + 0.3 * torch.randn(k, device=CUDA, generator=gen)).bfloat16()
    bias = None if gated else torch.randn(n, device=CUDA, generator=gen).bfloat16()
    assert norm_applies(x, residual, norm_w, w)
    y, res_out, normed_row = gemv_rmsnorm(x, residual, norm_w, 1e-5, w, bias, gated=gated, normed_out=True)
    if first_layer:
        assert res_out is x  # the stream starts as the embedding, as the unfused layer has it
        expected = flashinfer.rmsnorm(x, norm_w, 1e-5)
    else:
        assert torch.equal(res_out, (x.float() + residual.float()).bfloat16())
        expected = x.clone()
        flashinfer.fused_add_rmsnorm(expected, residual.clone(), norm_w, 1e-5)
    torch.testing.assert_close(normed_row, expected, atol=0, rtol=1e-2)  # at most a rounding step apart
    assert (normed_row != expected).float().mean() < 0.01
    product = normed_row.float() @ w.float().T
    if gated:
        gate, up = product.chunk(2, dim=-1)
        _close(y, F.silu(gate) * up)
    else:
        _close(y, product + bias.float())


def test_layers_fold_the_norm_for_one_row_only():
    """A dense layer's qkv and MLP halves, and an MoE block, give the unfused path's outputs at one
    row (to bf16 rounding of the normalised row); two rows take the unfused path exactly."""
    from pagoda_engine.worker.model.layers import ColumnParallelLinear, GatedMLP, RMSNorm, norm_and_linear
    from pagoda_engine.worker.model.moe import FusedMoE

    torch.manual_seed(0)
    norm = RMSNorm(512, 1e-5).to(device=CUDA, dtype=torch.bfloat16)
    norm.weight.data.copy_(1 + 0.2 * torch.randn(512, device=CUDA))
    mlp = GatedMLP(512, 384).to(device=CUDA, dtype=torch.bfloat16)
    moe = FusedMoE(16, 4, 512, 128, renormalize=True).to(device=CUDA, dtype=torch.bfloat16)
    for p in [*mlp.parameters(), *moe.parameters()]:
        torch.nn.init.normal_(p, std=512 ** -0.5)
    w = (torch.randn(768, 512, device=CUDA) * 512 ** -0.5).bfloat16()
    qkv = ColumnParallelLinear(512, 768).to(device=CUDA, dtype=torch.bfloat16)
    qkv.weight.data.copy_(w)
    x = torch.randn(2, 512, device=CUDA).bfloat16()
    residual = torch.randn(2, 512, device=CUDA).bfloat16()

    def unfused(module, x, residual):
        x, residual = norm(x.clone(), residual.clone())
        return module(x), residual

    for one in (False, True):
        xs, rs = (x[:1], residual[:1]) if one else (x, residual)
        got_y, got_r = norm_and_linear(norm, xs.clone(), rs.clone(), qkv)
        want_y, want_r = unfused(lambda t: t @ w.T, xs, rs)
        for (got, got_res), (want, want_res) in [((got_y, got_r), (want_y, want_r)),
                                                 (mlp.normed(norm, xs.clone(), rs.clone()), unfused(mlp, xs, rs)),
                                                 (moe.normed(norm, xs.clone(), rs.clone()), unfused(moe, xs, rs))]:
            assert torch.equal(got_res, want_res)
            if one:
                _close(got, want.float())
            else:
                assert torch.equal(got, want)

"""The one-row matrix-vector kernels (`model/gemv_triton.py`) under Triton's CPU interpreter,
against float32 products, on small shapes: even and uneven K, a bias, the gated form.

Skips where Triton does not import (CPU CI); the kernels at Llama-3.1-8B's and Qwen3-30B-A3B's
shapes on a GPU, and the layers' switch, are tests/gpu/test_gemv_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from triton_interpreter import import_kernels

kernels = import_kernels("pagoda_engine.worker.model.gemv_triton")

# Without a GPU, `tl.sum` is interpreted only when the switch was on as Triton was imported: run
# with TRITON_INTERPRET=1 set for the whole process (as tests/engine/test_rope_kv_kernel.py's norm).
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="without a GPU these kernels run only with TRITON_INTERPRET=1 set")


@pytest.mark.parametrize("n,k", [(6, 64), (5, 40), (1, 2048), (3, 4104)])
def test_gemv_matches_a_float32_product(n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(1, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    expected = x.float() @ w.float().T
    torch.testing.assert_close(kernels.gemv(x, w).float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.gemv(x, w, b).float(), expected + b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("inter,k", [(4, 64), (7, 40)])
def test_gated_gemv_is_silu_of_gate_times_up(inter, k):
    gen = torch.Generator().manual_seed(inter)
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    x = torch.randn(1, k, generator=gen).bfloat16()
    gate, up = (x.float() @ w.float().T).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gemv_silu_and_mul(x, w).float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (40, 24)])
def test_experts_gemv_matches_the_reference_loop(num_tokens, hidden, inter, fp8):
    """The MoE's one- and two-token path (`fused_moe_triton._experts_gemv`), with one slot routed to
    an expert held by another rank (id = the local count): its share is left out. FP8 experts:
    e4m3 weights with a scale per expert and row, against the reference's widened weights."""
    from pagoda_engine.worker.model.fp8_math import quantize_rows
    from pagoda_engine.worker.model.moe import fused_experts_reference

    moe = import_kernels("pagoda_engine.worker.model.fused_moe_triton")
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    experts, top_k = 6, 3
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).bfloat16()
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[0, 1] = experts  # held elsewhere
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1).bfloat16()
    local = ids < experts
    scales = (None, None)
    if fp8:
        (w13, s13), (w2, s2) = quantize_rows(w13), quantize_rows(w2)
        scales = (s13, s2)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), (weights * local).float(),
                                       torch.where(local, ids, 0), *scales)
    got = moe._experts_gemv(x, w13, w2, weights, ids, *scales)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(64, 128), (70, 136), (33, 512)])
def test_few_row_kernel_matches_a_float32_product(rows, n, k):
    """`_rows_kernel` (two to MAX_ROWS rows), plain with a bias and gated, with K tiles that do and
    do not divide K, a column block cut short, and the rows a strided view (every other row of a
    wider tensor, as a sliced activation is). float16: the interpreter multiplies bfloat16 tiles
    as their raw bits (the GPU tests cover bfloat16)."""
    gen = torch.Generator().manual_seed(rows * n + k)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).half()
    wide = torch.randn(rows, 2 * k, generator=gen).half()
    x = wide[:, :k]  # rows 2k apart
    b = torch.randn(n, generator=gen).half()
    expected = x.float() @ w.float().T
    torch.testing.assert_close(kernels.gemv(x, w).float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.gemv(x, w, b).float(), expected + b.float(), rtol=1e-2, atol=1e-2)
    w13 = torch.cat([w, w.flip(0)])  # gate rows over up rows
    gate, up = (x.float() @ w13.float().T).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gemv_silu_and_mul(x, w13).float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2)



# --- FP8 weights (`--quantization fp8`): e4m3 rows widened in registers, each row's sums scaled ------


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 row scales, the weight they stand for in float32)."""
    from pagoda_engine.worker.model.fp8_math import quantize_rows

    q, s = quantize_rows(w)
    return q, s, q.float() * s[:, None]


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(6, 64), (70, 136), (3, 4104)])
def test_fp8_weights_give_the_product_with_their_scaled_values(rows, n, k):
    """Plain, with a bias, and gated: x (q × s)^T in float32 for x as it is (weight-only: the rows
    are not quantized). One row: `_gemv_kernel` in bfloat16; more: `_rows_kernel` in float16 (see
    above)."""
    gen = torch.Generator().manual_seed(rows * n + k)
    dtype = torch.bfloat16 if rows == 1 else torch.float16
    q, s, w = _fp8(torch.randn(n, k, generator=gen) * k ** -0.5)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    expected = x.float() @ w.T
    torch.testing.assert_close(kernels.gemv(x, q, None, s).float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.gemv(x, q, b, s).float(), expected + b.float(), rtol=1e-2, atol=1e-2)
    q13, s13, w13 = _fp8(torch.randn(2 * n, k, generator=gen) * k ** -0.5)
    gate, up = (x.float() @ w13.T).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gemv_silu_and_mul(x, q13, s13).float(), F.silu(gate) * up,
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("k", [64, 200])
def test_fp8_weights_after_the_folded_rmsnorm(gated, k):
    """`gemv_rmsnorm` on e4m3 weights: h = x + residual, the row normalised as FlashInfer's
    RMSNorm (float32, times the weight, rounded to bf16), then projected by the scaled weights."""
    gen = torch.Generator().manual_seed(k + gated)
    n = 24
    q, s, w = _fp8(torch.randn(2 * n if gated else n, k, generator=gen) * k ** -0.5)
    x, residual = (torch.randn(1, k, generator=gen).bfloat16() for _ in range(2))
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).bfloat16()
    y, res_out = kernels.gemv_rmsnorm(x, residual, norm_w, 1e-5, q, gated=gated, weight_scale=s)
    h = x.float() + residual.float()
    a = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()).bfloat16().float()
    expected = a @ w.T
    if gated:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    # The new residual stream, rounded to bf16 (the interpreter truncates where the GPU rounds).
    torch.testing.assert_close(res_out.float(), h, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(y.float(), expected, rtol=1e-2, atol=1e-2)


def test_fp8_weights_need_their_scales_and_others_none():
    q, s, _ = _fp8(torch.randn(8, 64))
    x = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match="without row scales"):
        kernels.gemv(x, q)
    with pytest.raises(ValueError, match="with row scales"):
        kernels.gemv(x, q.float().bfloat16(), None, s)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.gemv(x, q, None, s.double())

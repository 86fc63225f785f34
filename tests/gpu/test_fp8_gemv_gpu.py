"""The matrix-vector kernels on FP8 weights (`--quantization fp8` decode rows, `model/gemv_triton.py`)
at Llama-3.1-8B's projection shapes: one row, the few-row kernel up to MAX_ROWS, the gated
MLP and the folded RMSNorm, against float32 products of the scaled e4m3 weights; the layers'
switch (a few rows take them, more rows cuBLASLt's FP8 GEMM); and each shape's time against
`fp8_linear` (quantize + `torch._scaled_mm`) and the bf16 kernel, printed for the lead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_support import CUDA, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

SHAPES = {  # (N, K)
    "llama q/k/v": (6144, 4096),
    "llama o": (4096, 4096),
    "llama gate+up": (28672, 4096),
    "llama down": (4096, 14336),
    "uneven": (1031, 1032),
}


def _fp8(n: int, k: int):
    from pagoda_engine.worker.model.fp8_math import quantize_rows

    q, s = quantize_rows(torch.randn(n, k, device=CUDA) * k ** -0.5)
    return q, s, q.float() * s[:, None]


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_gemv_is_the_product_with_the_scaled_weights(shape, rows):
    from pagoda_engine.worker.model.gemv_triton import gemv, gemv_silu_and_mul, linear_applies

    n, k = SHAPES[shape]
    q, s, w = _fp8(n, k)
    x = torch.randn(rows, k, device=CUDA).bfloat16()
    b = torch.randn(n, device=CUDA).bfloat16()
    assert linear_applies(x, q) == (rows == 1 or n >= 1024)
    if not linear_applies(x, q):
        return
    _close(gemv(x, q, None, s), x.float() @ w.T)
    _close(gemv(x, q, b, s), x.float() @ w.T + b.float())
    gate, up = (x.float() @ w.T).chunk(2, dim=-1) if n % 2 == 0 else (None, None)
    if gate is not None:
        _close(gemv_silu_and_mul(x, q, s), F.silu(gate) * up)


@pytest.mark.parametrize("gated", [False, True])
def test_fp8_gemv_after_the_folded_norm(gated):
    from pagoda_engine.worker.model.gemv_triton import gemv_rmsnorm, norm_applies

    q, s, w = _fp8(28672 if gated else 6144, 4096)
    x, residual = (torch.randn(1, 4096, device=CUDA).bfloat16() for _ in range(2))
    norm_w = (1 + 0.2 * torch.randn(4096, device=CUDA)).bfloat16()
    assert norm_applies(x, residual, norm_w, q)
    y, res_out = gemv_rmsnorm(x, residual, norm_w, 1e-5, q, gated=gated, scale=s)
    h = x.float() + residual.float()
    a = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()).bfloat16().float()
    expected = a @ w.T
    if gated:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    assert torch.equal(res_out, h.bfloat16())
    _close(y, expected)


def test_fp8_layers_take_the_kernels_for_few_rows_only(monkeypatch):
    from pagoda_engine.worker.model import gemv_triton
    from pagoda_engine.worker.model.fp8 import Fp8Scheme, _make_fp8
    from pagoda_engine.worker.model.layers import ColumnParallelLinear

    with torch.device(CUDA):
        layer = ColumnParallelLinear(4096, 6144)
    _make_fp8(layer, Fp8Scheme())
    q, s, _ = _fp8(6144, 4096)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(s)
    calls = []
    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for rows in (1, 8, gemv_triton.MAX_ROWS, gemv_triton.MAX_ROWS + 1, 64):
        layer(torch.randn(rows, 4096, device=CUDA).bfloat16())
    assert calls == [1, 8, gemv_triton.MAX_ROWS]


def _time_us(fn, iters: int = 50) -> float:
    """Median µs of `fn` with the L2 cache flushed before each call (weights come from HBM)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=CUDA)
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("rows", [1, 8])
def test_fp8_gemv_reads_the_weights_faster_than_the_scaled_mm_path(rows, capsys):
    """Per Llama-3.1-8B shape, µs: the FP8 kernel, `fp8_linear` (quantize + cuBLASLt), the bf16
    kernel. The FP8 kernel reads half the bf16 kernel's bytes: it must beat `fp8_linear` summed
    over the shapes (the reason it exists); the figures go to the lead's report."""
    from pagoda_engine.worker.model.fp8_math import fp8_linear
    from pagoda_engine.worker.model.gemv_triton import gemv

    total_kernel = total_scaled_mm = 0.0
    lines = []
    for shape in ("llama q/k/v", "llama o", "llama gate+up", "llama down"):
        n, k = SHAPES[shape]
        q, s, w = _fp8(n, k)
        wb = w.bfloat16()
        x = torch.randn(rows, k, device=CUDA).bfloat16()
        fp8_us = _time_us(lambda: gemv(x, q, None, s))
        mm_us = _time_us(lambda: fp8_linear(x, q, s))
        bf16_us = _time_us(lambda: gemv(x, wb))
        total_kernel += fp8_us
        total_scaled_mm += mm_us
        lines.append(f"{shape} [{rows} x {k}] x [{k} x {n}]: FP8 kernel {fp8_us:.1f}, fp8_linear {mm_us:.1f}, "
                     f"bf16 kernel {bf16_us:.1f} us (FP8 weights at {q.numel() / fp8_us / 1e6:.2f} TB/s)")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert total_kernel < total_scaled_mm


@pytest.mark.parametrize("rows", [2, 16])
def test_fp8_few_rows_hold_large_activations(rows):
    """The few-row kernel's float16 products (`rows_config` picks them for FP8): bf16 rows with
    magnitudes a float16 cannot hold (up to 5e5, as outlier features reach in some models) and
    small ones give the float32 product of the scaled weights, plain and gated."""
    from pagoda_engine.worker.model.gemv_triton import gemv, gemv_silu_and_mul, rows_config

    n, k = SHAPES["llama down"]
    assert rows_config(n, k, False, True).f16
    q, s, w = _fp8(n, k)
    x = torch.randn(rows, k, device=CUDA)
    x[0, :6] = torch.tensor([5e5, -2e5, 7e4, -7e4, 1e-4, -3e-3])
    x = x.bfloat16()
    _close(gemv(x, q, None, s), x.float() @ w.T)
    q13, s13, w13 = _fp8(2 * 4096, k)
    gate, up = (x.float() @ w13.T).chunk(2, dim=-1)
    _close(gemv_silu_and_mul(x, q13, s13), F.silu(gate) * up)


@pytest.mark.parametrize("cut", [(16, 1), (32, 1), (64, 2), (128, 4)])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 1024)], ids=["q/k/v", "down", "uneven rows"])
def test_fp8_tensor_core_row_is_the_product_with_the_scaled_weights(n, k, cut):
    """`_gemv_mma_kernel` (the sweep's "mma" cut): each thread's loaded e4m3 bytes as tensor-core
    fragments give the float32 product of the row and the scaled weights, a last block of rows
    cut short included."""
    from pagoda_engine.worker.model.gemv_triton import MmaConfig, _launch_mma

    q, s, w = _fp8(n, k)
    x = torch.randn(1, k, device=CUDA).bfloat16()
    _close(_launch_mma(x, q, s, n, MmaConfig(*cut)), x.float() @ w.T)

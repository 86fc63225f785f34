"""Per-token FP8 quantization of activations on CUDA (Triton): one launch where torch's
`fp8_math.quantize_tokens` takes six (abs, amax, clamp, divide twice, cast), which at a decode
step's one row would cost more than the FP8 matmul they feed.

One program per row: the row's largest magnitude (float32), its scale (that over 448, as
`quantize_tokens`), then the row divided by the scale (IEEE division, as torch's) and rounded to
e4m3 (round to nearest even, saturating: the GPU's conversion, as torch's cast of clamped values).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl

_MAX_BLOCK = 4096


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, MIN_AMAX: tl.constexpr,
                          QMAX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    largest = tl.maximum(tl.max(amax, axis=0), MIN_AMAX)
    scale = tl.math.div_rn(largest, tl.zeros_like(largest) + QMAX)  # IEEE, as torch's: the same scale
    for k in range(0, K, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(scale_ptr + row, scale)


def quantize_tokens(x: torch.Tensor, dtype: torch.dtype, qmax: float, min_amax: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_math.quantize_tokens(x)` (dynamic scales) for a CUDA x [rows, K] with unit column stride:
    values in `dtype` up to ±`qmax`, a row's largest magnitude taken as at least `min_amax`
    (`fp8_math`'s constants, passed in so that this module imports none of the engine's)."""
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), MIN_AMAX=min_amax, QMAX=qmax,
                                       BLOCK=min(_MAX_BLOCK, triton.next_power_of_2(k)), num_warps=4,
                                       **pdl.launch(x.device))
    return q, scale

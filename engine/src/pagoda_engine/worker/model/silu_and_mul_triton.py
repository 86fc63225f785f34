"""SiLU-and-mul for a few rows, on CUDA (Triton): the gated MLP's activation of a small decode batch.

FlashInfer's kernel gives each row one thread block, so a batch-1 decode runs the 14,336 columns
of a Llama-3.1-8B layer on a single SM. Here each row is cut into blocks of `_BLOCK` columns, one
program per (row, block): the same arithmetic (float32, `x / (1 + exp(-x))`, one rounding) spread
over many SMs. `SiluAndMul` uses it up to `MAX_ROWS` rows and FlashInfer's kernel above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl

# Measured faster than FlashInfer up to here (H100, 14,336 wide: 1 row 1.2 vs 3.7 us, 256 rows 3.8 vs 5.6).
MAX_ROWS = 256
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, x_stride, out_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [rows, 2 * d] (unit stride along the columns) → silu(x[:, :d]) * x[:, d:], [rows, d]."""
    rows, width = x.shape
    d = width // 2
    out = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(d, _BLOCK))](x, out, d, x.stride(0), out.stride(0), BLOCK=_BLOCK,
                                                             num_warps=4, **pdl.launch(x.device))
    return out

"""FP8 (e4m3) numbers: quantizing weights per output row and activations per token, and the
FP8 matmul, on every device (`fp8.py` says which layers use them and how checkpoints fill them).

(x_q · q^T) is accumulated in float32, then scaled by x_s[t] × s[r]. On CUDA that is one
`torch._scaled_mm` call (cuBLASLt, row-wise scales; no host synchronisation, so it runs inside
CUDA graphs); elsewhere the FP8 values are widened to float32 and multiplied, so CPU runs check
the very values the GPU uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Below this a row's or token's largest magnitude counts as zero (its scale stays finite).
MIN_AMAX = 1e-12


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row) of a [rows, columns] weight: each row's largest
    magnitude maps to the format's largest value."""
    w32 = w.float()
    scale = w32.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX
    return (w32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_tokens(x: torch.Tensor, static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales [rows, 1]) of activations x [rows, columns]: each row's own
    scale, or the one static scale for every row."""
    x32 = x.float()
    if static_scale is None:
        scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    else:
        scale = static_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scales [rows, ceil(columns / group)]) of x [rows, columns]: a scale
    per row and group of `group` columns (the last group may be short), each group's largest
    magnitude mapping to the format's largest value (DeepSeek-style block scales)."""
    rows, cols = x.shape
    groups = -(-cols // group)
    x32 = F.pad(x.float(), (0, groups * group - cols)).reshape(rows, groups, group)
    scale = x32.abs().amax(dim=-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = (x32 / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(rows, groups * group)[:, :cols], scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """float32 values of `quantize_groups`' output: each group's e4m3 values times its scale."""
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]


def _scaled_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # cuBLASLt's FP8 GEMM takes dimensions that are multiples of 16, and row-wise scales with a
    # bfloat16 result.
    return x.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for an e4m3 weight [N, K] with float32 row scales [N]; x [..., K] is quantized
    per token (or with `input_scale`); the result has x's dtype."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.is_cuda and input_scale is None and x2.stride(-1) == 1:
        # One Triton launch instead of torch's six (imported here: Triton is there only with CUDA).
        from pagoda_engine.worker.model import fp8_quant_triton

        xq, x_scale = fp8_quant_triton.quantize_tokens(x2, FP8_DTYPE, FP8_MAX, MIN_AMAX)
    else:
        xq, x_scale = quantize_tokens(x2, input_scale)
    if _scaled_mm_applies(x2, weight):
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale.contiguous(), scale_b=weight_scale.view(1, -1),
                             out_dtype=torch.bfloat16)
        y = y.to(x.dtype)
    else:
        y = (F.linear(xq.float(), weight.float()) * x_scale * weight_scale).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], weight.shape[0])

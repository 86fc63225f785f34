"""Matrix-vector products on CUDA (Triton): the projections of a decode step of one to sixteen rows.

At one row cuBLAS picks GEMM tiles 8 rows tall, often split over K with a reduce kernel after
them, and reads the weights at 1.9-3.3 TB/s of an H200's 4.8. Here each program reduces one or
two output columns over the whole K dimension (a compile-time constant: the loop unrolls) in
2,048-wide float32 partial sums, summed once at the end: many small programs with long contiguous
reads and no second kernel (`dot_rows`, which the MoE experts' kernels share). On an H200,
L2-cold weights, µs (cuBLAS → here):

| Llama-3.1-8B | q/k/v 15.3 → 13.5 | output 12.4 → 9.8 | down 32.1 → 28.7 | LM head 248 → 231 |
| Qwen3-30B-A3B | q/k/v 8.0 → 6.9 | output 8.7 → 6.0 | router 5.3 → 2.1 | LM head 151 → 139 |

For two to MAX_ROWS (16) rows, against weights of at least ROWS_MIN_N rows, `_rows_kernel` streams
each weight tile once and multiplies it by all the rows on the tensor cores (padded to 16); on an
H100 at Llama-3.1-8B's shapes, 6 rows (2-16 within about 1 µs), µs (cuBLAS → here): q/k/v 20.2 →
19.3, output 15.8 → 13.9, gate+up with the activation kernel after it 86.0 → 80.4, down 43.9 → 42.1,
LM head 379 → 346.

`gemv(x, w, bias)` is `F.linear` for x of one row (or a few). `gemv_silu_and_mul(x, w)` is the gated MLP's
first half in one kernel: w stacks the gate rows over the up rows (as `MergedColumnParallelLinear`
holds them) and each program returns silu(gate) × up for its column, so the activation kernel and
the [1, 2 × I] intermediate are gone (Llama-3.1-8B: 60.0 µs with cuBLAS and the activation, 54.3
here). Both accumulate in float32 and round once. `linear_applies(x, w)` says when they are used;
elsewhere, and on the CPU, `F.linear` runs.

Every kernel also reads FP8 (e4m3) weights with a float32 scale per row (`--quantization fp8`):
widened in registers, the sums times the rows' scales, the activations left in their dtype. A
decode row reads half the bytes of bf16, where the FP8 GEMM would quantize the row first (a
kernel more) and run cuBLASLt's tiles for many rows. The few-row kernel multiplies FP8 tiles in
float16 (`RowsConfig.f16`).

How each kernel cuts a shape (`one_row_config`, `norm_config`, `rows_config`) comes from
`python -m pagoda_engine.bench.gemv_sweep` (each function says what it measured). One FP8 row
streams at 3.0-3.6 TB/s (Llama-3.1-8B on an H200, L2-cold: q/k/v 8.4 µs, output 5.7, gate+up
32.3, down 18.1) where bf16 rows reach 4.0-4.5: a byte of FP8 is a value to widen (half an
e4m3x2 conversion, a float16-to-float32 one) and a multiply-add, twice bf16's work a byte, and
no cut of these kernels moved that. `_gemv_mma_kernel` does the products on the tensor cores
from the loaded bytes themselves, at about half the instructions a byte; the sweep times it (the
"mma" cut) and the engine does not launch it until it wins there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl
from pagoda_engine.worker.model.lora_triton import shrink_normed_row, shrink_row

FP8 = torch.float8_e4m3fn


def _scale_arg(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The scale pointer a kernel takes: an FP8 weight's row scales, which it must come with (a
    plain weight has none; the weight stands in for the unused pointer)."""
    if (weight.dtype == FP8) != (scale is not None):
        raise ValueError("an FP8 weight needs its row scales, and only an FP8 weight takes them")
    return scale if scale is not None else weight


@triton.jit
def first_rows(rows, up_rows, col_mask, K: tl.constexpr, GATED: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first BLOCK_K-wide tile of the weight rows (and of the up rows when GATED; else the
    first again), loaded as `dot_rows` loads it: a kernel under PDL loads it before its wait."""
    ks = tl.arange(0, BLOCK_K)
    if BLOCK_K <= K:
        mask = col_mask[:, None]
    else:
        mask = col_mask[:, None] & (ks[None, :] < K)
    w = tl.load(rows + ks[None, :], mask=mask, other=0.0)
    up = w
    if GATED:
        up = tl.load(up_rows + ks[None, :], mask=mask, other=0.0)
    return w, up


@triton.jit
def dot_rows(x_row, rows, up_rows, col_mask, K: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, w_first, up_first, HAS_FIRST: tl.constexpr):
    """(rows · x_row, up_rows · x_row) in float32 for BLOCK_N weight rows (pointers [BLOCK_N, 1];
    masked by col_mask) over K; the second is zeros unless GATED. BLOCK_K-wide partial sums, summed
    once at the end; K is a compile-time constant, so the loop unrolls and its loads can all be in
    flight. With HAS_FIRST the first tile is `first_rows`' (loaded earlier), the same values in the
    same sums. Also the MoE experts' gate+up kernel (`fused_moe_triton`)."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.static_range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        if k + BLOCK_K <= K:
            a = tl.load(x_row + ks).to(tl.float32)[None, :]
            mask = col_mask[:, None]
        else:
            a = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
            mask = col_mask[:, None] & (ks[None, :] < K)
        if HAS_FIRST and k == 0:
            acc += w_first.to(tl.float32) * a
            if GATED:
                acc_up += up_first.to(tl.float32) * a
        else:
            acc += tl.load(rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * a
            if GATED:
                acc_up += tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * a
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _finish(y, up, cols, col_mask, s_ptr, b_ptr, y_ptr, N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
            SCALED: tl.constexpr):
    """The one-row kernels' epilogue: float32 sums (y, and up when GATED) times the rows' scales,
    plus the bias, the gated form's silu(y) × up, rounded once to y's dtype and stored."""
    if SCALED:
        y = y * tl.load(s_ptr + cols, mask=col_mask, other=0.0)
        if GATED:
            up = up * tl.load(s_ptr + N + cols, mask=col_mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if GATED:
        y = y / (1.0 + tl.exp(-y)) * up
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr, N, stride_wn, la_ptr, lo_ptr, lb_ptr, LORA_N,
                 la_stride_s, la_stride_n, K: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 SCALED: tl.constexpr, LORA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    """y[cols] = w[cols] · x (+ b[cols]); GATED: y[cols] = silu(w[cols] · x) × (w[N + cols] · x).
    SCALED: w holds FP8 rows, each sum times its row's float32 scale (s[cols], s[N + cols]).
    Under PDL the first tile of the weight rows is loaded before the wait for the kernel before.

    SPLIT_K > 1: program (i, j) sums the j-th of SPLIT_K equal slices of K into ws[j] (float32,
    [SPLIT_K, 2, N]); the last of a column block's programs to arrive (a counter per block in
    lock, left at zero again) adds the slices in order 0, 1, … and finishes: the same bits
    whichever arrives last.

    LORA (SPLIT_K 1): the programs past N's columns shrink x for the row's adapter instead
    (`shrink_row`: the A of every slot at la_ptr, LORA_N rows each, into lo_ptr, the slot from the
    block table lb_ptr)."""
    pid = tl.program_id(0)
    if LORA:
        if pid >= tl.cdiv(N, BLOCK_N):
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            shrink_row(x_ptr, la_ptr, lo_ptr, lb_ptr, pid - tl.cdiv(N, BLOCK_N), LORA_N, la_stride_s, la_stride_n, K,
                       BLOCK_N, BLOCK_K)
            return
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    K_PART: tl.constexpr = K // SPLIT_K
    k0 = tl.program_id(1) * K_PART if SPLIT_K > 1 else 0
    rows = w_ptr + k0 + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + k0 + (cols + N).to(tl.int64)[:, None] * stride_wn
    w_first = rows
    up_first = rows
    if PDL:
        w_first, up_first = first_rows(rows, up_rows, col_mask, K_PART, GATED, BLOCK_K)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    y, up = dot_rows(x_ptr + k0, rows, up_rows, col_mask, K_PART, GATED, BLOCK_N, BLOCK_K, w_first, up_first, PDL)
    if SPLIT_K == 1:
        _finish(y, up, cols, col_mask, s_ptr, b_ptr, y_ptr, N, HAS_BIAS, GATED, SCALED)
    else:
        part = ws_ptr + tl.program_id(1) * 2 * N
        tl.store(part + cols, y, mask=col_mask)
        if GATED:
            tl.store(part + N + cols, up, mask=col_mask)
        tl.debug_barrier()  # every thread's partial sums are written before the counter says so
        if tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1:
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            up = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):  # .cg: from L2, where the other programs' sums are
                y += tl.load(ws_ptr + j * 2 * N + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    up += tl.load(ws_ptr + j * 2 * N + N + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
            _finish(y, up, cols, col_mask, s_ptr, b_ptr, y_ptr, N, HAS_BIAS, GATED, SCALED)
            tl.atomic_xchg(lock_ptr + pid, 0)


# The few-row kernel's float16 products (F16) take the rows times this, so that activations below
# 2^20 stay in float16's range (65,504 × 16) and those from 2^-10 in its normal numbers (2^-14 × 16).
F16_X_SCALE = tl.constexpr(1.0 / 16)


@triton.jit
def _x_tile(ptrs, mask, F16: tl.constexpr):
    """A [BLOCK_K, M_PAD] tile of the rows for `_rows_kernel`'s products: as they are, or F16
    (times F16_X_SCALE, a power of two) in float16."""
    xt = tl.load(ptrs, mask=mask, other=0.0)
    if F16:
        # Scaled in the rows' dtype first (exact), so that nothing large reaches float16 unscaled.
        xt = (xt * F16_X_SCALE).to(tl.float16)
    return xt


# Rows the few-row kernel (`_rows_kernel`) serves, a small decode batch (padded to ROWS_PAD for
# the tensor-core tiles), and the fewest weight rows it takes: below that its programs are too
# few to keep the memory busy (Qwen3-30B-A3B's router, 128 rows: 5.8 µs against cuBLAS's 4.7).
MAX_ROWS = 16
ROWS_PAD = 16
ROWS_MIN_N = 1024


def linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One half-precision CUDA row, or up to MAX_ROWS (each contiguous) against at least
    ROWS_MIN_N weight rows, against a row-major weight of the same dtype or of FP8 (e4m3, with
    its row scales passed as `scale`)."""
    # The row count first: every projection of every step asks, and most have more rows.
    return (x.dim() == 2 and (x.shape[0] == 1 or (1 < x.shape[0] <= MAX_ROWS and weight.shape[0] >= ROWS_MIN_N))
            and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype in (x.dtype, FP8)
            and x.stride(-1) == 1 and weight.dim() == 2 and weight.stride(-1) == 1 and weight.shape[1] % 8 == 0)


class OneRowConfig(NamedTuple):
    """How `_gemv_kernel` cuts a one-row projection: output columns a program, the K tile, warps a
    program, and the slices of K that programs of their own sum (`split_k`, 1: none)."""
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 1


# At least this many output columns for the wide cut (eight columns a program): below, its
# programs are too few to keep an H200's 132 SMs busy (Qwen3-30B-A3B's router has 128 columns).
WIDE_MIN_N = 4096


def one_row_config(n: int, k: int, gated: bool, fp8: bool) -> OneRowConfig:
    """The one-row kernel's cut of an [n, k] weight (n output columns; gated: n gate rows over n
    up rows): tiles of up to 2,048 columns, four warps, two output columns a program, one for the
    gated form (which reads two rows for each); for wide weights eight columns and 1,024-wide tiles
    (each program reads the row x once for more weight bytes). From `pagoda_engine.bench.gemv_sweep`
    on an H200 (Llama-3.1-8B, L2-cold weights, CUDA graph with PDL), µs (two columns → eight):
    FP8 output 6.55 → 5.68, down 18.29 → 18.05; bf16 output 9.02 → 8.42, LM head 235.0 → 228.0,
    but bf16 down 27.2 → 39.4 (its K of 14,336 in 1,024-wide float32 sums spills), so bf16 takes
    the wide cut only up to K = 4,096. Split-K (2 or 4 slices) lost at every shape (output 8.06,
    down 22.6 µs at best, FP8); so did the few-row kernel at one row (9.0, 24.7)."""
    if not gated and n >= WIDE_MIN_N and (fp8 or k <= 4096):
        return OneRowConfig(8, 1024, 4)
    return OneRowConfig(1 if gated else 2, min(2048, triton.next_power_of_2(k)), 4)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, stride_xm, stride_wn, K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, M_PAD: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                 F16: tl.constexpr):
    """`_gemv_kernel` for M (≤ M_PAD) rows: each program takes BLOCK_N output columns of every row,
    streaming its weight rows over K once in BLOCK_K-wide tiles, each multiplied on the tensor
    cores by the rows (padded to M_PAD), float32 sums; y is [M, N], contiguous. Under PDL with
    PREFETCH the first weight tile is loaded before the wait for the kernel before (the first step
    of the loop, peeled: the same products in the same order); it takes a pipeline stage's worth
    of shared memory more, which 256-wide tiles in five stages do not have. SCALED: FP8 weight
    tiles, widened to x's dtype for the products (exactly: every e4m3 value is a bfloat16 one), the
    sums times the rows' scales. F16 (FP8 weights): the products in float16 instead, the weights
    widened by one instruction for two values (to bfloat16 it takes four), the rows times
    F16_X_SCALE (exact for magnitudes from 2^-10 up to 2^20, smaller ones within 2^-21) and the sums
    divided by it."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ms = tl.arange(0, M_PAD)
    m_mask = ms < M
    rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    k_start = 0
    if PDL:
        if PREFETCH:
            w_first, up_first = first_rows(rows, up_rows, col_mask, K, GATED, BLOCK_K)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PDL and PREFETCH:
        ks = tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xt = _x_tile(x_ptr + ms[None, :] * stride_xm + ks[:, None], m_mask[None, :] & k_mask[:, None], F16)
        acc += tl.dot(w_first.to(xt.dtype), xt)
        if GATED:
            acc_up += tl.dot(up_first.to(xt.dtype), xt)
        k_start = BLOCK_K
    for k in range(k_start, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xt = _x_tile(x_ptr + ms[None, :] * stride_xm + ks[:, None], m_mask[None, :] & k_mask[:, None], F16)
        w_mask = col_mask[:, None] & k_mask[None, :]
        acc += tl.dot(tl.load(rows + ks[None, :], mask=w_mask, other=0.0).to(xt.dtype), xt)
        if GATED:
            acc_up += tl.dot(tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0).to(xt.dtype), xt)
    if SCALED:
        row_scale = tl.load(s_ptr + cols, mask=col_mask, other=0.0)
        if F16:
            row_scale = row_scale * (1 / F16_X_SCALE)
        acc = acc * row_scale[:, None]
        if GATED:
            up_scale = tl.load(s_ptr + N + cols, mask=col_mask, other=0.0)
            if F16:
                up_scale = up_scale * (1 / F16_X_SCALE)
            acc_up = acc_up * up_scale[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[:, None]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(y_ptr + ms[None, :] * N + cols[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=col_mask[:, None] & m_mask[None, :])


class RowsConfig(NamedTuple):
    """How `_rows_kernel` cuts a few-row projection: output columns a program, the K tile,
    pipeline stages, warps a program, and for FP8 weights whether the products are float16's
    (`f16`, see the kernel) rather than the rows' dtype."""
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int = 4
    f16: bool = False


def rows_config(n: int, k: int, gated: bool, fp8: bool) -> RowsConfig:
    """The few-row kernel's cut. bf16, from a sweep at 8 rows on an H100 (L2-cold weights; BLOCK_N
    16/32/64 × BLOCK_K 64/128/256 × 3/5 stages): 64 × 128 in five stages was best or within 3 % at
    every shape but those with K at least N (Llama's output and down, Qwen3-30B-A3B's output),
    which read 256-wide K tiles best (on an H200, Llama's output at 2-8 rows: 11.1 → 10.4 µs).

    FP8: float16 products, 32 × 256 tiles, three stages where N > K (q/k/v, gate+up), else five.
    From `pagoda_engine.bench.gemv_sweep` on an H200 (Llama-3.1-8B, 2, 4 and 8 rows within 1 %),
    µs (64 × 128 in bf16 products → this): q/k/v 20.9 → 12.9, output 20.6 → 9.6, gate+up 57.0 →
    41.6, down 63.7 → 26.4: widening e4m3 to bfloat16 took a slow conversion for every value, to
    float16 one instruction for two; the other stage count cost 1.5-17 %."""
    if fp8:
        return RowsConfig(32, 256, 3 if n > k else 5, 4, f16=True)
    return RowsConfig(64, 256 if k >= n and not gated else 128, 5)


def _launch_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                 n: int, gated: bool, config: RowsConfig | None = None) -> torch.Tensor:
    m, k = x.shape
    block_n, block_k, stages, warps, f16 = config or rows_config(n, k, gated, weight.dtype == FP8)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _rows_kernel[(triton.cdiv(n, block_n),)](
        x, weight, _scale_arg(weight, scale), bias if bias is not None else weight, y, m, n, x.stride(0),
        weight.stride(0), K=k, HAS_BIAS=bias is not None, GATED=gated, SCALED=scale is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, M_PAD=ROWS_PAD, num_warps=warps, num_stages=stages, PREFETCH=block_k <= 128,
        F16=f16 and scale is not None,
        **pdl.launch(x.device))
    return y


# Split-K's arrival counters, one per column block, per device: zeros between launches (the last
# program of a block puts its counter back). One set serves every launch on the device, which is
# sound for launches on one stream (each program touches its counter after the wait for the
# kernel before), as a decode step's are.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _split_k_buffers(device: torch.device, n: int, blocks: int, split_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < blocks:
        counters = _COUNTERS[device] = torch.zeros(max(blocks, 1 << 16), dtype=torch.int32, device=device)
    return torch.empty((split_k, 2, n), dtype=torch.float32, device=device), counters


def _lora_args(lora: tuple[torch.Tensor, torch.Tensor] | None, x: torch.Tensor, block_n: int):
    """A one-row kernel's LoRA arguments for `lora` = (A of every slot [slots, N2, K], the block
    table): (its extra programs, the float32 shrunk row [1, 1, N2] they write, the kernel's
    pointer and size arguments); with no `lora`, none and placeholders."""
    if lora is None:
        return 0, None, (x, x, x, 0, 0, 0)
    a, blocks = lora
    out = torch.empty((1, 1, a.shape[1]), dtype=torch.float32, device=x.device)
    return triton.cdiv(a.shape[1], block_n), out, (a, out, blocks, a.shape[1], a.stride(0), a.stride(1))


def _launch_one(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                n: int, gated: bool, config: OneRowConfig | None = None,
                lora: tuple[torch.Tensor, torch.Tensor] | None = None):
    k = weight.shape[1]
    block_n, block_k, warps, split_k = config or one_row_config(n, k, gated, weight.dtype == FP8)
    if lora is not None and split_k > 1:
        raise ValueError("the adapters' shrink rides along a one-row kernel without split-K")
    if split_k > 1 and (k % split_k or (k // split_k) % 16):
        raise ValueError(f"split-K {split_k} needs slices of K ({k}) that are whole multiples of 16")
    blocks = triton.cdiv(n, block_n)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    ws, counters = _split_k_buffers(x.device, n, blocks, split_k) if split_k > 1 else (y, y)
    extra, shrunk, lora_args = _lora_args(lora, x, block_n)
    _gemv_kernel[(blocks + extra, split_k)](
        x, weight, _scale_arg(weight, scale), bias if bias is not None else weight, y, ws, counters, n,
        weight.stride(0), *lora_args, K=k, HAS_BIAS=bias is not None, GATED=gated, SCALED=scale is not None,
        LORA=lora is not None, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=warps,
        **pdl.launch(x.device))
    return y if lora is None else (y, shrunk)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, n: int,
            gated: bool, lora: tuple[torch.Tensor, torch.Tensor] | None = None):
    if x.shape[0] > 1:
        assert lora is None, "the adapters' shrink rides along one row only"
        return _launch_rows(x, weight, scale, bias, n, gated)
    return _launch_one(x, weight, scale, bias, n, gated, lora=lora)


@triton.jit
def _mma_e4m3_row(w4, x4, acc):
    """One m16n8k16 tensor-core product for every four e4m3 weights a thread holds (`pack=4`):
    the four weights widened to float16 (two instructions) are the B fragment of the thread's
    weight row (the warp's lane // 4), the four float16 row values the A fragment's row 0 (lanes 0-3;
    the other rows zero), and acc the C fragment. Which four of a row's K positions are which
    logical k does not matter to a dot product, so each thread's loaded bytes are used where they
    lie: no shared memory, no shuffles. Only a layout of [1, 16] values a thread, [8, 4] threads a
    warp (each thread 16 contiguous bytes of one row, four threads a row) gives the right sums."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 wl, wh;
        .reg .b32 b0, b1, a0, a2, z;
        .reg .pred p;
        .reg .u32 lane;
        mov.b32 {wl, wh}, $4;
        cvt.rn.f16x2.e4m3x2 b0, wl;
        cvt.rn.f16x2.e4m3x2 b1, wh;
        mov.u32 lane, %laneid;
        setp.lt.u32 p, lane, 4;
        selp.b32 a0, $5, 0, p;
        selp.b32 a2, $6, 0, p;
        mov.b32 z, 0;
        mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {a0, z, a2, z}, {b0, b1}, {$7, $8, $9, $10};
        }""",
        constraints="=f,=f,=f,=f,r,r,r,f,f,f,f",
        args=[w4, x4, acc], dtype=tl.float32, is_pure=True, pack=4)


@triton.jit
def _gemv_mma_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr,
                     PDL: tl.constexpr):
    """y[rows] = (w[rows] · x) × s[rows] for one row x and FP8 rows w (K a multiple of 64): 64-wide
    tiles of BLOCK_N rows (8 × warps × repeats), each thread's 16 bytes of a row four tensor-core
    products (`_mma_e4m3_row`) against the row in float16 (times F16_X_SCALE, as `_rows_kernel`),
    float32 sums. Element (r, 16q + 4j + c) of the sums, for r a multiple of 8 and c < 2, holds
    the part of row r + 2q + c summed by product j; the others hold zeros. A widened e4m3 value
    costs half an instruction and a product an eighth, where `_gemv_kernel` spends two and a half a
    value on CUDA cores. An experiment: the engine does not launch it (`pagoda_engine.bench.
    gemv_sweep` times it as the "mma" cut)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    ks = tl.arange(0, 64)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    w = tl.load(w_ptrs, mask=row_mask[:, None], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, 64), dtype=tl.float32)
    for k in tl.static_range(0, K, 64):
        if k > 0:
            w = tl.load(w_ptrs + k, mask=row_mask[:, None], other=0.0)
        # Scaled in the row's dtype first (exact), as `_x_tile` does.
        xk = (tl.load(x_ptr + k + ks) * F16_X_SCALE).to(tl.float16)
        acc = _mma_e4m3_row(w.to(tl.uint8, bitcast=True), tl.broadcast_to(xk[None, :], (BLOCK_N, 64)), acc)
    GROUPS: tl.constexpr = BLOCK_N // 8
    sums = tl.sum(tl.sum(tl.reshape(acc, (GROUPS, 8, 4, 4, 4)), axis=3), axis=1)  # [group, q, c]
    y = tl.reshape(tl.sum(tl.reshape(sums, (GROUPS, 4, 2, 2)), axis=2), (BLOCK_N,))
    y = y * tl.load(s_ptr + rows, mask=row_mask, other=0.0) * (1 / F16_X_SCALE)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


class MmaConfig(NamedTuple):
    """How `_gemv_mma_kernel` cuts a projection: rows a program (a multiple of 8 × warps), warps."""
    block_n: int
    num_warps: int


def _launch_mma(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, n: int, config: MmaConfig) -> torch.Tensor:
    """`gemv(x, weight, None, scale)` for one row and FP8 weights through `_gemv_mma_kernel`."""
    k = weight.shape[1]
    if weight.dtype != FP8 or scale is None or x.shape[0] != 1 or k % 64 or config.block_n % (8 * config.num_warps):
        raise ValueError("the tensor-core one-row kernel takes one row, FP8 weights with their scales, K a "
                         "multiple of 64, and rows a program a multiple of 8 x warps")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_mma_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, scale, y, n, weight.stride(0), K=k, BLOCK_N=config.block_n, num_warps=config.num_warps,
        **pdl.launch(x.device))
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         scale: torch.Tensor | None = None, lora: tuple[torch.Tensor, torch.Tensor] | None = None):
    """`F.linear(x, weight, bias)` for x [M, K], M ≤ MAX_ROWS (see `linear_applies`); an FP8 weight
    comes with its float32 row scales, `scale` [N], and is read as weight × scale. With `lora`
    (one row: A of every adapter slot and the LoRA block table, `lora_triton`) the result is
    (y, the row shrunk by its slot's A, float32 [1, 1, N2])."""
    return _launch(x, weight, scale, bias, weight.shape[0], gated=False, lora=lora)


def gemv_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x · gate^T) × (x · up^T), [M, I], for weight [2 × I, K] = [gate rows; up rows] (FP8
    with `scale` [2 × I], as `gemv`)."""
    return _launch(x, weight, scale, None, weight.shape[0] // 2, gated=True)


@triton.jit
def _normalised_row(x_ptr, res_ptr, nw_ptr, ks, k_ok, eps, K: tl.constexpr, HAS_RES: tl.constexpr):
    """(h, rmsnorm(h) rounded to x's dtype) in float32, h = x (+ res), as FlashInfer's fused
    add-and-RMSNorm computes them."""
    h = tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    nw = tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
    return h, (h * r * nw).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _gemv_rmsnorm_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, s_ptr, b_ptr, y_ptr, res_out_ptr, normed_ptr, N, stride_wn,
                         eps, la_ptr, lo_ptr, lb_ptr, LORA_N, la_stride_s, la_stride_n, K: tl.constexpr,
                         K_P2: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                         SCALED: tl.constexpr, WRITE_NORMED: tl.constexpr, LORA: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """h = x (+ res); y[cols] = rmsnorm(h) · w[cols] (+ b[cols]), GATED as `_gemv_kernel`. Every
    program loads the whole row and its weight rows at once, normalises the row as FlashInfer's
    RMSNorm does (float32, times the weight, rounded once to the dtype) and takes the dot
    products; program 0 also writes h (the new residual stream) and, WRITE_NORMED, the
    normalised row. Under PDL the weight rows are loaded before the wait for the kernel before.
    SCALED: FP8 weight rows and their scales, as `_gemv_kernel`. A program takes BLOCKS blocks of
    BLOCK_N columns one after the other (the first loaded before the wait), normalising the row
    once for all of them. LORA: the programs past N's columns shrink the normalised row for the
    row's adapter instead (`shrink_normed_row`, BLOCK_N rows of A a program; the arguments as
    `_gemv_kernel`'s)."""
    pid = tl.program_id(0)
    ks = tl.arange(0, K_P2)
    k_ok = ks < K
    if LORA:
        if pid >= tl.cdiv(N, BLOCKS * BLOCK_N):
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            _, a = _normalised_row(x_ptr, res_ptr, nw_ptr, ks, k_ok, eps, K, HAS_RES)
            shrink_normed_row(a, ks, k_ok, la_ptr, lo_ptr, lb_ptr, pid - tl.cdiv(N, BLOCKS * BLOCK_N), LORA_N,
                              la_stride_s, la_stride_n, BLOCK_N)
            return
    cols = pid * (BLOCKS * BLOCK_N) + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    mask = col_mask[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
    w_up = w
    if GATED:
        w_up = tl.load(w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    h, a = _normalised_row(x_ptr, res_ptr, nw_ptr, ks, k_ok, eps, K, HAS_RES)
    if HAS_RES:
        tl.store(res_out_ptr + ks, h.to(res_out_ptr.dtype.element_ty), mask=k_ok & (pid == 0))
    if WRITE_NORMED:
        tl.store(normed_ptr + ks, a.to(normed_ptr.dtype.element_ty), mask=k_ok & (pid == 0))
    a = a[None, :]
    for block in tl.static_range(BLOCKS):
        if block > 0:
            cols += BLOCK_N
            col_mask = cols < N
            mask = col_mask[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=mask, other=0.0)
            if GATED:
                w_up = tl.load(w_ptr + (cols + N).to(tl.int64)[:, None] * stride_wn + ks[None, :], mask=mask,
                               other=0.0)
        y = tl.sum(w.to(tl.float32) * a, axis=1)
        up = y
        if GATED:
            up = tl.sum(w_up.to(tl.float32) * a, axis=1)
        _finish(y, up, cols, col_mask, s_ptr, b_ptr, y_ptr, N, HAS_BIAS, GATED, SCALED)


class NormConfig(NamedTuple):
    """How `_gemv_rmsnorm_kernel` cuts a projection: output columns a block, warps a program,
    blocks a program."""
    block_n: int
    num_warps: int
    blocks: int = 1


def norm_config(n: int, k: int, gated: bool, fp8: bool) -> NormConfig:
    """The folded-norm kernel's cut: two columns a program (one gated), except for FP8 rows, which
    hold half the bytes: eight columns for q/k/v, four for gate+up; four warps up to rows of 4,096,
    else eight. Wide FP8 q/k/v: two blocks of eight columns a program (the row normalised once for
    both), eight warps. From `pagoda_engine.bench.gemv_sweep` on an H200 (Llama-3.1-8B, L2-cold
    weights, CUDA graph with PDL; columns × warps × blocks, 6-32 × 4-16 × 1-4), µs: FP8 q/k/v 9.26
    → 8.39; FP8 gate+up 32.26 (the next best 32.5, two blocks of two); bf16 q/k/v 13.59, gate+up
    52.97 (every other cut within 1 %)."""
    warps = 4 if triton.next_power_of_2(k) <= 4096 else 8
    if fp8 and not gated and n >= WIDE_MIN_N:
        return NormConfig(8, 8, 2)
    block_n = (4 if gated else 8) if fp8 else (1 if gated else 2)
    return NormConfig(block_n, warps)


# The fused norm holds the whole row in registers: hidden sizes up to this (Llama-3.1-70B's 8,192).
NORM_MAX_K = 8192


def norm_applies(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                 weight: torch.Tensor) -> bool:
    """`gemv_rmsnorm` serves this row: `linear_applies` to one row, a contiguous residual row and
    norm weight of x's shape and dtype. (Not to more rows: every program would normalise all of
    them, and on an H100 that made the few-row kernel twice as slow as the norm kernel and the
    projection apart.)"""
    k = x.shape[-1]
    return (x.shape[0] == 1 and linear_applies(x, weight) and k <= NORM_MAX_K and x.is_contiguous()
            and norm_weight.dtype == x.dtype and norm_weight.is_contiguous() and norm_weight.shape == (k,)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.is_contiguous())))


def gemv_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                 normed_out: bool = False, scale: torch.Tensor | None = None, config: NormConfig | None = None,
                 lora: tuple[torch.Tensor, torch.Tensor] | None = None):
    """A decoder layer's RMSNorm and the projection after it, for one row (see `norm_applies`):
    `(linear(norm(h), weight, bias), h)` with h = x + residual (x when residual is None); with
    `gated` the projection is `gemv_silu_and_mul`'s; with `normed_out` the normalised row is
    returned third, for a layer that projects it more than once (an MoE block: router, experts);
    an FP8 weight comes with its row scales, `scale`, as `gemv`; `config` overrides `norm_config`'s
    cut (the sweep, `pagoda_engine.bench.gemv_sweep`, times the candidates); with `lora` (as `gemv`'s)
    the normalised row shrunk by its adapter's A comes last.

    The values are the separate kernels': h and the normalised row rounded as FlashInfer's fused
    add-and-RMSNorm rounds them, the dot products in float32 (summed in another order). One
    launch instead of two, at one row about 2 x 3.5 µs less a layer on an H200."""
    assert x.shape[0] == 1, "the folded norm serves one row (norm_applies)"
    k = weight.shape[1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    k_p2 = triton.next_power_of_2(k)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    normed = torch.empty_like(x) if normed_out else None
    block_n, warps, blocks = config or norm_config(n, k, gated, weight.dtype == FP8)
    extra, shrunk, lora_args = _lora_args(lora, x, block_n)
    _gemv_rmsnorm_kernel[(triton.cdiv(n, block_n * blocks) + extra,)](
        x, residual if residual is not None else x, norm_weight, weight, _scale_arg(weight, scale),
        bias if bias is not None else weight, y, res_out, normed if normed is not None else x, n, weight.stride(0), eps,
        *lora_args, K=k, K_P2=k_p2, HAS_RES=residual is not None, HAS_BIAS=bias is not None, GATED=gated,
        SCALED=scale is not None, WRITE_NORMED=normed_out, LORA=lora is not None,
        BLOCK_N=block_n, BLOCKS=blocks, num_warps=warps, **pdl.launch(x.device))
    out = (y, res_out, normed) if normed_out else (y, res_out)
    return out if lora is None else (*out, shrunk)

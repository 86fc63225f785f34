"""The batched LoRA kernels on CUDA (Triton), in punica's SGMV shape: a step's rows grouped by the
adapter slot they run under, shrink (x A^T) then expand (· B^T × scale) added into the wrapped
projection's output.

Why Triton and not a library: punica's kernels and vLLM's are tied to their engines' metadata and
builds; these are two short kernels over Pagoda's own buffers (`lora.LoRABatch`), compiled like
the engine's other Triton kernels, and their grid is fixed by the step's padded row count and the
slot count alone: min(rows, cdiv(rows, block_m) + slots) programs along the rows
(`LoRABatch.max_blocks`), each taking one entry of `LoRABatch.blocks` (up to block_m rows of one
slot, gathered through `sorted_rows`) and returning at once past the step's last block. So CUDA
graphs capture the launches once and every replay serves the adapters its rows name, base rows
(slot -1) costing nothing. A lone decode row's shrink runs inside the matrix-vector kernel instead
(below).

The shrink splits K: a decode step's few rows make a handful of row blocks, and a program that
streamed a whole row of A (4,096 or 14,336 wide) alone took ~45 µs on an H200 where the bytes
take well under one. So the grid's third axis cuts K into `splits` chunks, enough of them that
rows × column tiles × chunks make about one wave of programs (`_split_k`), each writing its float32
partial sums to a plane of its own: the shrink's result is [splits, rows, slices × R]. The expand
sums a row's planes in a fixed order as it reads them (R columns a slice: a few KB), so the result
never depends on which program finished first, and a prefill's many row blocks run unsplit, as
before. How many splits depends on the padded row count only, the same for every step of a graph.

The shrink accumulates in float32; the expand adds `scale × shrunk · B^T` to the output in float32
and rounds once. Under programmatic dependent launch (`worker/pdl.py`) both load their block
table and first tile of A or B before waiting for the kernel before: those are written by copies
and kernels between steps, before the step's first kernel, never by the kernel just before.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl

_BLOCK_N = 64  # `expand_act`'s output columns a program, and the expand's where slices need it
# The expand's widest column block: every program re-reads its rows' shrunk planes, so wider blocks
# read them fewer times (a [32, 128] float32 tile and B's [R, 128] stay in four warps' registers).
_EXPAND_BLOCKS_N = (128, 64)
_BLOCK_K = 64
# At most this many partial planes: the expand sums them all for every row it reads (unrolled).
MAX_SPLITS = 32
# About one wave of an H200's 132 SMs: past that, splitting K only adds planes for the expand to sum.
_TARGET_PROGRAMS = 128
# Splits² × rows at most this. A shrink program's K loop is latency-bound (about 0.3 µs a 64-wide
# tile on an H200: 45.9 µs for Llama-3.1-8B's 117 tiles a shrink on average, under a profiler), so
# a layer's four shrinks take ~125 µs / splits, while every expand program re-reads its rows'
# planes (R float32 columns each), a cost that grows as splits × rows (Llama-3.1-8B: 336 column
# blocks a layer × 64 bytes, ~2 ns per plane and row at L2 bandwidth); their sum is least near
# splits = sqrt(58,000 / rows). The budget keeps to about 0.7 × that, the side of fewer planes:
# 32 up to 32 rows, 11 at 256, 4 at 2,048, one plane from 32,768 rows.
_PLANE_BUDGET = 32768


@triton.jit
def _block_rows(blocks_ptr, rows_ptr, BLOCK_M: tl.constexpr):
    """This program's block of one slot's rows (`blocks_ptr`: slot, start, count per block):
    (slot, count, the mask of its BLOCK_M row positions, their row indices)."""
    block = tl.program_id(0)
    slot = tl.load(blocks_ptr + block * 3)
    start = tl.load(blocks_ptr + block * 3 + 1)
    count = tl.load(blocks_ptr + block * 3 + 2)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    return slot, count, mask_m, rows


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, out_ptr, rows_ptr, blocks_ptr, K, N, x_stride, a_stride_s, a_stride_n, out_stride,
                   split_stride, K_CHUNK, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PDL: tl.constexpr):
    """out[split, rows, cols] = x[rows, chunk] · A[slot, cols, chunk]^T for this program's block of
    rows, BLOCK_N columns and K chunk `split` (program ids 0, 1, 2)."""
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot, count, mask_m, rows = _block_rows(blocks_ptr, rows_ptr, BLOCK_M)
    if count == 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_cols = a_ptr + slot.to(tl.int64) * a_stride_s + offs_n[None, :] * a_stride_n
    x_rows = x_ptr + rows[:, None] * x_stride
    k_start = pid_k * K_CHUNK
    k_end = tl.minimum(k_start + K_CHUNK, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_end
    a = tl.load(a_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    acc = tl.dot(x, a)
    for k0 in range(k_start + BLOCK_K, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(x, a)
    tl.store(out_ptr + pid_k * split_stride + rows[:, None] * out_stride + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _summed_planes(ptrs, mask, split_stride, SPLITS: tl.constexpr):
    """The sum of the shrink's SPLITS partial planes at `ptrs`, plane 0 first (unrolled: every
    load can be in flight at once)."""
    s = tl.load(ptrs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLITS):
        s += tl.load(ptrs + i * split_stride, mask=mask, other=0.0)
    return s


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, scale_ptr, rows_ptr, blocks_ptr, R, N, s_offset, edge1, edge2, s_width,
                   s_stride, split_stride, b_stride_s, b_stride_n, y_offset, y_stride, SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(1)
    slot, count, mask_m, rows = _block_rows(blocks_ptr, rows_ptr, BLOCK_M)
    if count == 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Which slice's shrunk columns this block of output columns reads (slices start on block edges).
    n0 = pid_n * BLOCK_N
    s_offset += ((n0 >= edge1).to(tl.int32) + (n0 >= edge2).to(tl.int32)) * s_width
    b_cols = b_ptr + slot.to(tl.int64) * b_stride_s + offs_n[None, :] * b_stride_n
    s_rows = s_ptr + rows[:, None] * s_stride + s_offset
    scale = tl.load(scale_ptr + slot)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    b = tl.load(b_cols + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s = _summed_planes(s_rows + offs_r[None, :], mask_m[:, None] & mask_r[None, :], split_stride, SPLITS)
    acc = tl.dot(s, b)
    for r0 in range(BLOCK_R, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        s = _summed_planes(s_rows + offs_r[None, :], mask_m[:, None] & mask_r[None, :], split_stride, SPLITS)
        b = tl.load(b_cols + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(s, b)
    acc = acc * scale
    y_ptrs = y_ptr + rows[:, None] * y_stride + y_offset + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


# --- one decode row: the shrink inside the matrix-vector kernels --------------------------------
#
# A lone request's step has one row, whose projection runs in `gemv_triton`'s one-row kernels. With
# adapters, those kernels take extra programs past their output columns that shrink the same row
# (normalised first, where the norm is folded in) by its slot's A, `shrink_row` and
# `shrink_normed_row` below: the shrink costs no launch of its own, and the expand follows (for
# gate/up, `expand_act`, which also applies the activation the gated kernel would have).

ONE_ROW_MAX_RANK = 64  # `expand_act` holds a whole slot's B columns for its outputs in registers


@triton.jit
def shrink_row(x_row, a_ptr, out_ptr, blocks_ptr, program, N, a_stride_s, a_stride_n, K: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[cols] = x · A[slot, cols]^T in float32 for the BLOCK_N columns of `program`, where slot
    is the one row's (`LoRABatch.blocks`' first entry; nothing when the row runs on the base)."""
    slot = tl.load(blocks_ptr)
    count = tl.load(blocks_ptr + 2)
    if count > 0:
        cols = program * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = a_ptr + slot.to(tl.int64) * a_stride_s + cols.to(tl.int64)[:, None] * a_stride_n
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in tl.static_range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(rows + ks[None, :], mask=col_mask[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(out_ptr + cols, tl.sum(acc, axis=1), mask=col_mask)


@triton.jit
def shrink_normed_row(a_row, ks, k_ok, a_ptr, out_ptr, blocks_ptr, program, N, a_stride_s, a_stride_n,
                      BLOCK_N: tl.constexpr):
    """`shrink_row` of a row held in registers (float32, [K_P2] at `ks`, `k_ok` its columns): the
    normalised row of the kernel that folds the norm in."""
    slot = tl.load(blocks_ptr)
    count = tl.load(blocks_ptr + 2)
    if count > 0:
        cols = program * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        rows = a_ptr + slot.to(tl.int64) * a_stride_s + cols.to(tl.int64)[:, None] * a_stride_n
        w = tl.load(rows + ks[None, :], mask=col_mask[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, tl.sum(w * a_row[None, :], axis=1), mask=col_mask)


@triton.jit
def _expand_act_kernel(s_ptr, b_ptr, y_ptr, out_ptr, scale_ptr, blocks_ptr, R, I, b_stride_s, b_stride_n,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """One row: out[cols] = silu(g) × u, g = y[cols] plus the adapter's gate part, u = y[I + cols]
    plus its up part (each rounded to y's dtype first, as the expand writes them), for the row's
    slot (`blocks_ptr`' first entry; none: y's alone). s: the shrunk row, gate's R columns then up's."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    slot = tl.load(blocks_ptr)
    has = tl.load(blocks_ptr + 2) > 0
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = (offs_r < R) & has
    b_cols = b_ptr + slot.to(tl.int64) * b_stride_s + cols.to(tl.int64)[None, :] * b_stride_n + offs_r[:, None]
    b_mask = mask_r[:, None] & col_mask[None, :]
    b_gate = tl.load(b_cols, mask=b_mask, other=0.0).to(tl.float32)
    b_up = tl.load(b_cols + I * b_stride_n, mask=b_mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + slot)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    s_gate = tl.load(s_ptr + offs_r, mask=mask_r, other=0.0)
    s_up = tl.load(s_ptr + R + offs_r, mask=mask_r, other=0.0)
    gate = tl.load(y_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + I + cols, mask=col_mask, other=0.0).to(tl.float32)
    gate = (gate + tl.sum(b_gate * s_gate[:, None], axis=0) * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
    up = (up + tl.sum(b_up * s_up[:, None], axis=0) * scale).to(y_ptr.dtype.element_ty).to(tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + cols, act.to(out_ptr.dtype.element_ty), mask=col_mask)


def expand_act(shrunk: torch.Tensor, y: torch.Tensor, lora, batch) -> torch.Tensor:
    """One row's gated MLP half: y [1, 2 × I] = [gate | up] of the base projection, shrunk [1, 1,
    2 × R] (gate's slice, then up's) → silu(gate + its adapter part) × (up + its part), [1, I]."""
    i = y.shape[1] // 2
    r = lora.rank
    out = torch.empty((1, i), dtype=y.dtype, device=y.device)
    _expand_act_kernel[(triton.cdiv(i, _BLOCK_N),)](
        shrunk, lora.lora_b, y, out, batch.scales, batch.blocks, r, i, lora.lora_b.stride(0), lora.lora_b.stride(1),
        BLOCK_N=_BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(r)), **pdl.launch(y.device))
    return out


def _split_k(rows: int, block_m: int, n_tiles: int, k: int) -> tuple[int, int]:
    """(chunk, splits): K cut into `splits` chunks of `chunk` (a multiple of _BLOCK_K) so that the
    row blocks of `rows` rows × `n_tiles` × splits make about _TARGET_PROGRAMS programs, at most
    MAX_SPLITS and sqrt(_PLANE_BUDGET / rows). A function of the padded row count: every replay of
    a graph sums alike."""
    programs = triton.cdiv(rows, block_m) * n_tiles
    splits = max(1, min(MAX_SPLITS, triton.cdiv(k, _BLOCK_K), _TARGET_PROGRAMS // programs,
                        math.isqrt(_PLANE_BUDGET // max(rows, 1))))
    chunk = triton.cdiv(triton.cdiv(k, splits), _BLOCK_K) * _BLOCK_K
    return chunk, triton.cdiv(k, chunk)


def shrink(x: torch.Tensor, a: torch.Tensor, batch) -> torch.Tensor:
    """x [T, K], a [slots, N, K] → float32 [splits, T, N], partial sums over K's chunks whose sum
    (`expand` takes it) is row t's x · A[its slot]^T for every row of `batch.blocks` (rows without
    a slot are left unwritten)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    _, n, _ = a.shape
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    n_tiles = triton.cdiv(n, block_n)
    chunk, splits = _split_k(t, batch.block_m, n_tiles, k)
    out = torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    grid = (batch.max_blocks(t), n_tiles, splits)
    _shrink_kernel[grid](x, a, out, batch.sorted_rows, batch.blocks, k, n, x.stride(0), a.stride(0), a.stride(1),
                         out.stride(1), out.stride(0), chunk, BLOCK_M=batch.block_m, BLOCK_N=block_n,
                         BLOCK_K=_BLOCK_K, **pdl.launch(x.device))
    return out


_NO_EDGE = 1 << 30  # a slice edge no column reaches


def expand(shrunk: torch.Tensor, s_offset: int, b: torch.Tensor, y: torch.Tensor, y_offset: int, batch,
           edges: tuple[int, int] = (_NO_EDGE, _NO_EDGE), s_width: int = 0, block_n: int = _EXPAND_BLOCKS_N[0]) -> None:
    """y[t, y_offset + n] += scales[slot] × Σ_planes shrunk[:, t, s_offset + k(n) × s_width + r] · B[slot, n, r]
    for every row t of `batch.blocks`, in place; shrunk [planes, T, columns] (`shrink`'s), b
    [slots, N, R]; k(n): how many of `edges` (output columns where the next slice begins,
    multiples of `block_n`, the columns a program) lie at or before n."""
    _, n, r = b.shape
    t = y.shape[0]
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    grid = (batch.max_blocks(t), triton.cdiv(n, block_n))
    _expand_kernel[grid](shrunk, b, y, batch.scales, batch.sorted_rows, batch.blocks, r, n, s_offset, edges[0],
                         edges[1], s_width, shrunk.stride(1), shrunk.stride(0), b.stride(0), b.stride(1), y_offset,
                         y.stride(0), SPLITS=shrunk.shape[0], BLOCK_M=batch.block_m, BLOCK_N=block_n,
                         BLOCK_R=block_r, **pdl.launch(y.device))


def add_lora(x: torch.Tensor, y: torch.Tensor, lora, batch) -> torch.Tensor:
    """`LoRALayer.forward` on CUDA: one shrink for every slice of the projection, then `expand_all`."""
    if x.shape[0] > batch.max_tokens:  # the grid would read blocks past the table
        raise RuntimeError(f"{x.shape[0]} rows exceed the LoRA block table's {batch.max_tokens}")
    expand_all(shrink(x, lora.lora_a, batch), y, lora, batch)
    return y


def expand_all(shrunk: torch.Tensor, y: torch.Tensor, lora, batch) -> None:
    """Every slice of `lora`'s projection expanded into y: one expand for them all where the slices
    start on column-block edges (the widest block that they all start on), else one per slice."""
    edges = [s.out_offset for s in lora.slices[1:]]
    block_n = next((b for b in _EXPAND_BLOCKS_N if all(e % b == 0 for e in edges)), None)
    if len(edges) <= 2 and block_n is not None:
        # One expand over the whole output (q/k/v, gate/up at Llama's sizes): a launch per layer part.
        expand(shrunk, 0, lora.lora_b, y, 0, batch, (*edges, *[_NO_EDGE] * (2 - len(edges))), lora.rank, block_n)
        return
    for i, s in enumerate(lora.slices):
        expand(shrunk, i * lora.rank, lora.b(i), y, s.out_offset, batch)

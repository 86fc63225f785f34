"""The batched LoRA kernels on CUDA (Triton), in punica's SGMV shape: a step's rows grouped by the
adapter slot they run under, shrink (x A^T) then expand (· B^T × scale) added into the wrapped
projection's output.

Why Triton and not a library: punica's kernels and vLLM's are tied to their engines' metadata and
builds; these are two short kernels over Pagoda's own buffers (`lora.LoRABatch`), compiled like
the engine's other Triton kernels, and their grid is fixed by the step's padded row count and the
slot count alone: cdiv(rows, block_m) + slots programs along the rows, each taking one entry of
`LoRABatch.blocks` (up to block_m rows of one slot, gathered through `sorted_rows`) and returning
at once past the step's last block. So CUDA graphs capture the launches once and every replay
serves the adapters its rows name, base rows (slot -1) costing nothing.

The shrink accumulates in float32 and keeps its [rows, slices × R] result in float32; the expand
adds `scale × shrunk · B^T` to the output in float32 and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 64
_BLOCK_K = 64


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
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(1)
    slot, count, mask_m, rows = _block_rows(blocks_ptr, rows_ptr, BLOCK_M)
    if count == 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    a_base = a_ptr + slot.to(tl.int64) * a_stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        a = tl.load(a_base + offs_n[None, :] * a_stride_n + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)
        acc += tl.dot(x, a)
    tl.store(out_ptr + rows[:, None] * out_stride + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _expand_kernel(s_ptr, b_ptr, y_ptr, scale_ptr, rows_ptr, blocks_ptr, R, N, s_offset, split1, split2, s_width,
                   s_stride, b_stride_s, b_stride_n, y_offset, y_stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr):
    pid_n = tl.program_id(1)
    slot, count, mask_m, rows = _block_rows(blocks_ptr, rows_ptr, BLOCK_M)
    if count == 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Which slice's shrunk columns this block of output columns reads (slices start on block edges).
    n0 = pid_n * BLOCK_N
    s_offset += ((n0 >= split1).to(tl.int32) + (n0 >= split2).to(tl.int32)) * s_width
    b_base = b_ptr + slot.to(tl.int64) * b_stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        s = tl.load(s_ptr + rows[:, None] * s_stride + s_offset + offs_r[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_base + offs_n[None, :] * b_stride_n + offs_r[:, None], mask=mask_r[:, None] & mask_n[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.dot(s, b)
    acc = acc * tl.load(scale_ptr + slot)
    y_ptrs = y_ptr + rows[:, None] * y_stride + y_offset + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def shrink(x: torch.Tensor, a: torch.Tensor, batch) -> torch.Tensor:
    """x [T, K], a [slots, N, K] → float32 [T, N]: row t's x · A[its slot]^T for every row of
    `batch.blocks` (rows without a slot are left unwritten)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    t, k = x.shape
    _, n, _ = a.shape
    out = torch.empty((t, n), dtype=torch.float32, device=x.device)
    grid = (batch.max_blocks(t), triton.cdiv(n, _BLOCK_N))
    _shrink_kernel[grid](x, a, out, batch.sorted_rows, batch.blocks, k, n, x.stride(0), a.stride(0), a.stride(1),
                         out.stride(0), BLOCK_M=batch.block_m, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K)
    return out


_NO_SPLIT = 1 << 30  # a slice edge no column reaches


def expand(shrunk: torch.Tensor, s_offset: int, b: torch.Tensor, y: torch.Tensor, y_offset: int, batch,
           splits: tuple[int, int] = (_NO_SPLIT, _NO_SPLIT), s_width: int = 0) -> None:
    """y[t, y_offset + n] += scales[slot] × shrunk[t, s_offset + k(n) × s_width + r] · B[slot, n, r] for
    every row t of `batch.blocks`, in place; b [slots, N, R]; k(n): how many of `splits` (output
    columns where the next slice begins, multiples of the column block) lie at or before n."""
    _, n, r = b.shape
    t = y.shape[0]
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    grid = (batch.max_blocks(t), triton.cdiv(n, _BLOCK_N))
    _expand_kernel[grid](shrunk, b, y, batch.scales, batch.sorted_rows, batch.blocks, r, n, s_offset, splits[0],
                         splits[1], s_width, shrunk.stride(0), b.stride(0), b.stride(1), y_offset, y.stride(0),
                         BLOCK_M=batch.block_m, BLOCK_N=_BLOCK_N, BLOCK_R=block_r)


def add_lora(x: torch.Tensor, y: torch.Tensor, lora, batch) -> torch.Tensor:
    """`LoRALayer.forward` on CUDA: one shrink for every slice of the projection, then one expand for
    them all where the slices start on column-block edges, else one per slice."""
    if x.shape[0] > batch.max_tokens:  # the grid would read blocks past the table
        raise RuntimeError(f"{x.shape[0]} rows exceed the LoRA block table's {batch.max_tokens}")
    shrunk = shrink(x, lora.lora_a, batch)
    edges = [s.out_offset for s in lora.slices[1:]]
    if len(edges) <= 2 and all(e % _BLOCK_N == 0 for e in edges):
        # One expand over the whole output (q/k/v, gate/up at Llama's sizes): a launch per layer part.
        splits = (*edges, *[_NO_SPLIT] * (2 - len(edges)))
        expand(shrunk, 0, lora.lora_b, y, 0, batch, splits, lora.rank)
        return y
    for i, s in enumerate(lora.slices):
        expand(shrunk, i * lora.rank, lora.b(i), y, s.out_offset, batch)
    return y

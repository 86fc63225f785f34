"""Attention of speculative decoding's verification steps on CUDA (Triton): every request of the
step has a few new tokens (its last one and its drafts, at most `query_len`), each attending
causally to the request's cached tokens and to the new tokens before it.

A verification batch is laid out for a CUDA graph as a decode batch is, one fixed block of rows
per request: request b's new tokens are rows b * query_len .. b * query_len + q_b - 1 of q, the
rest of its block padding (`padded_rows`). So one graph per batch size serves every mix of draft
lengths (a request with no draft is a block of one real row), and its GEMMs run at
batch × query_len rows, where the few-row projections cost about what one row does. Padding rows
(and padding requests, one token on the null page) compute something finite that nobody reads.

The kernel is `decode_triton`'s small-batch kernel (its slicing, online softmax and merge are
that module's) widened from a KV head's query group to the group of every new token of the
request: program (b, h, s) loads the request's query_len × group query rows of KV head h (one
tensor-core tile), reads the s-th slice of the request's K/V once for all of them, and masks each
row to its own causal limit (row j of a request with q_b new tokens of seq_len in all sees tokens
[0, seq_len - q_b + j]). Slices that are past a row's limit leave it empty: its partial is written
with weight 0, so the merge needs no special case. As in `decode_triton`, the program that
finishes a (b, h)'s slices last merges them and puts its counter back to 0, so a captured graph
replays without clearing anything.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl
from pagoda_engine.worker.attention.decode_triton import (BLOCK_N, MAX_SPLITS, MERGE_VALUES, NUM_WARPS, _attend_block,
                                                          _check_strides, _empty_softmax, _is_last_slice, _kv_block,
                                                          _merged_slices, _slice_of)

# Query rows one program holds (a request's new tokens × the query heads of one KV head): its
# accumulator is ROWS × head_dim float32 in registers.
MAX_ROWS = 64


@triton.jit
def _verify_kernel(q_ptr, k_ptr, v_ptr, out_ptr, indptr_ptr, indices_ptr, last_ptr, qo_len_ptr,
                   part_o_ptr, part_lse_ptr, counter_ptr, sm_scale_log2,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kp, stride_kt, stride_kh,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, QUERY_LEN: tl.constexpr, ROWS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   MAX_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    first_page, seq_len, num_splits, chunk = _slice_of(indptr_ptr, last_ptr, b, PAGE_SIZE, BLOCK_N, MAX_SPLITS)
    qo_len = tl.load(qo_len_ptr + b)
    if s >= num_splits:
        return
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)

    # Row r: new token j = r // GROUP of the request, query head h * GROUP + r % GROUP.
    r = tl.arange(0, ROWS)
    j = r // GROUP
    head = h * GROUP + r % GROUP
    d = tl.arange(0, HEAD_DIM)
    rows_ok = r < QUERY_LEN * GROUP
    token = b * QUERY_LEN + j
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=rows_ok[:, None],
                other=0.0)
    # Each row's causal limit; a padding row (j >= qo_len) takes the last real row's.
    limit = seq_len - qo_len + tl.minimum(j, qo_len - 1) + 1
    m, lsum, acc = _empty_softmax(ROWS, HEAD_DIM)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(indices_ptr + first_page + t // PAGE_SIZE, mask=t_ok, other=0)
        k, v = _kv_block(k_ptr, v_ptr, page, t, t_ok, h, stride_kp, stride_kt, stride_kh, PAGE_SIZE, HEAD_DIM)
        m, lsum, acc = _attend_block(q, k, v, t, t_ok, limit, m, lsum, acc, sm_scale_log2, True)

    seen = lsum > 0.0
    o = acc / tl.where(seen, lsum, 1.0)[:, None]
    out_rows = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    if num_splits == 1:  # every row sees token 0, so none is empty here
        tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])
        return
    part = (b * NUM_KV_HEADS + h) * MAX_SPLITS
    tl.store(part_o_ptr + ((part + s) * ROWS + r[:, None]) * HEAD_DIM + d[None, :], o)
    tl.store(part_lse_ptr + (part + s) * ROWS + r, tl.where(seen, m + tl.log2(tl.where(seen, lsum, 1.0)),
                                                            float("-inf")))
    if _is_last_slice(counter_ptr, b, h, NUM_KV_HEADS, num_splits):  # every row sees token 0, in slice 0
        merged, total = _merged_slices(part_o_ptr, part_lse_ptr, part, num_splits, ROWS, HEAD_DIM, MAX_SPLITS,
                                       MERGE_CHUNK)
        tl.store(out_rows, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=rows_ok[:, None])
        tl.store(counter_ptr + b * NUM_KV_HEADS + h, 0)


def rows_per_program(query_len: int, group: int) -> int:
    """The tile of query rows one program holds: every new token's query heads of one KV head,
    padded to a power of two of at least 16 (the tensor cores' smallest)."""
    return max(16, triton.next_power_of_2(query_len * group))


def applies(num_qo_heads: int, num_kv_heads: int, head_dim: int, query_len: int) -> bool:
    """The kernel serves these heads at this query length: head_dim 64 or 128 (as `decode_triton`)
    and a request's query_len × group rows within `MAX_ROWS`."""
    return (num_qo_heads % num_kv_heads == 0 and head_dim in (64, 128) and query_len >= 1
            and rows_per_program(query_len, num_qo_heads // num_kv_heads) <= MAX_ROWS)


def padded_rows(query_lens: list[int], query_len: int) -> np.ndarray:
    """int64 [sum(query_lens)]: the row of each new token (in batch order) in the padded layout,
    request b's from b * query_len on."""
    lens = np.asarray(query_lens, dtype=np.int64)
    if len(lens) and (lens.min() < 1 or lens.max() > query_len):
        raise ValueError(f"query lengths {query_lens} outside [1, {query_len}]")
    starts = np.repeat(np.arange(len(lens), dtype=np.int64) * query_len, lens)
    firsts = np.repeat(np.cumsum(lens) - lens, lens)
    return starts + np.arange(int(lens.sum()), dtype=np.int64) - firsts


class VerifyDecode:
    """Scratch for up to `max_batch` requests of up to `query_len` new tokens each, and the launch."""

    def __init__(self, max_batch: int, query_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, device: torch.device):
        if not applies(num_qo_heads, num_kv_heads, head_dim, query_len):
            raise ValueError(f"{query_len} new tokens of {num_qo_heads} query heads over {num_kv_heads} KV heads of "
                             f"{head_dim}: at most {MAX_ROWS} rows of heads of 64 or 128")
        self.max_batch, self.query_len, self.num_kv_heads = max_batch, query_len, num_kv_heads
        self.head_dim, self.page_size, self.group = head_dim, page_size, num_qo_heads // num_kv_heads
        self.rows = rows_per_program(query_len, self.group)
        self.merge_chunk = max(1, min(MAX_SPLITS, MERGE_VALUES // (self.rows * head_dim)))
        slices = max_batch * num_kv_heads * MAX_SPLITS * self.rows
        self.part_o = torch.empty(slices * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(slices, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)
        self.sm_scale_log2 = head_dim ** -0.5 * 1.4426950408889634

    def __call__(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, indptr: torch.Tensor,
                 indices: torch.Tensor, last_page_len: torch.Tensor, qo_lens: torch.Tensor,
                 out: torch.Tensor) -> None:
        """q [B * query_len, num_qo_heads, head_dim] in the padded layout -> out (same shape); the
        CSR page table of the B requests (their lengths include the new tokens) and each one's
        number of real new tokens `qo_lens` (int32 [B], each in [1, query_len])."""
        batch = q.shape[0] // self.query_len
        if batch * self.query_len != q.shape[0] or batch > self.max_batch:
            raise ValueError(f"{q.shape[0]} query rows are not at most {self.max_batch} requests of {self.query_len}")
        _check_strides(q, k_pages, v_pages, out)
        _verify_kernel[(batch, self.num_kv_heads, MAX_SPLITS)](
            q, k_pages, v_pages, out, indptr, indices, last_page_len, qo_lens, self.part_o, self.part_lse,
            self.counters, self.sm_scale_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            NUM_KV_HEADS=self.num_kv_heads, GROUP=self.group, QUERY_LEN=self.query_len, ROWS=self.rows,
            HEAD_DIM=self.head_dim, PAGE_SIZE=self.page_size, BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS,
            MERGE_CHUNK=self.merge_chunk, num_warps=NUM_WARPS, num_stages=1, **pdl.launch(q.device))

"""Decode attention on CUDA (Triton) for the batch sizes where FlashInfer's decode leaves time on
the table: one or two requests (`SmallBatchDecode`), and large batches (`LargeBatchDecode`).

**One or two requests.** At one request FlashInfer's decode launches its attention kernel and
then a kernel that merges the split-KV partial results, and its attention kernel makes several
rounds of dependent loads (its plan's work lists, the page table) before it reads K/V. At L1's
contexts (a few hundred tokens) a layer's K/V is under a megabyte, so those launches are almost
all latency: with the gaps around them about 13 µs a layer on an H200, where the bytes take under
one.

Here program (b, h, s) attends request b's query heads of KV head h (the grouped-query group,
padded to 16 rows for the tensor cores) over the s-th slice of the request's tokens: one block of
BLOCK_N tokens while the request has at most MAX_SPLITS blocks, so at short contexts each program
makes one round of loads (page ids, then K and V). A request of one slice writes its output
directly. Otherwise each program writes its partial output and log-sum-exp (base 2) to a float32
scratch, and the program that finishes a (b, h)'s slices last, which an atomic counter names,
merges them and writes the output; it then puts the counter back to 0, so the kernel needs no
clearing between launches and replays in a CUDA graph. The slicing is decided in the kernel from
each request's length, so a graph captured once serves every length; at long contexts (thousands
of tokens) FlashInfer's kernels are faster, and the backend uses this one only up to
`SHORT_CONTEXT` tokens (H200, µs a layer, 32 layers in one graph, this / FlashInfer's two kernels:
Llama-3.1-8B's heads 6.5 / 9.7 at 128 tokens, 7.6 / 11.2 at 640, 8.5 / 11.1 at 1,024, 15.5 / 14.9
at 4,096; Qwen3-30B-A3B's 7.6 / 10.0, 8.6 / 10.7, 12.1 / 11.3, 17.0 / 13.3).

**Large batches** (`LARGE_BATCH` requests or more, each of at most `LARGE_CONTEXT` tokens). The
batch alone fills the GPU, so one program takes all of a request's tokens for one KV head, with
no split and no merge, its loop software-pipelined (`LARGE_STAGES` blocks of K/V in flight), and
the programs start longest request first (`longest_first`), so that short ones fill the step's end. On
an H200 FlashInfer's graph-planned decode (split-KV and its merge) reads K/V at 3.3-3.5 TB/s of
the 4.27 TB/s copy bandwidth; this reads at 3.6-4.2 (µs a layer, this / FlashInfer's, contexts of
600-1,200 tokens with Qwen3-30B-A3B's heads: 64 requests 40 / 43, 128: 65 / 74, 200: 97 / 107,
256: 124 / 133; 1,000-1,200 with Llama-3.1-8B's: 64: 74 / 84, 128: 141 / 156, 256: 274 / 294).
Longer contexts keep FlashInfer's split-KV: one program's share of a long request would be the
step's tail.

Both take FlashInfer's CSR page table (`kv_indptr`, `kv_indices`, `kv_last_page_len`, int32, on
the device) over the layer's `[num_pages, 2, page_size, num_kv_heads, head_dim]` ("NHD") cache,
so the graph buffers the FlashInfer backend keeps serve all three.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl

MAX_SPLITS = 32  # slices a request's tokens may make; the launch grid's last dimension
BLOCK_G = 16  # rows of a KV head's query group in the tensor-core tiles (grouped-query groups up to 16)
BLOCK_N = 64  # tokens a program reads in one round of loads
MAX_BATCH = 2  # requests a decode step may have for this kernel (4 were no faster than FlashInfer's)
SHORT_CONTEXT = 1024  # tokens a request may have for this kernel
MERGE_VALUES = 16384  # float32 partial values the merging program reads at once
NUM_WARPS = 4
LARGE_BATCH = 64  # requests from which a decode step takes `LargeBatchDecode` (at 32 FlashInfer's is faster)
LARGE_CONTEXT = 2048  # tokens a request may have for it
LARGE_BLOCK_N = 64  # tokens per block of its loop
LARGE_STAGES = 3  # blocks of K/V in flight


@triton.jit
def _group_rows(ptr, b, h, stride_b, stride_h, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Pointers to request b's query heads of KV head h in a [B, heads, HEAD_DIM] tensor,
    [BLOCK_G, HEAD_DIM], and the mask of the GROUP rows that exist."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    return ptr + b * stride_b + (h * GROUP + g)[:, None] * stride_h + d[None, :], (g < GROUP)[:, None]


@triton.jit
def _empty_softmax(BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The running softmax of `_attend_block` before any block: maxima, sums, output."""
    return (tl.full([BLOCK_G], float("-inf"), tl.float32), tl.zeros([BLOCK_G], tl.float32),
            tl.zeros([BLOCK_G, HEAD_DIM], tl.float32))


@triton.jit
def _kv_block(k_ptr, v_ptr, page, t, t_ok, h, stride_kp, stride_kt, stride_kh, PAGE_SIZE: tl.constexpr,
              HEAD_DIM: tl.constexpr):
    """KV head h's K and V of tokens t (in pages `page`), [len(t), HEAD_DIM] each."""
    d = tl.arange(0, HEAD_DIM)
    row = page.to(tl.int64) * stride_kp + (t % PAGE_SIZE) * stride_kt + h * stride_kh
    k = tl.load(k_ptr + row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
    v = tl.load(v_ptr + row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _request_tokens(indptr_ptr, last_ptr, b, PAGE_SIZE: tl.constexpr):
    """Request b's first entry in the CSR page table and its number of tokens."""
    first_page = tl.load(indptr_ptr + b)
    return first_page, (tl.load(indptr_ptr + b + 1) - first_page - 1) * PAGE_SIZE + tl.load(last_ptr + b)


@triton.jit
def _slice_of(indptr_ptr, last_ptr, b, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Request b's first entry in the page table, its number of tokens, the slices they make and
    the tokens of a slice. A slice is a whole number of BLOCK_N-token blocks: one block while the
    request has at most MAX_SPLITS of them, so at L1's lengths each program makes one round of
    loads. Program s takes tokens [s * chunk, min((s + 1) * chunk, seq_len)), if s < num_splits."""
    first_page, seq_len = _request_tokens(indptr_ptr, last_ptr, b, PAGE_SIZE)
    chunk = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), MAX_SPLITS) * BLOCK_N
    num_splits = tl.cdiv(seq_len, chunk)
    return first_page, seq_len, num_splits, chunk


@triton.jit
def _is_last_slice(counter_ptr, b, h, NUM_KV_HEADS: tl.constexpr, num_splits):
    """Count this program's slice of (b, h) in, its partials stored, and whether it was the last
    of the slices to finish: that one merges them. Every thread's partial stores are done before
    one thread's release-acquire increment, so the program that sees the last count sees every
    slice's partials."""
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr + b * NUM_KV_HEADS + h, 1, sem="acq_rel") == num_splits - 1


@triton.jit
def _merged_slices(part_o_ptr, part_lse_ptr, part, num_splits, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   MAX_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr):
    """The output of `num_splits` slices' partials ([slice, ROWS, HEAD_DIM] float32 outputs and
    [slice, ROWS] log2-sum-exps from slice `part` on), [ROWS, HEAD_DIM]; the partials are read
    MERGE_CHUNK slices at a time, past the L1 cache (other programs wrote them), as the sum of
    their weighted outputs and the weights' total (the output: one over the other). Every row must
    have seen a token in some slice."""
    r = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, MAX_SPLITS)
    lse = tl.load(part_lse_ptr + (part + j[:, None]) * ROWS + r[None, :], mask=(j < num_splits)[:, None],
                  other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 0)
    total = tl.sum(tl.exp2(lse - top[None, :]), 0)
    o = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for c in range(0, num_splits, MERGE_CHUNK):
        jc = c + tl.arange(0, MERGE_CHUNK)
        jc_ok = jc < num_splits
        lc = tl.load(part_lse_ptr + (part + jc[:, None]) * ROWS + r[None, :], mask=jc_ok[:, None],
                     other=float("-inf"), cache_modifier=".cg")
        oc = tl.load(part_o_ptr + ((part + jc[:, None, None]) * ROWS + r[None, :, None]) * HEAD_DIM
                     + d[None, None, :], mask=jc_ok[:, None, None], other=0.0, cache_modifier=".cg")
        o += tl.sum(oc * tl.exp2(lc - top[None, :])[:, :, None], 0)
    return o, total


@triton.jit
def _attend_block(q, k, v, t, t_ok, limit, m, lsum, acc, sm_scale_log2, CAUSAL: tl.constexpr):
    """One block of keys and values (of tokens t, those of t_ok real) into the running softmax
    (base 2) of the query rows: their maxima m, sums lsum and unnormalised output acc, returned
    updated. CAUSAL: row i sees only the tokens before `limit[i]`, so a row may have seen no token
    yet (its tokens all lie in later blocks); its maximum stays -inf, and exponents taken from 0
    instead give it zero weight rather than NaN. FP8 pages' values are widened to the queries'
    dtype first (exactly; their scales are the backend's, `base`)."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    scores = tl.dot(q, tl.trans(k)) * sm_scale_log2
    if CAUSAL:
        scores = tl.where(t_ok[None, :] & (t[None, :] < limit[:, None]), scores, float("-inf"))
    else:
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    if CAUSAL:
        m_from = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_from = m_new
    alpha = tl.exp2(m - m_from)
    p = tl.exp2(scores - m_from[:, None])
    lsum = lsum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, lsum, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, indptr_ptr, indices_ptr, last_ptr,
                   part_o_ptr, part_lse_ptr, counter_ptr, sm_scale_log2,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_kp, stride_kt, stride_kh,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   MAX_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    first_page, seq_len, num_splits, chunk = _slice_of(indptr_ptr, last_ptr, b, PAGE_SIZE, BLOCK_N, MAX_SPLITS)
    if s >= num_splits:
        return
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)

    q_rows, rows_ok = _group_rows(q_ptr, b, h, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM)
    q = tl.load(q_rows, mask=rows_ok, other=0.0)
    m, lsum, acc = _empty_softmax(BLOCK_G, HEAD_DIM)
    # The next block's page ids are loaded while this block computes, so a block waits for one
    # round trip (its K/V), not two.
    t = start + tl.arange(0, BLOCK_N)
    page = tl.load(indices_ptr + first_page + t // PAGE_SIZE, mask=t < end, other=0)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        k, v = _kv_block(k_ptr, v_ptr, page, t, t_ok, h, stride_kp, stride_kt, stride_kh, PAGE_SIZE, HEAD_DIM)
        t_next = t + BLOCK_N
        page = tl.load(indices_ptr + first_page + t_next // PAGE_SIZE, mask=t_next < end, other=0)
        m, lsum, acc = _attend_block(q, k, v, t, t_ok, 0, m, lsum, acc, sm_scale_log2, False)

    if num_splits == 1:
        out_rows, _ = _group_rows(out_ptr, b, h, stride_ob, stride_oh, GROUP, BLOCK_G, HEAD_DIM)
        tl.store(out_rows, (acc / lsum[:, None]).to(out_ptr.dtype.element_ty), mask=rows_ok)
        return
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < GROUP
    # Partials: [batch, kv head, slice, GROUP_P2, HEAD_DIM] float32 and [..., GROUP_P2] log2-sum-exp.
    part = (b * NUM_KV_HEADS + h) * MAX_SPLITS
    tl.store(part_o_ptr + ((part + s) * GROUP_P2 + g[:, None]) * HEAD_DIM + d[None, :], acc / lsum[:, None],
             mask=g_ok[:, None])
    tl.store(part_lse_ptr + (part + s) * GROUP_P2 + g, m + tl.log2(lsum), mask=g_ok)
    if _is_last_slice(counter_ptr, b, h, NUM_KV_HEADS, num_splits):
        o, total = _merged_slices(part_o_ptr, part_lse_ptr, part, num_splits, GROUP_P2, HEAD_DIM, MAX_SPLITS,
                                  MERGE_CHUNK)
        gm = tl.arange(0, GROUP_P2)
        merged = out_ptr + b * stride_ob + (h * GROUP + gm[:, None]) * stride_oh + d[None, :]
        tl.store(merged, (o / total[:, None]).to(out_ptr.dtype.element_ty), mask=(gm < GROUP)[:, None])
        tl.store(counter_ptr + b * NUM_KV_HEADS + h, 0)


@triton.jit
def _large_batch_kernel(q_ptr, k_ptr, v_ptr, out_ptr, indptr_ptr, indices_ptr, last_ptr, order_ptr, sm_scale_log2,
                        stride_qb, stride_qh, stride_ob, stride_oh, stride_kp, stride_kt, stride_kh,
                        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program (h, i): the query heads of KV head h of request b = order[i] over all of its tokens.
    The GPU starts programs in grid order (h fastest), so `order` longest first starts the longest
    requests first and leaves the short ones to fill the end of the step."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    h = tl.program_id(0)
    b = tl.load(order_ptr + tl.program_id(1))
    first_page, seq_len = _request_tokens(indptr_ptr, last_ptr, b, PAGE_SIZE)
    q_rows, rows_ok = _group_rows(q_ptr, b, h, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM)
    q = tl.load(q_rows, mask=rows_ok, other=0.0)
    m, lsum, acc = _empty_softmax(BLOCK_G, HEAD_DIM)
    for t0 in tl.range(0, seq_len, BLOCK_N, num_stages=STAGES):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < seq_len
        page = tl.load(indices_ptr + first_page + t // PAGE_SIZE, mask=t_ok, other=0)
        k, v = _kv_block(k_ptr, v_ptr, page, t, t_ok, h, stride_kp, stride_kt, stride_kh, PAGE_SIZE, HEAD_DIM)
        m, lsum, acc = _attend_block(q, k, v, t, t_ok, 0, m, lsum, acc, sm_scale_log2, False)
    out_rows, _ = _group_rows(out_ptr, b, h, stride_ob, stride_oh, GROUP, BLOCK_G, HEAD_DIM)
    tl.store(out_rows, (acc / lsum[:, None]).to(out_ptr.dtype.element_ty), mask=rows_ok)


def applies(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """The kernel serves these heads: query groups of up to BLOCK_G heads of 64 or 128 (the sizes
    its GPU tests check; others keep FlashInfer's decode)."""
    return num_qo_heads % num_kv_heads == 0 and num_qo_heads // num_kv_heads <= BLOCK_G and head_dim in (64, 128)


def _check_heads(num_qo_heads: int, num_kv_heads: int, head_dim: int) -> None:
    if not applies(num_qo_heads, num_kv_heads, head_dim):
        raise ValueError(f"{num_qo_heads} query heads over {num_kv_heads} KV heads of {head_dim}: "
                         f"groups of up to {BLOCK_G} heads of 64 or 128")


def _check_strides(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, out: torch.Tensor) -> None:
    if k_pages.stride() != v_pages.stride() or k_pages.stride(-1) != 1 or q.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("K and V pages must share strides, and every last dimension must be contiguous")


class SmallBatchDecode:
    """Scratch for up to `max_batch` requests' decode attention, and the launch."""

    def __init__(self, max_batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 device: torch.device):
        _check_heads(num_qo_heads, num_kv_heads, head_dim)
        self.max_batch, self.num_qo_heads, self.num_kv_heads = max_batch, num_qo_heads, num_kv_heads
        self.head_dim, self.page_size, self.group = head_dim, page_size, num_qo_heads // num_kv_heads
        self.group_p2 = triton.next_power_of_2(self.group)
        # The merging program reads this many slices' partials at once: MERGE_VALUES float32 values.
        self.merge_chunk = max(1, min(MAX_SPLITS, MERGE_VALUES // (self.group_p2 * head_dim)))
        slices = max_batch * num_kv_heads * MAX_SPLITS * self.group_p2
        self.part_o = torch.empty(slices * head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(slices, dtype=torch.float32, device=device)
        self.counters = torch.zeros(max_batch * num_kv_heads, dtype=torch.int32, device=device)
        self.sm_scale_log2 = head_dim ** -0.5 * 1.4426950408889634

    def __call__(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, indptr: torch.Tensor,
                 indices: torch.Tensor, last_page_len: torch.Tensor, out: torch.Tensor) -> None:
        """q [B, num_qo_heads, head_dim] -> out (same shape), softmax scale 1/sqrt(head_dim); K/V
        pages [num_pages, page_size, num_kv_heads, head_dim] (strided views of one cache); the
        CSR page table of the B requests."""
        batch = q.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"{batch} requests exceed the {self.max_batch} this decode was sized for")
        _check_strides(q, k_pages, v_pages, out)
        _decode_kernel[(batch, self.num_kv_heads, MAX_SPLITS)](
            q, k_pages, v_pages, out, indptr, indices, last_page_len, self.part_o, self.part_lse, self.counters,
            self.sm_scale_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            NUM_KV_HEADS=self.num_kv_heads, GROUP=self.group, GROUP_P2=self.group_p2, BLOCK_G=BLOCK_G,
            HEAD_DIM=self.head_dim, PAGE_SIZE=self.page_size, BLOCK_N=BLOCK_N, MAX_SPLITS=MAX_SPLITS,
            MERGE_CHUNK=self.merge_chunk, num_warps=NUM_WARPS, num_stages=1, **pdl.launch(q.device))


def longest_first(seq_lens) -> np.ndarray:
    """`LargeBatchDecode`'s program order: the requests by length, longest first (ties in batch
    order). One program per request and KV head, of very different lengths, in batch order left
    a step's last wave to a few long requests: about 80 % of a whole wave's work was done in a
    simulation of N1's steps at two programs per SM, about 90-98 % longest first (the classic
    longest-processing-time rule for list scheduling)."""
    return np.argsort(-np.asarray(seq_lens, dtype=np.int64), kind="stable").astype(np.int32)


class LargeBatchDecode:
    """The launch for `LARGE_BATCH` requests or more (it needs no scratch)."""

    def __init__(self, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int):
        _check_heads(num_qo_heads, num_kv_heads, head_dim)
        self.num_kv_heads, self.head_dim, self.page_size = num_kv_heads, head_dim, page_size
        self.group = num_qo_heads // num_kv_heads
        self.sm_scale_log2 = head_dim ** -0.5 * 1.4426950408889634

    def __call__(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, indptr: torch.Tensor,
                 indices: torch.Tensor, last_page_len: torch.Tensor, order: torch.Tensor, out: torch.Tensor) -> None:
        """As `SmallBatchDecode.__call__`, for any number of requests, started in `order` (int32 on
        the device, a permutation of the requests: `longest_first` of their lengths)."""
        _check_strides(q, k_pages, v_pages, out)
        _large_batch_kernel[(self.num_kv_heads, q.shape[0])](
            q, k_pages, v_pages, out, indptr, indices, last_page_len, order, self.sm_scale_log2,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_pages.stride(0), k_pages.stride(1),
            k_pages.stride(2), GROUP=self.group, BLOCK_G=BLOCK_G, HEAD_DIM=self.head_dim, PAGE_SIZE=self.page_size,
            BLOCK_N=LARGE_BLOCK_N, STAGES=LARGE_STAGES, num_warps=NUM_WARPS, num_stages=LARGE_STAGES,
            **pdl.launch(q.device))

"""The experts of an MoE layer on the GPU: Triton grouped GEMMs over tokens sorted by expert
(vLLM's fused-MoE design), and the routing that picks them.

0. `route`: softmax, top-k and renormalisation of one token in one program.

1. `align_by_expert`: the (token, slot) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M, with the expert of every block; static shapes, so it runs inside a CUDA
   graph (`align_by_expert_reference` is the same in torch operations). One launch of a program
   per expert for a decode batch's pairs; a grid of programs (count, offsets, place) for a
   prefill's.
2. One grouped GEMM for gate+up: each program takes one block of one expert's pairs and a slice
   of the columns, reading only the rows of its tokens; up to `SILU_IN_GATE_UP_MAX_TOKENS` tokens
   it takes a slice of the I columns of both the gate and the up rows and applies SiLU-and-mul
   itself, past it FlashInfer's SiLU-and-mul follows.
3. One grouped GEMM for down, scaled by the routing weight of each pair.
4. The combine: each token's top_k rows summed (`_combine_kernel`).

Up to `GEMV_MAX_TOKENS` tokens (a small decode batch) steps 1-4 are two matrix-vector kernels
instead: gate+up with the SiLU for each (token, slot) pair straight from its expert's rows, then
down with the weighted combine for each token, all of its slots at once (`_experts_gemv`).

`fused_experts_reference` in `moe.py` is the reference this is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl
from pagoda_engine.worker.model import fp8_quant_triton
from pagoda_engine.worker.model.fp8_math import FP8_DTYPE, FP8_MAX, MIN_AMAX
from pagoda_engine.worker.model.gemv_triton import dot_rows
from pagoda_engine.worker.model.layers import SiluAndMul

# Integer arguments that change from step to step (tokens x top-k): not specialised, so that one
# compiled kernel serves every count. Triton otherwise compiles a variant for counts divisible by
# 16 and one for the rest, the first time each occurs: on a live step, 100-300 ms.
_PER_STEP = ["num_pairs"]


# The grouped GEMM's A_SCALES (the kernel compares the numbers): A in the activations' dtype, not
# scaled (0); e4m3 values with a float32 scale per row, applied to the finished sums (1: the
# tokens entering gate+up); or per row and BLOCK_K columns, applied to each K step's partial sums
# (2: the activation entering down, quantized by the gate+up kernel's epilogue).
A_UNSCALED, A_SCALED_PER_ROW, A_SCALED_PER_ROW_AND_K_BLOCK = 0, 1, 2


@triton.jit(do_not_specialize=_PER_STEP)
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr, b_scale_ptr, a_scale_ptr, c_scale_ptr, sorted_pairs_ptr, block_experts_ptr,
    num_padded_ptr, N, K, num_pairs, rows_per_a, max_padded, num_local,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_se, stride_as, stride_cs,
    MUL_WEIGHT: tl.constexpr, SILU_AND_MUL: tl.constexpr, B_SCALED: tl.constexpr, A_SCALES: tl.constexpr,
    C_SCALED: tl.constexpr, QMAX: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """C[pair, :] = A[pair // rows_per_a, :] @ B[expert(pair)]^T (× weight[pair]) for the pairs of
    one block; B is [experts, N, K]. With SILU_AND_MUL, B is [experts, 2N, K] (gate rows, then up
    rows) and C[pair, :] = silu(gate) × up, each product rounded to C's dtype first, as the
    separate SiLU-and-mul kernel sees them. With B_SCALED, B holds FP8 values with a float32 scale
    per row ([experts, rows], stride_se), applied to the float32 sums; with A_SCALES A_UNSCALED
    they are widened to A's dtype as they load (exactly: e4m3 values are bf16/fp16 values), else
    A holds e4m3 values too and the dot is FP8 × FP8 (Hopper's FP8 MMA, float32 sums), A's scales
    ([rows, K groups], stride_as) applied as A_SCALES says. With C_SCALED (after SILU_AND_MUL:
    the activation, in float32, not rounded) C is e4m3, quantized per row over this program's
    BLOCK_N columns: a scale per row and column block ([pairs, column blocks], stride_cs), its
    largest magnitude (at least MIN_AMAX) mapping to QMAX, as `fp8_math.quantize_groups`."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    # Grouped ordering over the static grid (GROUP_M row blocks share each B tile while it is in
    # L2); blocks past the padded length of this routing do nothing.
    num_blocks_m = tl.cdiv(max_padded, BLOCK_M)
    num_blocks_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_blocks_n
    first_m = (pid // in_group) * GROUP_M
    group_size = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
    pair_mask = pairs < num_pairs
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :] * stride_cn
    c_mask = pair_mask[:, None] & (cols[None, :] < N)
    if expert >= num_local:  # pairs whose expert another rank holds contribute nothing here
        tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32).to(c_ptr.dtype.element_ty), mask=c_mask)
        return
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = pairs // rows_per_a
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if B_SCALED and A_SCALES == 0:
            b = b.to(a.dtype)
        if A_SCALES == 2:
            # The K block's scale of each row, on this step's partial sums (its columns' e4m3 values
            # share it); the rows past num_pairs are masked to 0.
            a_scale = tl.load(a_scale_ptr + a_rows * stride_as + k, mask=pair_mask, other=0.0)
            acc += tl.dot(a, b) * a_scale[:, None]
        else:
            acc += tl.dot(a, b)
        if SILU_AND_MUL:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=offs_k[:, None] < k_left, other=0.0)
            if B_SCALED and A_SCALES == 0:
                b_up = b_up.to(a.dtype)
            acc_up += tl.dot(a, b_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if A_SCALES == 1:
        a_scale = tl.load(a_scale_ptr + a_rows * stride_as, mask=pair_mask, other=0.0)[:, None]
        acc = acc * a_scale
        if SILU_AND_MUL:
            acc_up = acc_up * a_scale
    if B_SCALED:
        acc = acc * tl.load(b_scale_ptr + expert * stride_se + offs_n)[None, :]
        if SILU_AND_MUL:
            acc_up = acc_up * tl.load(b_scale_ptr + expert * stride_se + N + offs_n)[None, :]
    if SILU_AND_MUL:
        if C_SCALED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        else:
            gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0)
        acc = acc * w[:, None]
    if C_SCALED:
        # The columns past N (offs_n wrapped round to valid ones) stay out of the row's largest magnitude.
        amax = tl.max(tl.where(c_mask, tl.abs(acc), 0.0), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, MIN_AMAX), tl.zeros_like(amax) + QMAX)  # IEEE, as torch's
        q = tl.math.div_rn(acc, tl.zeros_like(acc) + scale[:, None])  # div_rn does not broadcast
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        tl.store(c_ptrs, q.to(c_ptr.dtype.element_ty), mask=c_mask)
        tl.store(c_scale_ptr + pairs * stride_cs + pid_n, scale, mask=pair_mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_row,
                  TOP_K: tl.constexpr, EXPERTS_POW2: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    """One token's routing in one program: softmax over its experts in float32, the top k in
    descending order, optionally renormalised (`moe.select_experts` in torch is the reference)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, EXPERTS_POW2)
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < num_experts, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    total = 1.0
    if RENORMALIZE:
        remaining = p
        total = 0.0
        for _ in tl.static_range(TOP_K):
            best = tl.max(remaining, 0)
            total += best
            first = tl.min(tl.where(remaining == best, offs, EXPERTS_POW2), 0)
            remaining = tl.where(offs == first, -1.0, remaining)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        first = tl.min(tl.where(p == best, offs, EXPERTS_POW2), 0)
        tl.store(weights_ptr + row * TOP_K + k, (best / total).to(weights_ptr.dtype.element_ty))
        tl.store(ids_ptr + row * TOP_K + k, first)
        p = tl.where(offs == first, -1.0, p)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.select_experts` in one launch: (weights in the logits' dtype, int64 expert ids)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
                                     EXPERTS_POW2=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                                     num_warps=1 if num_experts <= 128 else 4, **pdl.launch(router_logits.device))
    return weights, ids


def _configs(num_tokens: int) -> tuple[dict, dict]:
    """Tile sizes for the (gate+up, down) grouped GEMMs of `num_tokens` tokens; both use the same
    BLOCK_M, which is also the alignment's. Picked by a sweep of 84 configurations at Qwen3-30B-A3B's
    expert shapes on an H200 (benchmarks.md): at decode sizes the GEMMs read weights, so small
    row blocks win; at prefill sizes 128 × 256 tiles run them 15-30 % faster than 64 × 128."""
    if num_tokens <= 32:
        small = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
        return small, small
    if num_tokens <= 128:
        small = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
        return small, small
    if num_tokens <= 384:
        mid = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
        return mid, mid
    if num_tokens <= 768:
        return (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4))
    stages = 4 if num_tokens <= 4096 else 3
    large = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=stages)
    return large, large


@triton.jit(do_not_specialize=_PER_STEP + ["block_m"])
def _align_per_bucket_kernel(ids_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr, num_pairs, num_buckets,
                             block_m, PAIRS: tl.constexpr, MIN_BLOCK_M: tl.constexpr, MAX_BLOCK_M: tl.constexpr,
                             BUCKETS_POW2: tl.constexpr, PDL: tl.constexpr):
    """`align_by_expert` for up to PAIRS pairs in one launch of one program per bucket. Each
    program reads every pair's bucket and counts them all (so it knows where every bucket's run
    starts: no second launch, no atomics), then writes its own run: its pairs in order, the
    sentinel `num_pairs` in the padding, and its bucket as the expert of each of its blocks.
    `block_m` is not a compile-time constant, so one compiled kernel serves every tile size."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bucket = tl.program_id(0)
    offs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=BUCKETS_POW2 - 1).to(tl.int32)
    # The last bin is spare (BUCKETS_POW2 > num_buckets): the pairs past num_pairs land there.
    counts = tl.histogram(ids, BUCKETS_POW2)
    buckets = tl.arange(0, BUCKETS_POW2)
    padded = tl.where(buckets < num_buckets, (counts + block_m - 1) // block_m * block_m, 0)
    starts = tl.cumsum(padded, 0) - padded
    mine = buckets == bucket
    start = tl.sum(tl.where(mine, starts, 0), 0)
    count = tl.sum(tl.where(mine, counts, 0), 0)
    my_padded = tl.sum(tl.where(mine, padded, 0), 0)
    if bucket == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    chosen = ids == bucket
    rank = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(sorted_pairs_ptr + start + rank, offs, mask=chosen)
    pad = tl.arange(0, MAX_BLOCK_M)
    tl.store(sorted_pairs_ptr + start + count + pad, tl.zeros((MAX_BLOCK_M,), dtype=tl.int32) + num_pairs,
             mask=pad < my_padded - count)
    blocks = tl.arange(0, PAIRS // MIN_BLOCK_M)
    tl.store(block_experts_ptr + start // block_m + blocks, tl.zeros_like(blocks) + bucket,
             mask=blocks < my_padded // block_m)


@triton.jit(do_not_specialize=_PER_STEP)
def _count_kernel(ids_ptr, counts_ptr, num_pairs, CHUNK: tl.constexpr):
    """A prefill's alignment, 1 of 3 (a grid of programs): count the pairs into their buckets
    (atomically)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + ids, tl.full(offs.shape, 1, dtype=tl.int32), mask=mask)


@triton.jit
def _offsets_kernel(counts_ptr, ends_ptr, cursor_ptr, block_experts_ptr, num_padded_ptr, max_padded, num_buckets,
                    BLOCK_M: tl.constexpr, BUCKETS_POW2: tl.constexpr, CHUNK: tl.constexpr,
                    SEARCH_STEPS: tl.constexpr):
    """2 of 3 (one program): from the counts, pad each bucket to BLOCK_M, prefix-sum, start each
    bucket's cursor, and find each block's bucket by binary search over the bucket ends."""
    buckets = tl.arange(0, BUCKETS_POW2)
    counts = tl.load(counts_ptr + buckets)
    padded = tl.where(buckets < num_buckets, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    tl.store(ends_ptr + buckets, ends)
    tl.store(cursor_ptr + buckets, ends - padded)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.debug_barrier()
    for start in range(0, max_padded // BLOCK_M, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        first = blocks * BLOCK_M
        # The bucket of a block: the first whose end lies past the block's first entry.
        lo = tl.zeros((CHUNK,), dtype=tl.int32)
        hi = tl.zeros((CHUNK,), dtype=tl.int32) + BUCKETS_POW2
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            past = tl.load(ends_ptr + mid, mask=mid < BUCKETS_POW2, other=0) > first
            hi = tl.where(past, mid, hi)
            lo = tl.where(past, lo, mid + 1)
        tl.store(block_experts_ptr + blocks, tl.minimum(lo, num_buckets - 1), mask=blocks < max_padded // BLOCK_M)


@triton.jit(do_not_specialize=_PER_STEP)
def _scatter_kernel(ids_ptr, sorted_pairs_ptr, cursor_ptr, num_pairs, CHUNK: tl.constexpr):
    """3 of 3 (a grid of programs): put each pair at its bucket's cursor (atomically: the order
    inside a bucket is free, each pair's row is computed on its own)."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    dest = tl.atomic_add(cursor_ptr + ids, tl.full(offs.shape, 1, dtype=tl.int32), mask=mask)
    tl.store(sorted_pairs_ptr + dest, offs, mask=mask)


# Up to this many (token, slot) pairs (512 tokens of top-8: every decode graph) the alignment is
# one launch of a program per bucket (`_align_per_bucket_kernel`, one compiled variant for every
# count); past it, a prefill's, a grid of programs counts and places the pairs (three launches).
PER_BUCKET_MAX_PAIRS = 4096
_MIN_BLOCK_M, _MAX_BLOCK_M = 16, 128  # the grouped GEMMs' row tiles (`_configs`)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids padded per expert with the sentinel `num_pairs`, the expert of each block of
    `block_m` entries, the padded length as a one-element tensor), by the Triton kernels on CUDA;
    `align_by_expert_reference` elsewhere. Shapes depend only on the number of pairs and experts.
    Entries past the padded length are left unwritten (the grouped GEMMs stop there)."""
    if not topk_ids.is_cuda:
        return align_by_expert_reference(topk_ids, num_experts, block_m)
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    max_padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    buckets_pow2 = triton.next_power_of_2(num_experts + 1)
    sorted_pairs = torch.empty(max_padded, dtype=torch.int32, device=flat.device)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=flat.device)
    num_padded = torch.empty(1, dtype=torch.int32, device=flat.device)
    if num_pairs <= PER_BUCKET_MAX_PAIRS:
        if not _MIN_BLOCK_M <= block_m <= _MAX_BLOCK_M:
            raise ValueError(f"block_m {block_m} is outside [{_MIN_BLOCK_M}, {_MAX_BLOCK_M}]")
        _align_per_bucket_kernel[(num_experts,)](flat, sorted_pairs, block_experts, num_padded, num_pairs, num_experts,
                                                 block_m, PAIRS=PER_BUCKET_MAX_PAIRS, MIN_BLOCK_M=_MIN_BLOCK_M,
                                                 MAX_BLOCK_M=_MAX_BLOCK_M, BUCKETS_POW2=buckets_pow2, num_warps=8,
                                                 **pdl.launch(flat.device))
        return sorted_pairs, block_experts, num_padded
    # A prefill's thousands of pairs: count and place them with a grid of programs each.
    sorted_pairs.fill_(num_pairs)  # the padding's sentinel
    scratch = torch.zeros(3, buckets_pow2, dtype=torch.int32, device=flat.device)
    chunk = 1024
    grid = (triton.cdiv(num_pairs, chunk),)
    _count_kernel[grid](flat, scratch[0], num_pairs, CHUNK=chunk, num_warps=4)
    _offsets_kernel[(1,)](scratch[0], scratch[1], scratch[2], block_experts, num_padded, max_padded, num_experts,
                          BLOCK_M=block_m, BUCKETS_POW2=buckets_pow2, CHUNK=256,
                          SEARCH_STEPS=buckets_pow2.bit_length(), num_warps=4)
    _scatter_kernel[grid](flat, sorted_pairs, scratch[2], num_pairs, CHUNK=chunk, num_warps=4)
    return sorted_pairs, block_experts, num_padded


def align_by_expert_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair ids padded per expert with the sentinel `num_pairs`, the expert of each block of
    `block_m` entries, the padded length as a one-element tensor). Shapes depend only on the
    number of pairs and experts, never on the routing, so this can be captured in a CUDA graph."""
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs = flat.numel()
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    rank_in_expert = torch.arange(num_pairs, device=device) - start[flat[order]]
    dest = padded_start[flat[order]] + rank_in_expert
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_experts.to(torch.int32), padded_end[-1:].to(torch.int32)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
                  aligned: tuple, rows_per_a: int, num_pairs: int, cfg: dict, silu_and_mul: bool = False,
                  b_scale: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                  out_scale: torch.Tensor | None = None) -> None:
    """`out` = the grouped GEMM of `_grouped_gemm_kernel`; with `silu_and_mul`, `out` has half of
    b's rows as columns (the activation), and each program takes BLOCK_N / 2 columns of the gate
    and as many of the up rows, so that it reads as much of b as the plain kernel's tile.
    FP8 × FP8 (`a` in e4m3): `a_scale` [rows of a, 1] scales each row, or [rows, K / BLOCK_K] each
    row's K blocks; an e4m3 `out` comes with `out_scale` [pairs, N / BLOCK_N] (after the halving)."""
    sorted_pairs, block_experts, num_padded = aligned
    N, K = b.shape[1], b.shape[2]
    if silu_and_mul:
        N //= 2
        cfg = dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2)
    a_scales = A_UNSCALED
    if a_scale is not None:
        a_scales = A_SCALED_PER_ROW if a_scale.shape[1] == 1 else A_SCALED_PER_ROW_AND_K_BLOCK
        if a_scales == A_SCALED_PER_ROW_AND_K_BLOCK and a_scale.shape[1] != triton.cdiv(K, cfg["BLOCK_K"]):
            raise ValueError(f"{a_scale.shape[1]} scales per row for K {K} in blocks of {cfg['BLOCK_K']}")
    if out_scale is not None and out_scale.shape[1] != triton.cdiv(N, cfg["BLOCK_N"]):
        raise ValueError(f"{out_scale.shape[1]} output scales per row for N {N} in blocks of {cfg['BLOCK_N']}")
    grid = (triton.cdiv(sorted_pairs.numel(), cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _grouped_gemm_kernel[grid](
        a, b, out, weights if weights is not None else out, b_scale if b_scale is not None else out,
        a_scale if a_scale is not None else out, out_scale if out_scale is not None else out,
        sorted_pairs, block_experts, num_padded,
        N, K, num_pairs, rows_per_a, sorted_pairs.numel(), b.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        b_scale.stride(0) if b_scale is not None else 0, a_scale.stride(0) if a_scale is not None else 0,
        out_scale.stride(0) if out_scale is not None else 0,
        MUL_WEIGHT=weights is not None, SILU_AND_MUL=silu_and_mul, B_SCALED=b_scale is not None, A_SCALES=a_scales,
        C_SCALED=out_scale is not None, QMAX=FP8_MAX, MIN_AMAX=MIN_AMAX, **cfg, **pdl.launch(a.device),
    )


@triton.jit
def _gate_up_gemv_kernel(x_ptr, w13_ptr, scale_ptr, act_ptr, ids_ptr, I, num_local, top_k,
                         stride_xm, stride_we, stride_wn, stride_am, stride_se,
                         K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr,
                         PDL: tl.constexpr):
    """A few tokens: for one (token, slot) pair, act[pair, cols] = silu(gate) × up over one block
    of the expert's I columns, read straight from the expert's rows (no alignment, no padding),
    with the one-row kernels' `dot_rows`. SCALED: FP8 rows, each sum times its row's scale."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert >= num_local:  # held by another rank: zeros, which the down kernel weighs by 0
        tl.store(act_ptr + pair * stride_am + cols, tl.zeros((BLOCK_N,), act_ptr.dtype.element_ty), mask=col_mask)
        return
    x_row = x_ptr + (pair // top_k) * stride_xm
    gate_rows = w13_ptr + expert * stride_we + cols[:, None] * stride_wn
    up_rows = gate_rows + I * stride_wn
    g, u = dot_rows(x_row, gate_rows, up_rows, col_mask, K, True, BLOCK_N, BLOCK_K, gate_rows, up_rows, False)
    if SCALED:
        g = g * tl.load(scale_ptr + expert * stride_se + cols, mask=col_mask, other=0.0)
        u = u * tl.load(scale_ptr + expert * stride_se + I + cols, mask=col_mask, other=0.0)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + pair * stride_am + cols, act.to(act_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _down_gemv_kernel(act_ptr, w2_ptr, scale_ptr, out_ptr, ids_ptr, weights_ptr, N, num_local,
                      stride_am, stride_we, stride_wn, stride_om, stride_se,
                      K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SCALED: tl.constexpr, PDL: tl.constexpr):
    """A few tokens: out[token, cols] = Σ over its slots of weight × down(act[pair]), for one block
    of the hidden columns: the down projection and the combine in one pass. The slots' products
    go into one set of BLOCK_K-wide float32 partial sums (each activation scaled by its slot's
    weight first), summed once at the end. No branches: a slot whose expert another rank holds
    masks its rows off (its activation row is zeros), so the unrolled slots' reads can all be in
    flight at once. SCALED: FP8 rows, each times its row's scale as it is widened."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        local = expert < num_local
        weight = tl.where(local, tl.load(weights_ptr + pair).to(tl.float32), 0.0)
        rows = w2_ptr + tl.where(local, expert, 0) * stride_we + cols[:, None] * stride_wn
        row_mask = cols < tl.where(local, N, 0)  # no rows at all for an expert held elsewhere
        if SCALED:
            row_scale = tl.load(scale_ptr + tl.where(local, expert, 0) * stride_se + cols, mask=row_mask, other=0.0)
        for k in tl.static_range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            if k + BLOCK_K <= K:
                a = tl.load(act_ptr + pair * stride_am + ks).to(tl.float32) * weight
                w = tl.load(rows + ks[None, :], mask=row_mask[:, None], other=0.0)
            else:
                a = tl.load(act_ptr + pair * stride_am + ks, mask=ks < K, other=0.0).to(tl.float32) * weight
                w = tl.load(rows + ks[None, :], mask=row_mask[:, None] & (ks[None, :] < K), other=0.0)
            if SCALED:
                acc += w.to(tl.float32) * row_scale[:, None] * a[None, :]
            else:
                acc += w.to(tl.float32) * a[None, :]
    tl.store(out_ptr + token * stride_om + cols, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=col_mask)


# Up to this many tokens the experts run as two matrix-vector kernels per pair (`_experts_gemv`):
# they read the chosen experts' rows with no alignment, no padding and no separate combine.
GEMV_MAX_TOKENS = 4
# (BLOCK_N, BLOCK_K, num_warps) from a sweep at Qwen3-30B-A3B's shapes on an H200, weights L2-cold:
# one token's experts take 22.5 µs a layer (gate+up 14.0, down 8.5; the weight-read floor is 17.7),
# where the aligned grouped GEMMs take 40; four tokens' 67 against 88.
GATE_UP_GEMV_CONFIG = (1, 1024, 4)
DOWN_GEMV_CONFIG_ONE_TOKEN = (2, 512, 2)
DOWN_GEMV_CONFIG = (2, 512, 1)


def _experts_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    ids = topk_ids.flatten()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = GATE_UP_GEMV_CONFIG
    _gate_up_gemv_kernel[(ids.numel(), triton.cdiv(inter, block_n))](
        x, w13, w13_scale if w13_scale is not None else act, act, ids, inter, num_local, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), w13_scale.stride(0) if w13_scale is not None else 0,
        K=hidden, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(hidden)),
        SCALED=w13_scale is not None, num_warps=warps, **pdl.launch(x.device))
    out = torch.empty(num_tokens, w2.shape[1], dtype=x.dtype, device=x.device)
    block_n, block_k, warps = DOWN_GEMV_CONFIG_ONE_TOKEN if num_tokens == 1 else DOWN_GEMV_CONFIG
    _down_gemv_kernel[(num_tokens, triton.cdiv(w2.shape[1], block_n))](
        act, w2, w2_scale if w2_scale is not None else out, out, ids, topk_weights.flatten(), w2.shape[1], num_local,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), w2_scale.stride(0) if w2_scale is not None else 0,
        K=inter, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=min(block_k, triton.next_power_of_2(inter)),
        SCALED=w2_scale is not None, num_warps=warps, **pdl.launch(x.device))
    return out


_SILU_AND_MUL = SiluAndMul()  # FlashInfer's kernel where it applies
# Up to this many tokens the gate+up grouped GEMM applies the SiLU-and-mul itself: one launch and
# one [pairs, 2I] round trip through memory fewer, 2-4 µs a layer at decode sizes (H200,
# Qwen3-30B-A3B). Past it, where the GEMMs' tiles are 128 × 256, two accumulators of 128 × 128
# were 3 % slower than the GEMM and FlashInfer's kernel after it (2,048 tokens: 316 + 0 against
# 284 + 23 µs), so the fused kernel does not pay there.
SILU_IN_GATE_UP_MAX_TOKENS = 768


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The same sum as `moe.fused_experts_reference`, with two grouped GEMMs. `topk_ids` in this
    rank's numbering (`w13.shape[0]` for an expert held elsewhere). FP8 experts: `w13` and `w2` in
    e4m3 with float32 scales per expert and row; from `FP8_MMA_MIN_TOKENS` tokens FP8 × FP8
    (`_fused_experts_fp8`), below it widened in the kernels (activations stay in x's dtype)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens <= GEMV_MAX_TOKENS:
        return _experts_gemv(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if w13_scale is not None and num_tokens >= FP8_MMA_MIN_TOKENS:
        return _fused_experts_fp8(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_pairs = num_tokens * top_k
    gate_up_cfg, down_cfg = _configs(num_tokens)
    # One bucket more than this rank's experts: the pairs whose expert is held elsewhere (id E_local).
    aligned = align_by_expert(topk_ids, w13.shape[0] + 1, gate_up_cfg["BLOCK_M"])
    if num_tokens <= SILU_IN_GATE_UP_MAX_TOKENS:
        act = torch.empty(num_pairs, w13.shape[1] // 2, dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, act, None, aligned, top_k, num_pairs, gate_up_cfg, silu_and_mul=True, b_scale=w13_scale)
    else:
        gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, gate_up, None, aligned, top_k, num_pairs, gate_up_cfg, b_scale=w13_scale)
        act = _SILU_AND_MUL(gate_up)
    down = torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    # The routing weights as they come (the kernel multiplies in float32).
    _grouped_gemm(act, w2, down, topk_weights.flatten(), aligned, 1, num_pairs, down_cfg, b_scale=w2_scale)
    return _combine(down, num_tokens, top_k)


# FP8 experts from this many tokens run FP8 × FP8 (`_fused_experts_fp8`); fewer (the matrix-vector
# kernels' tokens) keep the activations in x's dtype and widen the e4m3 weights. On an H200 at
# Qwen3-30B-A3B's shapes FP8 × FP8 was the faster from 8 tokens on (one layer's experts, µs: 97
# against 107 at 8 tokens; 512 tokens 232 against 361, 8,192 tokens 1,262 against 2,524, the
# FP8 × FP8 figures the sweep's steps without the combine: `bench.moe_kernels --fp8 [--sweep]`).
FP8_MMA_MIN_TOKENS = 5


def _fp8_configs(num_tokens: int) -> tuple[dict, dict]:
    """Tile sizes for the FP8 × FP8 (gate+up with SiLU, down) grouped GEMMs of `num_tokens` tokens:
    the same BLOCK_M (the alignment's); gate+up's BLOCK_N is twice the activation's column group
    (its program quantizes BLOCK_N / 2 columns of each row under one scale) and down's BLOCK_K that
    group (each K step takes one scale per row). Picked by `bench.moe_kernels --fp8 --sweep` (row
    tiles 16-128, groups 64 and 128, 4 or 8 warps, 3 or 4 stages) at Qwen3-30B-A3B's shapes on an
    H200: past 128 tokens 64-column groups and 64 × 128 tiles won throughout (8,192 tokens: gate+up
    696 µs, down 509; with 128-row tiles and 128-column groups 825 and 515)."""
    if num_tokens <= 128:
        gate_up = dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=3)
        down = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    elif num_tokens <= 384:
        gate_up = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
        down = dict(BLOCK_M=32, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    elif num_tokens <= 768:
        gate_up = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
        down = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        gate_up = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
        down = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    return gate_up, down


def _fused_experts_fp8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                       configs: tuple[dict, dict] | None = None) -> torch.Tensor:
    """FP8 experts with FP8 × FP8 products (W8A8, as vLLM's FP8 MoE): x quantized to e4m3 per token
    (`fp8_quant_triton`, as the dense FP8 layers do); gate+up with the SiLU-and-mul writes the
    activation in e4m3, quantized in its epilogue per row and group of BLOCK_N / 2 columns
    (DeepSeek-style block scales: no pass of its own); down takes each group's scale on its K
    step's partial sums, then the row scales and the routing weight. The numbers of
    `moe.fused_experts_reference(..., fp8_act_group=...)`, but for the sums' precision: Triton's
    FP8 dot on Hopper keeps the MMA's own accumulator (Triton's default there, as in vLLM's FP8
    MoE kernels: no promotion to float32 every few K steps), which down's per-group scaling
    promotes every BLOCK_K columns anyway."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    gate_up_cfg, down_cfg = configs or _fp8_configs(num_tokens)
    group = gate_up_cfg["BLOCK_N"] // 2
    if down_cfg["BLOCK_K"] != group or down_cfg["BLOCK_M"] != gate_up_cfg["BLOCK_M"]:
        raise ValueError(f"down's BLOCK_K must be the activation's group ({group}) and both BLOCK_M equal")
    inter = w13.shape[1] // 2
    # The quantization kernel reads rows of unit column stride.
    xq, x_scale = fp8_quant_triton.quantize_tokens(x.contiguous(), FP8_DTYPE, FP8_MAX, MIN_AMAX)
    aligned = align_by_expert(topk_ids, w13.shape[0] + 1, gate_up_cfg["BLOCK_M"])
    act = torch.empty(num_pairs, inter, dtype=FP8_DTYPE, device=x.device)
    act_scale = torch.empty(num_pairs, triton.cdiv(inter, group), dtype=torch.float32, device=x.device)
    _grouped_gemm(xq, w13, act, None, aligned, top_k, num_pairs, gate_up_cfg, silu_and_mul=True, b_scale=w13_scale,
                  a_scale=x_scale, out_scale=act_scale)
    down = torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, topk_weights.flatten(), aligned, 1, num_pairs, down_cfg, b_scale=w2_scale,
                  a_scale=act_scale)
    return _combine(down, num_tokens, top_k)


@triton.jit
def _combine_kernel(down_ptr, out_ptr, N, stride_dm, stride_om, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    PDL: tl.constexpr):
    """out[token, cols] = the sum of the token's TOP_K rows of `down`, in float32, rounded once."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        acc += tl.load(down_ptr + (token * TOP_K + slot) * stride_dm + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


COMBINE_BLOCK_N = 1024


def _combine(down: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Each token's top_k rows of `down` [tokens × top_k, N] summed: [tokens, N] (torch's sum over
    the middle dimension took 6.6 µs for 200 tokens of Qwen3-30B-A3B; this reads them at the
    memory's speed)."""
    n = down.shape[1]
    out = torch.empty(num_tokens, n, dtype=down.dtype, device=down.device)
    block = min(COMBINE_BLOCK_N, triton.next_power_of_2(n))
    _combine_kernel[(num_tokens, triton.cdiv(n, block))](down, out, n, down.stride(0), out.stride(0), TOP_K=top_k,
                                                          BLOCK_N=block, num_warps=4, **pdl.launch(down.device))
    return out

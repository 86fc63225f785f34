"""The verification kernel (`attention/verify_triton.py`) under Triton's CPU interpreter, against
float32 causal attention over the same pages: requests with different numbers of new tokens in one
padded layout (a request with none drafted is one row), one slice and several (rows whose causal
limit ends before a slice's start), more blocks than slices, a group of query heads of 3. In
float16, as tests/engine/test_decode_triton_kernel.py says why.

Skips where Triton does not import; without a GPU it runs with TRITON_INTERPRET=1 (`make test`).
The kernel in CUDA graphs at Llama-3.1-8B's shapes is tests/gpu/test_spec_decode_gpu.py."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from paged_attention_reference import random_csr
from triton_interpreter import import_kernels

import_kernels("pagoda_engine.worker.attention.decode_triton")  # the helpers it shares, interpreted too
kernels = import_kernels("pagoda_engine.worker.attention.verify_triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="without a GPU these kernels run only with TRITON_INTERPRET=1 set")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_PAGES = 200
PAGE = 16


def reference_verify(q_rows: list[torch.Tensor], cache, indptr, indices, last) -> list[torch.Tensor]:
    """Float32 causal attention of each request's new tokens (q_rows[b]: [q_b, Hq, D], the last
    q_b of its tokens) over its pages."""
    outs = []
    for b, q in enumerate(q_rows):
        pages = indices[indptr[b]:indptr[b + 1]].long().to(cache.device)
        n = (len(pages) - 1) * PAGE + int(last[b])
        k, v = (cache[pages, i].reshape(-1, *cache.shape[3:])[:n].float() for i in (0, 1))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("jhd,nhd->jhn", q.float(), k) * q.shape[-1] ** -0.5
        visible = torch.arange(n)[None, :] <= (n - q.shape[0] + torch.arange(q.shape[0]))[:, None]
        scores = scores.masked_fill(~visible.to(scores.device)[:, None, :], float("-inf"))
        outs.append(torch.einsum("jhn,nhd->jhd", scores.softmax(-1), v))
    return outs


def _check(seq_lens: list[int], qo_lens: list[int], query_len: int, heads=(8, 2, 64), seed=0, fp8=False):
    num_qo, num_kv, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_PAGES, 2, PAGE, num_kv, head_dim, generator=gen).half().to(DEVICE)
    if fp8:
        cache = cache.to(torch.float8_e4m3fn)
    batch = len(seq_lens)
    # q a strided view of a qkv projection's output, as the layers hand it, in the padded layout
    # with NaN in the padding rows: nothing real may read them.
    qkv = torch.randn(batch * query_len, (num_qo + 2 * num_kv) * head_dim, generator=gen).half()
    rows = kernels.padded_rows(qo_lens, query_len)
    pad = np.setdiff1d(np.arange(batch * query_len), rows)
    qkv[pad] = float("nan")
    qkv = qkv.to(DEVICE)
    q = qkv[:, :num_qo * head_dim].view(batch * query_len, num_qo, head_dim)
    csr = random_csr(seq_lens, PAGE, NUM_PAGES, random.Random(seed))
    verify = kernels.VerifyDecode(batch, query_len, num_qo, num_kv, head_dim, PAGE, DEVICE)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    verify(q, *cache.unbind(1), *(a.to(DEVICE) for a in csr),
           torch.tensor(qo_lens, dtype=torch.int32, device=DEVICE), out=out)
    starts = [0] + list(np.cumsum(qo_lens)[:-1])
    want = reference_verify([q[rows[s:s + n]] for s, n in zip(starts, qo_lens)], cache, *csr)
    for s, n, expected in zip(starts, qo_lens, want):
        torch.testing.assert_close(out[rows[s:s + n]].float(), expected, atol=2e-2, rtol=2e-2)
    assert not verify.counters.any()  # the merging programs put them back


def test_padded_rows_give_each_request_a_block_of_query_len_rows():
    assert kernels.padded_rows([1, 3, 2], 3).tolist() == [0, 3, 4, 5, 6, 7]
    assert kernels.padded_rows([], 5).tolist() == []
    with pytest.raises(ValueError, match="outside"):
        kernels.padded_rows([4], 3)


@pytest.mark.parametrize("seq_lens,qo_lens", [([9], [5]), ([5], [5]), ([40, 17, 3], [5, 1, 3])], ids=str)
def test_one_slice_each_row_sees_its_own_prefix(seq_lens, qo_lens):
    """Short requests (one slice): a request whose whole sequence is new, one with no draft."""
    _check(seq_lens, qo_lens, query_len=5, seed=sum(seq_lens))


def test_several_slices_merge_rows_whose_limit_ends_before_a_slice():
    """Lengths past one block per slice: later slices hold tokens only the last rows see."""
    block = kernels.BLOCK_N
    _check([3 * block + 2, 2 * block + 1], [5, 4], query_len=5, seed=3)


def test_more_blocks_than_slices(monkeypatch):
    monkeypatch.setattr(kernels, "MAX_SPLITS", 2)
    _check([5 * kernels.BLOCK_N + 3], [3], query_len=3, seed=4)


def test_a_group_of_three_query_heads():
    _check([70, 12], [2, 3], query_len=3, heads=(6, 2, 64), seed=5)


def test_fp8_pages_are_widened_to_the_queries_dtype():
    """FP8 pages (`--kv-cache-dtype fp8`): the stored e4m3 values, widened exactly, against float32
    attention over the same values (the layer's scales are applied outside the kernel)."""
    _check([40, 3 * kernels.BLOCK_N + 9], [5, 2], query_len=5, seed=6, fp8=True)


def test_what_the_kernel_does_not_serve_is_refused():
    """Rows past MAX_ROWS (a long draft over a wide group), heads of other sizes."""
    assert kernels.applies(32, 8, 128, 5)
    assert not kernels.applies(32, 8, 128, 17)  # 68 rows
    assert not kernels.applies(8, 2, 96, 3)
    with pytest.raises(ValueError, match="at most"):
        kernels.VerifyDecode(1, 17, 32, 8, 128, 16, DEVICE)

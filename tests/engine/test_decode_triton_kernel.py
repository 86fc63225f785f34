"""The Triton decode kernels (`attention/decode_triton.py`) under Triton's CPU interpreter,
against float32 attention over the same pages, on small shapes: the small-batch kernel (one slice
written directly, several slices merged by the last program, more blocks than slices) and the
large-batch kernel (lengths at page and block edges, q a strided view of a qkv projection).
In float16: the interpreter's `tl.dot` of bfloat16 operands is wrong (Triton 3.6, numpy 2.4), and
the kernels take either dtype.

Skips where Triton does not import (CPU CI); the kernels at Llama-3.1-8B's and Qwen3-30B-A3B's
shapes, against FlashInfer's decode and in CUDA graphs, are tests/gpu/test_decode_triton_gpu.py."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from paged_attention_reference import random_csr, reference_decode
from triton_interpreter import import_kernels

kernels = import_kernels("pagoda_engine.worker.attention.decode_triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="without a GPU these kernels run only with TRITON_INTERPRET=1 set")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_PAGES = 200


def _inputs(lens: list[int], heads: tuple[int, int, int], page_size: int, seed: int):
    """q (a strided view of a qkv projection's output, as layers hand it), the cache and its CSR
    page table for requests of these lengths."""
    num_qo, num_kv, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(NUM_PAGES, 2, page_size, num_kv, head_dim, generator=gen).half().to(DEVICE)
    qkv = torch.randn(len(lens), (num_qo + 2 * num_kv) * head_dim, generator=gen).half().to(DEVICE)
    q = qkv[:, :num_qo * head_dim].view(len(lens), num_qo, head_dim)
    csr = random_csr(lens, page_size, NUM_PAGES, random.Random(seed))
    return q, cache, csr


def _run(decode, q, cache, csr, order=None) -> torch.Tensor:
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    extra = () if order is None else (torch.as_tensor(order, dtype=torch.int32).to(DEVICE),)
    decode(q, *cache.unbind(1), *(a.to(DEVICE) for a in csr), *extra, out=out)
    return out


@pytest.mark.parametrize("heads", [(8, 2, 64), (6, 2, 64)], ids=["group4", "group3"])
@pytest.mark.parametrize("lens", [[1], [17], [64], [65, 3], [200, 64]], ids=str)
def test_small_batch_kernel_matches_float32_attention(heads, lens):
    """One slice (written directly), several (merged by the last program to finish, which puts its
    counter back to 0)."""
    num_qo, num_kv, head_dim = heads
    q, cache, csr = _inputs(lens, heads, 16, seed=sum(lens))
    decode = kernels.SmallBatchDecode(2, num_qo, num_kv, head_dim, 16, DEVICE)
    want = reference_decode(q, cache, *csr, 16)
    torch.testing.assert_close(_run(decode, q, cache, csr).float(), want, atol=2e-2, rtol=2e-2)
    assert not decode.counters.any()


def test_small_batch_kernel_takes_several_blocks_a_slice_past_max_splits(monkeypatch):
    """A request of more blocks than slices: each slice loops over several blocks."""
    monkeypatch.setattr(kernels, "MAX_SPLITS", 2)
    heads = (8, 2, 64)
    lens = [3 * kernels.BLOCK_N + 5]
    q, cache, csr = _inputs(lens, heads, 16, seed=4)
    decode = kernels.SmallBatchDecode(1, *heads, 16, DEVICE)
    torch.testing.assert_close(_run(decode, q, cache, csr).float(), reference_decode(q, cache, *csr, 16),
                               atol=2e-2, rtol=2e-2)
    assert not decode.counters.any()


@pytest.mark.parametrize("page_size", [16, 32])
def test_large_batch_kernel_matches_float32_attention(page_size):
    """Lengths at page and block edges and past one block, in one launch."""
    heads = (8, 2, 64)
    block = kernels.LARGE_BLOCK_N
    lens = [1, page_size - 1, page_size, page_size + 1, block, block + 1, 2 * block + 7, 150]
    q, cache, csr = _inputs(lens, heads, page_size, seed=page_size)
    decode = kernels.LargeBatchDecode(*heads, page_size)
    want = reference_decode(q, cache, *csr, page_size)
    longest_first = kernels.longest_first(lens)
    torch.testing.assert_close(_run(decode, q, cache, csr, longest_first).float(), want, atol=2e-2, rtol=2e-2)
    # Any order of the programs writes the same rows.
    shuffled = list(range(len(lens)))
    random.Random(page_size).shuffle(shuffled)
    torch.testing.assert_close(_run(decode, q, cache, csr, shuffled), _run(decode, q, cache, csr, longest_first))


def test_longest_first_orders_requests_by_length_ties_in_batch_order():
    assert kernels.longest_first([5, 900, 5, 17, 900]).tolist() == [1, 4, 3, 0, 2]
    assert kernels.longest_first([7]).dtype == np.int32


def test_heads_the_kernels_do_not_serve_are_refused():
    """Query groups over BLOCK_G heads, or heads of other sizes, keep FlashInfer's decode."""
    for heads in ((64, 2, 64), (8, 2, 96)):
        assert not kernels.applies(*heads)
        with pytest.raises(ValueError, match="groups of up to"):
            kernels.LargeBatchDecode(*heads, 16)
        with pytest.raises(ValueError, match="groups of up to"):
            kernels.SmallBatchDecode(2, *heads, 16, DEVICE)


@pytest.mark.parametrize("longest_first", [True, False])
def test_decode_attention_bench_runs_the_large_batch_kernel_in_either_order(longest_first):
    """`bench.decode_attention` times the large-batch kernel through a wrapper-like `run`: its
    page table and order on the device, the same output as the kernel called directly."""
    from pagoda_engine.bench.decode_attention import TritonDecode

    heads, lens = (8, 2, 64), [3, 70, 17, 140]
    q, cache, csr = _inputs(lens, heads, 16, seed=5)
    runner = TritonDecode("triton-large", csr, heads, 16, longest_first=longest_first)
    got = runner.run(q, cache)
    torch.testing.assert_close(got.float(), reference_decode(q, cache, *csr, 16), atol=2e-2, rtol=2e-2)
    order = runner.csr[3].tolist()
    assert order == (kernels.longest_first(lens).tolist() if longest_first else [0, 1, 2, 3])


@pytest.mark.parametrize("kernel", ["small", "large"])
def test_kernels_read_fp8_pages_widened_to_the_queries_dtype(kernel):
    """FP8 pages (`--kv-cache-dtype fp8`): the stored e4m3 values, widened exactly, against float32
    attention over the same values (the layer's scales are applied outside the kernels)."""
    heads, lens = (8, 2, 64), [40, 17, 3]
    q, cache, csr = _inputs(lens, heads, 16, seed=9)
    cache = cache.to(torch.float8_e4m3fn)
    if kernel == "small":
        decode = kernels.SmallBatchDecode(3, *heads, 16, DEVICE)
        got = _run(decode, q, cache, csr)
    else:
        decode = kernels.LargeBatchDecode(*heads, 16)
        got = _run(decode, q, cache, csr, order=kernels.longest_first(lens))
    torch.testing.assert_close(got.float(), reference_decode(q, cache, *csr, 16), atol=2e-2, rtol=2e-2)

"""Float32 decode attention over paged K/V, and random page tables, for the tests of the paged
decode kernels (`worker/attention/decode_triton.py`) on the CPU interpreter and on a GPU."""

from __future__ import annotations

import random

import torch


def random_csr(lens: list[int], page_size: int, num_pages: int, rng: random.Random):
    """FlashInfer's CSR page table (int32 `indptr`, `indices`, `last_page_len`, on the CPU) of
    requests of these lengths, over distinct pages drawn at random from 1 .. num_pages - 1."""
    free = list(range(1, num_pages))
    rng.shuffle(free)
    counts = [-(-n // page_size) for n in lens]
    indptr = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))], dtype=torch.int32)
    indices = torch.tensor([free.pop() for _ in range(sum(counts))], dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * page_size for n, c in zip(lens, counts)], dtype=torch.int32)
    return indptr, indices, last


def reference_decode(q, cache, indptr, indices, last, page_size):
    """Float32 softmax attention of each request's one query over its pages of
    `cache` [num_pages, 2, page_size, num_kv_heads, head_dim]."""
    outs = []
    for b in range(q.shape[0]):
        pages = indices[indptr[b]:indptr[b + 1]].long().to(cache.device)
        n = (len(pages) - 1) * page_size + int(last[b])
        k, v = (cache[pages, i].reshape(-1, *cache.shape[3:])[:n].float() for i in (0, 1))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        p = (torch.einsum("hd,nhd->hn", q[b].float(), k) * q.shape[-1] ** -0.5).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)

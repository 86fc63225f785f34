"""Disaggregated prefill/decode's data plane on one rank: a request's KV pages gathered from this
rank's pool and sent to another engine, or received and written into pages of this pool.

The transport is torch.distributed point-to-point over a pairwise gloo group made for one pull:
the producer hosts a TCPStore on a free port (it tells the consumer the port over the control
channel, `core/kv_transfer.py`), both sides build `ProcessGroupGloo(store, rank, 2)` (no default
group needed) and the pages go as one byte tensor, every layer's K and V of every page. Gloo
moves host memory: on a GPU the pages are copied to the host and back. The group's timeout bounds
every wait, so a producer or consumer that dies fails the pull instead of hanging it.

The control plane (which pages, holds, timeouts, fallbacks) is the engine core's; these functions
run in its transfer threads, on the rank inside the core process.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

_PRODUCER, _CONSUMER = 0, 1


def gather_pages(kv_caches: list[torch.Tensor], page_ids: list[int]) -> torch.Tensor:
    """The pages' bytes, every layer's, as one host tensor [layers, pages, page bytes]."""
    idx = torch.tensor(page_ids, dtype=torch.long, device=kv_caches[0].device)
    pages = torch.stack([cache.index_select(0, idx) for cache in kv_caches])  # [L, n, 2, P, H, D]
    return pages.reshape(len(kv_caches), len(page_ids), -1).view(torch.uint8).cpu()


def scatter_pages(kv_caches: list[torch.Tensor], page_ids: list[int], data: torch.Tensor) -> None:
    """Write `gather_pages`' bytes into these pages of this pool."""
    cache = kv_caches[0]
    idx = torch.tensor(page_ids, dtype=torch.long, device=cache.device)
    pages = data.to(cache.device).view(cache.dtype).reshape(len(kv_caches), len(page_ids), *cache.shape[1:])
    for layer, layer_cache in enumerate(kv_caches):
        layer_cache.index_copy_(0, idx, pages[layer])
    if cache.device.type == "cuda":
        # This runs in a transfer thread: the pages must be written before the engine thread
        # admits the request, whatever stream its next step runs on.
        torch.cuda.current_stream(cache.device).synchronize()


def page_bytes(kv_caches: list[torch.Tensor]) -> int:
    """Bytes one page takes over the wire (every layer's K and V)."""
    cache = kv_caches[0]
    return len(kv_caches) * cache[0].numel() * cache.element_size()


def send_pages(kv_caches: list[torch.Tensor], host: str, page_ids: list[int], timeout_s: float,
               listening: Callable[[int], None]) -> int:
    """Producer: host a store on a free port of `host`, tell `listening` its port (the consumer
    joins there), then send the pages. Returns the bytes sent."""
    timeout = datetime.timedelta(seconds=timeout_s)
    data = gather_pages(kv_caches, page_ids)
    store = dist.TCPStore(host, 0, 2, True, timeout=timeout, wait_for_workers=False)
    listening(store.port)
    group = dist.ProcessGroupGloo(store, _PRODUCER, 2, timeout)
    group.send([data.reshape(-1)], _CONSUMER, 0).wait()
    # The consumer's reply says the bytes arrived; the store must outlive the group's last use.
    flag = torch.zeros(1, dtype=torch.uint8)
    group.recv([flag], _CONSUMER, 1).wait()
    return data.numel()


def recv_pages(kv_caches: list[torch.Tensor], host: str, port: int, page_ids: list[int], timeout_s: float) -> int:
    """Consumer: join the producer's store, receive the pages and write them into `page_ids` of
    this pool. Returns the bytes received."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, 2, False, timeout=timeout)
    group = dist.ProcessGroupGloo(store, _CONSUMER, 2, timeout)
    data = torch.empty(len(page_ids) * page_bytes(kv_caches), dtype=torch.uint8)
    group.recv([data], _PRODUCER, 0).wait()
    group.send([torch.ones(1, dtype=torch.uint8)], _PRODUCER, 1).wait()
    scatter_pages(kv_caches, page_ids, data.reshape(len(kv_caches), len(page_ids), -1))
    return data.numel()

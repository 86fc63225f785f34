"""Disaggregated prefill/decode's data plane on one rank: a request's KV pages gathered from this
rank's pool and sent to another engine, or received and written into pages of this pool.

Two transports. NIXL (`NixlPages`, when the `nixl` or `nixl-cu13` wheel is installed; vLLM's,
Dynamo's and llm-d's library): this rank's whole pool is registered with a NIXL agent (UCX) once;
a producer tells a consumer its agent's metadata and the (address, bytes, device) of each held
page's every layer, and the consumer READs them straight into its own pages (device to device
where UCX can: NVLink, RDMA, CUDA IPC; host memory over TCP or shared memory on a CPU).

The torch transport is torch.distributed point-to-point over a pairwise gloo group made for one pull:
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
import threading
import time
from collections.abc import Callable

import numpy as np
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


def nixl_api():
    """NIXL's Python API (`nixl` as vLLM imports it, else the `nixl-cu13` wheel's), or None."""
    for name in ("nixl._api", "nixl_cu13._api"):
        try:
            return __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
    return None


class NixlPages:
    """This rank's KV pool registered with a NIXL agent. The agent's calls are serialised (the
    engine core's transfer threads share it); a transfer itself runs in NIXL's progress thread."""

    def __init__(self, kv_caches: list[torch.Tensor], name: str):
        api = nixl_api()
        if api is None:
            raise RuntimeError("NIXL is not installed (pip install nixl-cu13, or nixl)")
        self.caches = kv_caches
        self.agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory(self.agent.get_reg_descs(kv_caches))
        device = kv_caches[0].device
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        self.device_id = device.index or 0 if device.type == "cuda" else 0
        self.page_stride = kv_caches[0][0].numel() * kv_caches[0].element_size()
        self._lock = threading.Lock()
        self._remotes: dict[bytes, str] = {}  # a peer's metadata -> its agent's name here

    def metadata(self) -> bytes:
        with self._lock:
            return self.agent.get_agent_metadata()

    def descs(self, page_ids: list[int]) -> list[list[int]]:
        """(address, bytes, device) of every layer of each page, page by page."""
        return [[cache.data_ptr() + page * self.page_stride, self.page_stride, self.device_id]
                for page in page_ids for cache in self.caches]

    def read(self, remote_metadata: bytes, remote_descs: list[list[int]], remote_mem_type: str,
             page_ids: list[int], timeout_s: float) -> int:
        """READ a peer's pages (its `descs`) into these pages of this pool. Returns the bytes read."""
        local = self.descs(page_ids)
        if len(local) != len(remote_descs) or any(r[1] != self.page_stride for r in remote_descs):
            raise ValueError("the producer's pages are not laid out as this engine's")
        with self._lock:
            name = self._remotes.get(remote_metadata)
            if name is None:
                name = self._remotes[remote_metadata] = self.agent.add_remote_agent(remote_metadata)
            handle = self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(np.array(local, dtype=np.uint64), self.mem_type),
                self.agent.get_xfer_descs(np.array(remote_descs, dtype=np.uint64), remote_mem_type), name)
            state = self.agent.transfer(handle)
        # Waits for the read to end however long it takes, so that the pages it writes are never
        # handed to anyone else meanwhile (the engine core stops waiting for it at its own bound
        # and lets the request compute its prompt; the pages go back when this returns).
        started = time.monotonic()
        try:
            while state not in ("DONE", "ERR"):
                time.sleep(0.0002)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
        finally:
            with self._lock:
                self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError("the NIXL read failed")
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"the NIXL read took longer than {timeout_s:g}s")
        if self.caches[0].device.type == "cuda":
            torch.cuda.synchronize(self.caches[0].device)
        return len(local) * self.page_stride

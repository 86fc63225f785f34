"""The data plane of the KV tiers on one rank: copies between this rank's device pages and its
host slots, files and Redis entries. The engine core decides (`core/kv/offload/manager.py`);
every rank does the same with its own shard of each page, under its own fingerprint.

A page's bytes on a rank are one contiguous block `[num_layers, 2, page_size, num_kv_heads,
head_dim]` (all its layers), so moving n pages costs one gather (or scatter) kernel per layer
into a device staging buffer `[n, ...]` and one host↔device copy per run of consecutive slots,
never one copy per page per layer. On CUDA the copies run on a stream of their own, behind
the step that wrote the pages (stores) and ahead of the step that reads them (the core admits a
loading request only once its load is done), and completion is read from CUDA events without
waiting. Device staging is allocated on that stream and dropped as soon as its copies are
queued: the caching allocator hands its memory only to later work of the same stream, so at
most one chunk of staging (`_CHUNK_PAGES`) is live per copy. Files and Redis are written and read by a small thread pool, from host memory.

`poll` reports what finished since the last call (store copies, lower-tier writes, loads) and
the tiers' cumulative error counts.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from pagoda_engine.worker.kv_stores import CorruptEntry, DiskStore, RateLimitedLog, RedisStore, decode_entry

logger = logging.getLogger(__name__)

CPU, DISK, REMOTE = "cpu", "disk", "remote"
# Pages per gather/scatter: bounds the device staging buffer (a Llama-8B page is 2 MiB per rank: 64 MiB).
_CHUNK_PAGES = 32


@dataclass
class OffloadSetup:
    """What the core tells every rank at start-up; each rank derives its own fingerprint."""

    fingerprint: bytes  # what makes KV bytes compatible, before the rank's own coordinates
    num_cpu_slots: int = 0
    disk_path: str | None = None
    remote_url: str | None = None


@dataclass
class OffloadStarted:
    """A rank's answer to `init_kv_offload`."""

    fingerprint: bytes  # this rank's
    payload_bytes: int  # one page's bytes on this rank
    disk_entries: list[tuple[bytes, float]] = field(default_factory=list)  # (key, mtime) found on disk, oldest first


@dataclass
class OffloadEvents:
    """What finished on a rank since its last poll."""

    copied: list[int] = field(default_factory=list)  # store ids whose pages are off the device
    written: list[tuple[int, list[bytes], bool]] = field(default_factory=list)  # (store id, failed disk keys, remote ok)
    loaded: list[tuple[int, int]] = field(default_factory=list)  # (load id, leading pages that arrived intact)
    bad: list[tuple[str, bytes]] = field(default_factory=list)  # (tier, key) entries found corrupt or unreadable
    errors: dict[str, int] = field(default_factory=dict)  # cumulative, per tier


@dataclass(eq=False)
class _Store:
    store_id: int
    rows: list[torch.Tensor]  # each page's bytes in host memory (a slot or a temporary)
    disk_keys: list[bytes | None]
    remote_keys: list[bytes | None]
    event: torch.cuda.Event | None


@dataclass(eq=False)
class _Load:
    load_id: int
    page_ids: list[int]
    reading: Future | None  # host rows from files / Redis, read by the pool
    rows: list[torch.Tensor] | None = None
    ok: int = 0
    event: torch.cuda.Event | None = None
    copied: bool = False


class KVOffloader:
    """One rank's tiers: `kv_caches` are its attention backend's per-layer page tensors."""

    def __init__(self, kv_caches: list[torch.Tensor], setup: OffloadSetup, fingerprint: bytes):
        self.kv_caches = kv_caches
        first = kv_caches[0]
        self.device = first.device
        self.dtype = first.dtype
        self.page_shape = (len(kv_caches), *first.shape[1:])
        self.payload_bytes = first[0].numel() * first.element_size() * len(kv_caches)
        self.fingerprint = fingerprint
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.cpu_slots = (_host_buffer((setup.num_cpu_slots, *self.page_shape), self.dtype, pinned=cuda)
                          if setup.num_cpu_slots else None)
        self.disk = DiskStore(setup.disk_path, fingerprint) if setup.disk_path else None
        self.remote = RedisStore(setup.remote_url, fingerprint) if setup.remote_url else None
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-offload")
        self.stores: deque[_Store] = deque()
        self.writes: list[tuple[int, Future]] = []
        self.loads: list[_Load] = []
        self.errors = {CPU: 0, DISK: 0, REMOTE: 0}
        self.bad: list[tuple[str, bytes]] = []
        self._log = RateLimitedLog()

    # --- device <-> host --------------------------------------------------------------------------

    def _on_stream(self):
        if self.stream is None:
            return _NoStream()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _event(self) -> torch.cuda.Event | None:
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _gather(self, page_ids: list[int]) -> torch.Tensor:
        """[n, *page_shape] on the device: the pages' bytes, one index_select per layer."""
        idx = torch.tensor(page_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        out = torch.empty((len(page_ids), *self.page_shape), dtype=self.dtype, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            out[:, layer] = cache.index_select(0, idx)
        return out

    def _scatter(self, page_ids: list[int], staging: torch.Tensor) -> None:
        idx = torch.tensor(page_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(0, idx, staging[:, layer])

    @torch.inference_mode()
    def store(self, store_id: int, page_ids: list[int], slots: list[int], disk_keys: list[bytes | None],
              remote_keys: list[bytes | None], disk_deletes: list[bytes]) -> None:
        """Copy these device pages down: page i into CPU slot `slots[i]` (-1: none), then, from
        host memory, to disk under `disk_keys[i]` and to Redis under `remote_keys[i]` (None: not
        that tier). `disk_deletes`: files of entries the disk tier evicted."""
        for key in disk_deletes:
            self.disk.delete(key)
        with self._on_stream():
            rows: list[torch.Tensor | None] = [None] * len(page_ids)
            for start in range(0, len(page_ids), _CHUNK_PAGES):
                chunk = range(start, min(start + _CHUNK_PAGES, len(page_ids)))
                staging = self._gather([page_ids[i] for i in chunk])
                slotted = [i for i in chunk if slots[i] >= 0]
                for i, j, n in _runs([i - start for i in slotted], [slots[i] for i in slotted]):
                    self.cpu_slots[j:j + n].copy_(staging[i:i + n], non_blocking=True)
                    for k in range(n):
                        rows[start + i + k] = self.cpu_slots[j + k]
                unslotted = [i for i in chunk if slots[i] < 0]
                if unslotted:
                    host = staging[[i - start for i in unslotted]]
                    if self.stream is not None:
                        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
                        pinned.copy_(host, non_blocking=True)
                        host = pinned
                    for k, i in enumerate(unslotted):
                        rows[i] = host[k]
        self.stores.append(_Store(store_id, rows, disk_keys, remote_keys, self._event()))

    @torch.inference_mode()
    def load(self, load_id: int, page_ids: list[int], sources: list[tuple[str, int | bytes]]) -> None:
        """Fill these device pages from the tiers: page i from `sources[i]`, (cpu, slot),
        (disk, key) or (remote, key). Only the leading pages that arrive intact are written."""
        if all(tier == CPU for tier, _ in sources):
            load = _Load(load_id, page_ids, None, rows=[self.cpu_slots[slot] for _, slot in sources])
            load.ok = len(sources)
            self._copy_up(load)
        else:
            load = _Load(load_id, page_ids, self.pool.submit(self._read, sources))
        self.loads.append(load)

    def _copy_up(self, load: _Load) -> None:
        with self._on_stream():
            for start in range(0, load.ok, _CHUNK_PAGES):
                end = min(start + _CHUNK_PAGES, load.ok)
                staging = torch.empty((end - start, *self.page_shape), dtype=self.dtype, device=self.device)
                for k in range(start, end):
                    staging[k - start].copy_(load.rows[k], non_blocking=True)
                self._scatter(load.page_ids[start:end], staging)
        load.event = self._event()
        load.copied = True

    # --- lower tiers (the thread pool) ------------------------------------------------------------

    def _read(self, sources: list[tuple[str, int | bytes]]) -> list[torch.Tensor]:
        """Host rows for the leading sources that read intact (stops at the first that does not)."""
        rows = []
        remote_keys = [key for tier, key in sources if tier == REMOTE]
        blobs = dict(zip(remote_keys, self.remote.read(remote_keys))) if remote_keys else {}
        for tier, where in sources:
            try:
                if tier == CPU:
                    rows.append(self.cpu_slots[where])
                    continue
                if tier == DISK:
                    payload = self.disk.read(where, self.payload_bytes)
                else:
                    blob = blobs.get(where)
                    if blob is None:
                        break  # evicted from Redis since the lookup, or Redis failed (counted there)
                    payload = decode_entry(blob, self.fingerprint, where, self.payload_bytes)
            except (CorruptEntry, OSError) as e:
                self.errors[tier] += 1
                self.bad.append((tier, where))
                self._log.warning(f"bad-{tier}", "kv offload: %s entry %s unusable (%s): a miss, recomputed",
                                  tier, where.hex(), e)
                break
            rows.append(torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).view(self.page_shape))
        return rows

    def _write(self, store: _Store) -> tuple[list[bytes], bool]:
        failed = []
        for row, key in zip(store.rows, store.disk_keys):
            if key is None:
                continue
            try:
                self.disk.write(key, _payload(row))
            except OSError as e:
                self.errors[DISK] += 1
                failed.append(key)
                self._log.warning("disk-write", "kv offload: disk write failed (%s); the page stays off disk", e)
        entries = [(key, _payload(row)) for row, key in zip(store.rows, store.remote_keys) if key is not None]
        return failed, self.remote.write(entries) if entries else True

    # --- completion -------------------------------------------------------------------------------

    @torch.inference_mode()
    def poll(self) -> OffloadEvents:
        events = OffloadEvents()
        while self.stores and _done(self.stores[0].event):
            store = self.stores.popleft()
            events.copied.append(store.store_id)
            if any(k is not None for k in store.disk_keys) or any(k is not None for k in store.remote_keys):
                self.writes.append((store.store_id, self.pool.submit(self._write, store)))
            else:
                events.written.append((store.store_id, [], True))
        still = []
        for store_id, future in self.writes:
            if future.done():
                events.written.append((store_id, *future.result()))
            else:
                still.append((store_id, future))
        self.writes = still
        for load in list(self.loads):
            if not load.copied and load.reading is not None and load.reading.done():
                load.rows = load.reading.result()
                load.ok = len(load.rows)
                self._copy_up(load)
            if load.copied and _done(load.event):
                self.loads.remove(load)
                events.loaded.append((load.load_id, load.ok))
        events.bad, self.bad = self.bad, []
        events.errors = dict(self.errors)
        if self.remote is not None:
            events.errors[REMOTE] += self.remote.errors
        return events

    def busy(self) -> bool:
        return bool(self.stores or self.writes or self.loads)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """The CPU tier's slots, page-locked when `pinned` so copies to and from the device are DMA.
    Registered in place (cudaHostRegister) rather than taken from torch's pinned allocator, which
    may round a size up to the next power of two (a 40 GiB tier would lock 64 GiB)."""
    buffer = torch.empty(shape, dtype=dtype)
    if not pinned:
        return buffer
    try:
        error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0))
    except (AttributeError, RuntimeError, TypeError) as e:
        error = repr(e)
    if error == 0:
        return buffer
    logger.warning("kv offload: registering the CPU tier as pinned memory failed (%s); using torch's pinned "
                   "allocator", error)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _done(event: torch.cuda.Event | None) -> bool:
    return event is None or event.query()


def _payload(row: torch.Tensor) -> memoryview:
    return memoryview(row.reshape(-1).view(torch.uint8).numpy())


def _runs(rows: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first row, first slot, length) of each run where both rows and slots go up by one."""
    runs: list[tuple[int, int, int]] = []
    for r, s in zip(rows, slots):
        if runs and runs[-1][0] + runs[-1][2] == r and runs[-1][1] + runs[-1][2] == s:
            i, j, n = runs[-1]
            runs[-1] = (i, j, n + 1)
        else:
            runs.append((r, s, 1))
    return runs

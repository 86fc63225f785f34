"""The data plane of the KV tiers on one rank: copies between this rank's device pages and its
host slots, files and Redis entries. The engine core decides (`core/kv/offload/manager.py`);
every rank does the same with its own shard of each page, under its own fingerprint.

A page's bytes on a rank are one contiguous block `[num_layers, 2, page_size, num_kv_heads,
head_dim]` (all its layers: the payload disk and Redis entries hold too), so moving n pages
costs one gather (or scatter) kernel per layer between the per-layer device caches and a device
staging buffer `[n, ...]`, and one host↔device copy per run of consecutive host slots (the
tier index hands one store's pages runs of slots), never one copy per page per layer.

On CUDA, stores and loads each have a stream of their own, and nothing waits on the host:
completion is read from CUDA events when the core polls. A store runs behind the step that
wrote its pages (its stream waits for the compute stream). A load's host→device copy starts at
once, beside the step in flight; only its scatter into the device pages waits for the work
queued on the compute stream when the load started (a page the load fills may have been freed
under a step still in flight). A load from the CPU tier is usually awaited by the next step
(`awaited`): before it runs, the compute stream waits for the load's event (`wait_for_loads`), so
the core admits the request in the step it schedules the load with. A load from disk or Redis is
read by the thread pool; the first `poll` after its read queues its copies and reports it loaded,
and the next step waits for those copies on the device the same way (stores too: a page that
just landed may be copied down at once), so a load never waits for a second poll. A CPU-tier
load the core chose not to await (it would hold up other requests' step) takes that path too:
the first `poll` after it started reports it, its copies already queued.
Device staging is allocated on the copying stream and dropped once its copies are queued (the
caching allocator hands that memory only to later work of the same stream), so at most one
chunk of staging (`_LOAD_STAGING_BYTES`, `_STORE_STAGING_BYTES`) is live per stream: a load up
to that size overlaps the step in flight whole. Files and Redis are written and read by small
thread pools, one for writes and one for reads, from pinned host memory.

`poll` reports what finished since the last call (store copies, lower-tier writes, loads) and
the tiers' cumulative error counts.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from pagoda_engine.kv_tiers import CPU, DISK, REMOTE, OffloadEvents, OffloadSetup
from pagoda_engine.worker.kv_stores import (
    CorruptEntry,
    DiskStore,
    RateLimitedLog,
    remote_store,
)

logger = logging.getLogger(__name__)

LOAD, STORE = 0, 1  # directions of the timed host<->device copies (`OffloadEvents.copy`)
# Device staging per load and per store (beyond the KV budget, like activations). A load up to
# this size overlaps the step in flight whole (512 MiB: 256 Llama-8B pages, a 4,096-token context,
# about 10 ms at 55 GB/s); a store's staging only bounds its memory.
_LOAD_STAGING_BYTES = 512 << 20
_STORE_STAGING_BYTES = 128 << 20


@dataclass(eq=False)
class _Store:
    store_id: int
    slots: list[int]  # each page's CPU slot, -1: none (it goes to disk / Redis from `temps`)
    temps: dict[int, torch.Tensor]  # page index -> its bytes in host memory, for pages without a slot
    disk_keys: list[bytes | None]
    remote_keys: list[bytes | None]
    event: torch.cuda.Event | None


@dataclass(eq=False)
class _Load:
    load_id: int
    page_ids: list[int]
    slots: list[int]  # each page's CPU slot, -1: its bytes are in `host` (read from disk or Redis)
    host: torch.Tensor | None = None  # [n, *page_shape] host rows for the pages without a slot
    reading: Future | None = None  # the pool reading `host`; its result: (host, leading pages that read intact)
    started: float = 0.0  # time.monotonic() when it was asked for
    read_s: float = 0.0  # from `started` to its reads done (disk and Redis)
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
        self.cuda = self.device.type == "cuda"
        self.store_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.load_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.load_chunk = max(1, _LOAD_STAGING_BYTES // self.payload_bytes)
        self.store_chunk = max(1, _STORE_STAGING_BYTES // self.payload_bytes)
        self.cpu_slots = (_host_buffer((setup.num_cpu_slots, *self.page_shape), self.dtype, pinned=self.cuda)
                          if setup.num_cpu_slots else None)
        self.disk = DiskStore(setup.disk_path, fingerprint) if setup.disk_path else None
        self.remote = remote_store(setup.remote_url, fingerprint) if setup.remote_url else None
        # Writes to disk and Redis, and reads from them, in pools of their own: a load (a request
        # waits for it) never queues behind the stores of pages that just filled.
        self.write_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-offload-write")
        self.read_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-offload-read")
        self.stores: deque[_Store] = deque()
        self.writes: list[tuple[int, Future]] = []
        self.loads: list[_Load] = []
        self.awaited: list[torch.cuda.Event] = []  # loads the next step waits for
        # Host<->device copies timed by CUDA events: (LOAD or STORE, bytes, start, end), until done.
        self._timed: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] = []
        self.copy_totals = [0.0, 0.0, 0.0, 0.0]  # load bytes, load s, store bytes, store s
        self.errors = {CPU: 0, DISK: 0, REMOTE: 0}
        self.bad: list[tuple[str, bytes]] = []
        self._log = RateLimitedLog()

    # --- device <-> host --------------------------------------------------------------------------

    def _on(self, stream: torch.cuda.Stream | None, after_compute: bool = False):
        """Work queued inside runs on `stream` (CUDA); `after_compute`: behind what the compute
        stream has queued so far."""
        if stream is None:
            return contextlib.nullcontext()
        if after_compute:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def _record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def _mark(self) -> torch.cuda.Event | None:
        """A timing event on the current stream (CUDA), where copies are about to be queued."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _time_since(self, started: torch.cuda.Event | None, direction: int, nbytes: int) -> None:
        """The copies queued since `started` move `nbytes`: counted once they have run (`poll`)."""
        if started is not None:
            self._timed.append((direction, nbytes, started, self._mark()))

    def _device_index(self, page_ids: list[int]) -> torch.Tensor:
        return torch.tensor(page_ids, dtype=torch.int64).to(self.device, non_blocking=True)

    def _gather(self, idx: torch.Tensor) -> torch.Tensor:
        """[n, *page_shape] on the device: the pages' bytes, one index_select per layer."""
        out = torch.empty((len(idx), *self.page_shape), dtype=self.dtype, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            torch.index_select(_as_bytes(cache), 0, idx, out=_as_bytes(out[:, layer]))
        return out

    def _scatter(self, idx: torch.Tensor, staging: torch.Tensor) -> None:
        for layer, cache in enumerate(self.kv_caches):
            _as_bytes(cache).index_copy_(0, idx, _as_bytes(staging[:, layer]))

    @torch.inference_mode()
    def store(self, store_id: int, page_ids: list[int], slots: list[int], disk_keys: list[bytes | None],
              remote_keys: list[bytes | None], disk_deletes: list[bytes]) -> None:
        """Copy these device pages down: page i into CPU slot `slots[i]` (-1: none), then, from
        host memory, to disk under `disk_keys[i]` and to Redis under `remote_keys[i]` (None: not
        that tier). `disk_deletes`: files of entries the disk tier evicted."""
        for key in disk_deletes:
            self.disk.delete(key)
        temps: dict[int, torch.Tensor] = {}
        if page_ids:
            for event in self.awaited:  # a page that landed since the last step, or a CPU slot a load reads
                self.store_stream.wait_event(event)
            with self._on(self.store_stream, after_compute=True):
                idx = self._device_index(page_ids)
                for start in range(0, len(page_ids), self.store_chunk):
                    end = min(start + self.store_chunk, len(page_ids))
                    staging = self._gather(idx[start:end])
                    started = self._mark()
                    chunk = range(start, end)
                    slotted = [i for i in chunk if slots[i] >= 0]
                    for i, j, n in _runs([i - start for i in slotted], [slots[i] for i in slotted]):
                        self.cpu_slots[j:j + n].copy_(staging[i:i + n], non_blocking=True)
                    unslotted = [i for i in chunk if slots[i] < 0]
                    if unslotted:  # to disk or Redis only: through host memory of its own
                        host = torch.empty((len(unslotted), *self.page_shape), dtype=self.dtype, pin_memory=self.cuda)
                        for i, j, n in _runs([i - start for i in unslotted], list(range(len(unslotted)))):
                            host[j:j + n].copy_(staging[i:i + n], non_blocking=True)
                        temps.update((i, host[k]) for k, i in enumerate(unslotted))
                    self._time_since(started, STORE, (end - start) * self.payload_bytes)
        self.stores.append(_Store(store_id, slots, temps, disk_keys, remote_keys, self._record(self.store_stream)))

    @torch.inference_mode()
    def load(self, load_id: int, page_ids: list[int], sources: list[tuple[str, int | bytes]],
             awaited: bool = False) -> None:
        """Fill these device pages from the tiers: page i from `sources[i]`, (cpu, slot),
        (disk, key) or (remote, key). Only the leading pages that arrive intact are written.
        `awaited` (CPU-tier sources only): the next step waits for the copies on the device
        (`wait_for_loads`), because the core counts the pages as landed already."""
        slots = [where if tier == CPU else -1 for tier, where in sources]
        load = _Load(load_id, page_ids, slots, started=time.monotonic())
        if all(s >= 0 for s in slots):
            load.ok = len(sources)
            self._copy_up(load)
            if awaited and load.event is not None:
                self.awaited.append(load.event)
        else:
            assert not awaited, "only host-memory loads can be awaited by the next step"
            load.reading = self.read_pool.submit(self._read, sources, load)
        self.loads.append(load)

    def _copy_up(self, load: _Load) -> None:
        """Queue the copies of the load's first `ok` pages: runs of host rows into device staging
        at once, then, behind what the compute stream holds now, one scatter per layer."""
        compute = self._record(torch.cuda.current_stream(self.device) if self.cuda else None)
        with self._on(self.load_stream):
            idx = self._device_index(load.page_ids[:load.ok])
            for start in range(0, load.ok, self.load_chunk):
                end = min(start + self.load_chunk, load.ok)
                staging = torch.empty((end - start, *self.page_shape), dtype=self.dtype, device=self.device)
                started = self._mark()
                chunk = range(start, end)
                slotted = [i for i in chunk if load.slots[i] >= 0]
                for i, j, n in _runs([i - start for i in slotted], [load.slots[i] for i in slotted]):
                    staging[i:i + n].copy_(self.cpu_slots[j:j + n], non_blocking=True)
                hosted = [i for i in chunk if load.slots[i] < 0]
                for i, j, n in _runs([i - start for i in hosted], hosted):
                    staging[i:i + n].copy_(load.host[j:j + n], non_blocking=True)
                self._time_since(started, LOAD, (end - start) * self.payload_bytes)
                if compute is not None and start == 0:
                    self.load_stream.wait_event(compute)
                self._scatter(idx[start:end], staging)
        load.event = self._record(self.load_stream)
        load.copied = True

    def wait_for_loads(self) -> None:
        """Before a step: the compute stream waits for the copies of the loads the core counts as
        landed (CPU-tier loads from their start, the others from the poll that reported them), on
        the device, without blocking the host."""
        if self.awaited:
            stream = torch.cuda.current_stream(self.device)
            for event in self.awaited:
                stream.wait_event(event)
            self.awaited.clear()

    # --- lower tiers (the thread pools) ------------------------------------------------------------

    def _read(self, sources: list[tuple[str, int | bytes]], load: _Load) -> tuple[torch.Tensor, int]:
        """Host rows (pinned on CUDA) holding the disk and Redis sources, and how many leading
        sources read intact (it stops at the first that does not). CPU sources are left out:
        they are copied up from their slots. Sets `load.read_s`."""
        try:
            return self._read_rows(sources)
        finally:
            load.read_s = time.monotonic() - load.started

    def _read_rows(self, sources: list[tuple[str, int | bytes]]) -> tuple[torch.Tensor, int]:
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():  # this thread's device
            host = torch.empty((len(sources), *self.page_shape), dtype=self.dtype, pin_memory=self.cuda)
        rows = host.view(len(sources), -1).view(torch.uint8).numpy()
        remote = [i for i, (tier, _) in enumerate(sources) if tier == REMOTE]
        # Redis entries land in their rows and are checked there; `intact` of them in a row are good.
        intact, corrupt = (self.remote.read_into([sources[i][1] for i in remote], [rows[i] for i in remote])
                           if remote else (0, None))
        remote_seen = 0
        for i, (tier, where) in enumerate(sources):
            if tier == CPU:
                continue
            try:
                if tier == DISK:
                    rows[i] = np.frombuffer(self.disk.read(where, self.payload_bytes), dtype=np.uint8)
                elif remote_seen == intact:
                    if corrupt is None:
                        return host, i  # evicted from Redis since the lookup, or Redis failed (counted there)
                    raise corrupt
                else:
                    remote_seen += 1
            except (CorruptEntry, OSError) as e:
                self.errors[tier] += 1
                self.bad.append((tier, where))
                self._log.warning(f"bad-{tier}", "kv offload: %s entry %s unusable (%s): a miss, recomputed",
                                  tier, where.hex(), e)
                return host, i
        return host, len(sources)

    def _write(self, store: _Store) -> tuple[list[bytes], bool]:
        def row(i: int) -> torch.Tensor:
            return self.cpu_slots[store.slots[i]] if store.slots[i] >= 0 else store.temps[i]

        failed = []
        for i, key in enumerate(store.disk_keys):
            if key is None:
                continue
            try:
                self.disk.write(key, _payload(row(i)))
            except OSError as e:
                self.errors[DISK] += 1
                failed.append(key)
                self._log.warning("disk-write", "kv offload: disk write failed (%s); the page stays off disk", e)
        entries = [(key, _payload(row(i))) for i, key in enumerate(store.remote_keys) if key is not None]
        return failed, self.remote.write(entries) if entries else True

    # --- completion -------------------------------------------------------------------------------

    @torch.inference_mode()
    def poll(self) -> OffloadEvents:
        events = OffloadEvents()
        while self.stores and _done(self.stores[0].event):
            store = self.stores.popleft()
            events.copied.append(store.store_id)
            if any(k is not None for k in store.disk_keys) or any(k is not None for k in store.remote_keys):
                self.writes.append((store.store_id, self.write_pool.submit(self._write, store)))
            else:
                events.written.append((store.store_id, [], True))
        still = []
        for store_id, future in self.writes:
            if future.done():
                events.written.append((store_id, *future.result()))
            else:
                still.append((store_id, future))
        self.writes = still
        still_loading = []
        for load in self.loads:
            if not load.copied and load.reading is not None and load.reading.done():
                load.host, load.ok = load.reading.result()
                self._copy_up(load)
            if not load.copied:
                still_loading.append(load)
                continue
            if load.event is not None:
                self.awaited.append(load.event)  # the next step (and store) waits for its copies
            events.loaded.append((load.load_id, load.ok, load.read_s + self._copy_s(load.ok * self.payload_bytes)))
        self.loads = still_loading
        timed = []
        for direction, nbytes, started, ended in self._timed:
            if ended.query():
                self.copy_totals[2 * direction] += nbytes
                self.copy_totals[2 * direction + 1] += started.elapsed_time(ended) / 1e3
            else:
                timed.append((direction, nbytes, started, ended))
        self._timed = timed
        events.copy = list(self.copy_totals) if self.cuda else []
        events.bad, self.bad = self.bad, []
        events.errors = dict(self.errors)
        if self.remote is not None:
            events.errors[REMOTE] += self.remote.errors
        return events

    def _copy_s(self, nbytes: int) -> float:
        """How long copying `nbytes` up takes at the speed measured so far (0 before any)."""
        load_bytes, load_s = self.copy_totals[0], self.copy_totals[1]
        return nbytes * load_s / load_bytes if load_bytes else 0.0

    def busy(self) -> bool:
        return bool(self.stores or self.writes or self.loads)

    def close(self) -> None:
        self.read_pool.shutdown(wait=True)
        self.write_pool.shutdown(wait=True)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """FP8 pages as their bytes: torch's index kernels take no float8 dtype, and the tiers move
    bytes anyway."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """The CPU tier's slots, page-locked when `pinned` so copies to and from the device are DMA.
    Registered in place (cudaHostRegister) rather than taken from torch's pinned allocator, which
    may round a size up to the next power of two (a 40 GiB tier would lock 64 GiB); unregistered
    when the buffer goes, before its memory is freed (an engine made again in the same process
    would otherwise find its new buffer "already mapped")."""
    buffer = torch.empty(shape, dtype=dtype)
    if not pinned:
        return buffer
    cudart = torch.cuda.cudart()
    try:
        error = int(cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0))
    except (AttributeError, RuntimeError, TypeError) as e:
        error = repr(e)
    if error == 0:
        weakref.finalize(buffer, cudart.cudaHostUnregister, buffer.data_ptr())
        return buffer
    try:  # the failed call left its error as CUDA's last error; a launch check reads it and clears it
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass
    logger.warning("kv offload: registering the CPU tier as pinned memory failed (%s); using torch's pinned "
                   "allocator", error)
    return torch.empty(shape, dtype=dtype, pin_memory=True)


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

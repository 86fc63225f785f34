"""KV offload tiers: the tier index (LRU order, capacity, pins, slot runs), one rank's data plane
(pages stored and loaded back bit for bit, across staging chunks and slot runs), and the
engine's CPU and disk tiers end to end in-process on the tiny model: greedy tokens identical
with the tiers off and on, prefixes coming back from host memory, after preemption, and from
disk after a restart, and disk hits promoted to host memory; a truncated file is a miss, never
a wrong token; no page is left held after any run."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.core.kv.offload.index import TierIndex
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.kv_tiers import CPU, DISK, OffloadSetup
from pagoda_engine.tiny import default_model_dir
from pagoda_engine.worker.kv_offload import KVOffloader

# The built-in tiny Llama (4 query heads over 2 KV heads: tensor parallelism of 2 splits it).
MODEL = str(default_model_dir())
GREEDY = SamplingParams(temperature=0, max_tokens=8)
# 0.1 GiB of host memory holds some 13,000 pages of the tiny model (8 KiB each).
CPU_GB = 0.1
SMALL_POOL = dict(model=MODEL, num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(5, 400, size=length).tolist() for _ in range(n)]


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _tier(llm: LLM, name: str):
    (stats,) = [t for t in llm.core.get_stats().kv_offload if t.tier == name]
    return stats


def assert_no_leaks(llm: LLM) -> None:
    """Every device page is free again, nothing is in flight, no tier entry is pinned or half-written."""
    core = llm.core
    offload = core.kv.offload
    assert not offload.busy
    assert core.kv.pool.num_free_pages == core.num_kv_pages - 1
    for index in (offload.cpu, offload.disk):
        if index is not None:
            assert index.num_pinned == 0
            assert all(e.ready for e in index.entries.values())
            assert len(index) <= index.capacity


@pytest.fixture(scope="module")
def reference():
    """The tiers off, a pool large enough to never evict: the tokens every other run must match."""
    with LLM(MODEL, num_gpu_blocks_override=512, max_model_len=256) as llm:
        yield llm


# --- the tier index -------------------------------------------------------------------------------


def _key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_tier_index_evicts_least_recently_used_first():
    index = TierIndex(3, with_slots=True)
    for i in range(3):
        entry, evicted = index.insert(_key(i), ready=True)
        assert evicted == []
    assert index.get(_key(0)) is not None  # 0 is now the most recently used: 1 goes first
    entry, evicted = index.insert(_key(3), ready=True)
    assert [e.key for e in evicted] == [_key(1)]
    assert entry.slot == evicted[0].slot  # the evicted page's slot is reused
    assert list(index.entries) == [_key(2), _key(0), _key(3)]
    assert len(index) == 3


def test_a_chain_is_evicted_tail_first_so_its_prefix_stays_whole():
    index = TierIndex(6, with_slots=True)
    a = [_key(i) for i in range(4)]
    b = [_key(10 + i) for i in range(4)]
    for chain in (a, b):
        for entry in index.insert_many(chain, ready=True)[0]:
            assert entry is not None
        index.touch_chain(chain)
    # b's store evicted two of a's pages: its last two, so a's first two still form its prefix.
    assert set(index.entries) == set(a[:2] + b)
    # A lookup of a's prefix makes it the most recent, head last; the next eviction takes b's tail.
    assert all(index.get(key) is not None for key in a[:2])
    index.touch_chain(a[:2])
    _, evicted = index.insert(_key(99), ready=True)
    assert [e.key for e in evicted] == [b[3]]


def test_tier_index_never_evicts_pinned_or_arriving_entries():
    index = TierIndex(2, with_slots=True)
    a, _ = index.insert(_key(0), ready=True)
    b, _ = index.insert(_key(1))  # still arriving
    index.pin(a)
    assert index.insert(_key(2)) == (None, [])  # full of pages in use: the tier skips this page
    assert index.get(_key(1)) is None  # not loadable before it has arrived
    index.unpin(a)
    entry, evicted = index.insert(_key(2), ready=True)
    assert [e.key for e in evicted] == [_key(0)] and entry.slot == a.slot
    b.ready = True
    assert index.get(_key(1)) is b


def test_tier_index_slots_stay_distinct_and_capacity_holds():
    index = TierIndex(4, with_slots=True)
    rng = np.random.default_rng(0)
    for i in range(200):
        key = _key(int(rng.integers(0, 12)))
        if key in index:
            index.get(key)
        else:
            index.insert(key, ready=True)
        slots = [e.slot for e in index.entries.values()]
        assert len(index) <= 4 and len(set(slots)) == len(slots) and all(0 <= s < 4 for s in slots)


def test_zero_capacity_tier_holds_nothing():
    assert TierIndex(0).insert(_key(0)) == (None, [])
    assert TierIndex(0, with_slots=True).insert_many([_key(0), _key(1)]) == ([None, None], [])


def _slots(entries) -> list[int]:
    return [e.slot for e in entries]


def test_tier_index_gives_one_store_one_run_of_slots():
    index = TierIndex(10, with_slots=True)
    first, _ = index.insert_many([_key(i) for i in range(4)], ready=True)
    second, _ = index.insert_many([_key(i) for i in range(4, 7)], ready=True)
    assert _slots(first) == [0, 1, 2, 3] and _slots(second) == [4, 5, 6]
    # Pages evicted together free a run again, and the next store takes it whole.
    for i in range(4, 7):
        index.get(_key(i))
    index.insert_many([_key(i) for i in range(7, 10)], ready=True)  # fills slots 7-9
    third, evicted = index.insert_many([_key(i) for i in range(10, 14)], ready=True)
    assert [e.key for e in evicted] == [_key(i) for i in range(4)]  # least recently used first, in order
    assert _slots(third) == [0, 1, 2, 3]
    assert len(index.free_slots) == 0


def test_tier_index_takes_the_longest_free_runs_when_no_run_is_long_enough():
    index = TierIndex(8, with_slots=True)
    entries, _ = index.insert_many([_key(i) for i in range(8)], ready=True)
    for i in (1, 4, 5, 6):  # free runs: [1] and [4, 5, 6]
        index.discard(_key(i))
    got, evicted = index.insert_many([_key(i) for i in range(8, 12)], ready=True)
    assert evicted == [] and _slots(got) == [4, 5, 6, 1]
    # Full of pinned and arriving entries: the keys that find no room get None, in order.
    for e in index.entries.values():
        index.pin(e)
    index.unpin(entries[0])
    got, evicted = index.insert_many([_key(20), _key(21)])
    assert [e.key for e in evicted] == [_key(0)] and got[0].slot == 0 and got[1] is None
    assert _key(21) not in index and len(index) == 8


def test_tier_index_keeps_slots_and_free_runs_consistent_under_churn():
    cap = 32
    index = TierIndex(cap, with_slots=True)
    rng = np.random.default_rng(1)
    pinned = []
    for step in range(400):
        op = rng.integers(0, 10)
        if op < 5:
            keys = [_key(int(k)) for k in rng.choice(200, size=int(rng.integers(1, 12)), replace=False)]
            index.insert_many([k for k in keys if k not in index], ready=bool(rng.integers(0, 2)))
        elif op < 7:
            for e in list(index.entries.values())[:3]:
                e.ready = True
                index.get(e.key)
        elif op < 8 and index.entries:
            e = next(iter(index.entries.values()))
            index.pin(e)
            pinned.append(e)
        elif op < 9 and pinned:
            index.unpin(pinned.pop())
        elif index.entries:
            index.discard(list(index.entries)[int(rng.integers(0, len(index)))])
        pinned = [e for e in pinned if e.key in index]
        used = sorted(e.slot for e in index.entries.values())
        runs = sorted(index.free_slots.by_start.items())
        free = [s + i for s, n in runs for i in range(n)]
        assert len(index) <= cap and len(set(used)) == len(used)
        assert sorted(used + free) == list(range(cap))  # every slot used or free, none both, none lost
        assert len(index.free_slots) == cap - len(index)
        assert all(s + n < s2 for (s, n), (s2, _) in zip(runs, runs[1:]))  # free runs are maximal
    for e in pinned:
        index.unpin(e)
    for key in list(index.entries):
        index.discard(key)
    assert index.free_slots.by_start == {0: cap}  # everything merged back into one run


# --- one rank's data plane ----------------------------------------------------------------------------


def _poll_until(offloader: KVOffloader, done) -> list:
    events, deadline = [], time.monotonic() + 30
    while not done(events):
        assert time.monotonic() < deadline, "offload copies did not finish"
        events.append(offloader.poll())
        time.sleep(0.001)
    return events


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # FP8 pages go down and up as they are
def test_offloader_round_trip_is_bit_identical_across_chunks_and_runs(tmp_path, dtype):
    layers = [torch.randn(40, 2, 4, 2, 8).to(dtype) for _ in range(3)]
    offloader = KVOffloader(layers, OffloadSetup(b"f" * 16, num_cpu_slots=16, disk_path=str(tmp_path)), b"g" * 16)
    offloader.store_chunk = offloader.load_chunk = 3  # runs that cross staging chunks
    pages = [3, 5, 6, 9, 17, 30, 31, 2]
    slots = [4, 5, 6, 7, 0, -1, -1, 1]  # runs of slots, two pages that go to disk only
    keys = [bytes([i]) * 16 for i in range(len(pages))]
    original = [torch.stack([layer[p] for layer in layers]).clone() for p in pages]
    offloader.store(1, pages, slots, keys, [None] * len(pages), [])
    _poll_until(offloader, lambda evs: any(e.written for e in evs))
    for i, slot in enumerate(slots):
        if slot >= 0:
            assert _same_bits(offloader.cpu_slots[slot], original[i])
    for layer in layers:
        layer.zero_()
    targets = list(range(20, 28))
    # From host slots and disk files mixed; the disk pages are read into host rows first.
    sources = [(CPU, s) if s >= 0 else (DISK, keys[i]) for i, s in enumerate(slots)]
    offloader.load(2, targets, sources)
    offloader.load(3, [33, 34, 35, 36], [(CPU, 4), (CPU, 5), (CPU, 6), (CPU, 7)])
    events = _poll_until(offloader, lambda evs: len([x for e in evs for x in e.loaded]) == 2)
    loaded = sorted(x for e in events for x in e.loaded)
    assert [(load_id, ok) for load_id, ok, _ in loaded] == [(2, 8), (3, 4)]
    assert loaded[0][2] > 0 and loaded[1][2] == 0  # the disk reads took time; CPU slots need none (no CUDA copy)
    for i, page in enumerate(targets):
        assert _same_bits(torch.stack([layer[page] for layer in layers]), original[i])
    for k, page in enumerate([33, 34, 35, 36]):
        assert _same_bits(torch.stack([layer[page] for layer in layers]), original[k])
    assert not offloader.busy()
    offloader.close()


def test_a_load_does_not_wait_behind_stores_to_a_slow_tier(tmp_path, monkeypatch):
    """Two stores whose disk writes hang (a slow disk or Redis) hold both writer threads; a load
    from disk still reads at once."""
    from pagoda_engine.worker.kv_stores import DiskStore

    layers = [torch.randn(40, 2, 4, 2, 8) for _ in range(2)]
    offloader = KVOffloader(layers, OffloadSetup(b"f" * 16, disk_path=str(tmp_path)), b"g" * 16)
    keys = [bytes([i]) * 16 for i in range(3)]
    offloader.store(1, [1], [-1], [keys[0]], [None], [])
    _poll_until(offloader, lambda evs: any(e.written for e in evs))  # page 1 is on disk
    original = torch.stack([layer[1] for layer in layers]).clone()
    release = threading.Event()
    write = DiskStore.write
    monkeypatch.setattr(DiskStore, "write", lambda self, key, payload: release.wait(10) and write(self, key, payload))
    offloader.store(2, [2], [-1], [keys[1]], [None], [])
    offloader.store(3, [3], [-1], [keys[2]], [None], [])
    _poll_until(offloader, lambda evs: sum(len(e.copied) for e in evs) == 2)  # both writes now hang
    offloader.load(4, [30], [(DISK, keys[0])])
    t0 = time.monotonic()
    assert [(load_id, ok) for e in _poll_until(offloader, lambda evs: any(e.loaded for e in evs))
            for load_id, ok, _ in e.loaded] == [(4, 1)]
    assert time.monotonic() - t0 < 5 and not release.is_set()
    assert torch.equal(torch.stack([layer[30] for layer in layers]), original)
    release.set()
    _poll_until(offloader, lambda evs: sum(len(e.written) for e in evs) == 2)
    offloader.close()


# --- the engine -------------------------------------------------------------------------------------


def test_prefixes_back_from_cpu_tier_give_same_greedy_tokens(reference):
    # 6 prompts x 6 full pages do not fit 23 device pages: the second round loads most from host memory.
    prompts = _prompts(6, 100, seed=1)
    # A later turn: the first prompt's context plus new tokens.
    follow_up = [prompts[0] + _prompts(1, 40, seed=2)[0]]
    expected = _tokens(reference.generate(prompts + follow_up, GREEDY))
    with LLM(kv_offload_cpu_gb=CPU_GB, **SMALL_POOL) as llm:
        first = _tokens(llm.generate(prompts, GREEDY))
        assert_no_leaks(llm)
        assert _tier(llm, "cpu").stored_bytes > 0
        second = _tokens(llm.generate(prompts + follow_up, GREEDY))
        assert_no_leaks(llm)
        cpu = _tier(llm, "cpu")
        assert cpu.loaded_bytes > 0 and cpu.hit_tokens > 0
        assert cpu.hit_tokens // 16 * llm.core.kv.offload.page_bytes == cpu.loaded_bytes  # each hit was loaded
        assert cpu.load_seconds_buckets[-1] > 0
        # Every tier's hits count as prefix-cache hits.
        assert llm.core.kv.prefix_hits >= cpu.hit_tokens
    assert first == expected[:6]
    assert second == expected


def test_the_cpu_tier_keeps_a_stored_prompt_tail_oldest(reference):
    """Pages stored together take slots in prefix order (a fresh tier: 0, 1, ...); the tier's LRU
    order runs from the tail to the head, so eviction starts at the prompt's last page."""
    with LLM(kv_offload_cpu_gb=CPU_GB, **SMALL_POOL) as llm:
        llm.generate(_prompts(1, 100, seed=11), GREEDY)
        entries = list(llm.core.kv.offload.cpu.entries.values())
        assert len(entries) >= 6
        slots = [e.slot for e in entries]
        assert slots == sorted(slots, reverse=True)
        assert_no_leaks(llm)


@pytest.mark.parametrize("deferred", [False, True], ids=["loads-at-once", "loads-deferred"])
def test_preempted_requests_resume_from_cpu_tier(reference, deferred, monkeypatch):
    # Long generations in a pool too small for all of them: requests are preempted, and their full
    # pages come back from host memory instead of being recomputed; also when every load beside
    # other requests' steps lands a schedule later (`_copy_outlasts_step`, forced).
    from pagoda_engine.core.kv.offload.manager import OffloadManager

    deferrals = []
    if deferred:  # asked only for loads beside other requests' work: each one is deferred
        monkeypatch.setattr(OffloadManager, "_copy_outlasts_step", lambda self, num_pages: not deferrals.append(1))
    prompts = _prompts(4, 60, seed=3)
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    expected = _tokens(reference.generate(prompts, params))
    with LLM(kv_offload_cpu_gb=CPU_GB, kv_growth_reservation=False, **SMALL_POOL) as llm:
        got = _tokens(llm.generate(prompts, params))
        assert llm.core.scheduler.num_preemptions > 0
        assert _tier(llm, "cpu").loaded_bytes > 0
        assert bool(deferrals) == deferred
        assert_no_leaks(llm)
    assert got == expected


def test_disk_tier_survives_restart_and_truncated_file_is_a_miss(reference, tmp_path, caplog):
    prompts = _prompts(3, 100, seed=4)
    expected = _tokens(reference.generate(prompts, GREEDY))
    disk = dict(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gb=0.05)
    with LLM(**disk, **SMALL_POOL) as llm:
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert_no_leaks(llm)
        stored = len(llm.core.kv.offload.disk)
    files = sorted((tmp_path / "kv").glob("*/*.kv"))
    assert stored == len(files) == 3 * 6
    with LLM(**disk, **SMALL_POOL) as llm:  # a restart: the device pool starts empty
        assert len(llm.core.kv.offload.disk) == stored  # reopened
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        d = _tier(llm, "disk")
        assert d.loaded_bytes > 0 and d.hit_tokens > 0 and d.errors == 0
        assert_no_leaks(llm)
    # Truncate every file of the first prompt's pages while an engine has them indexed: each load
    # fails its check, and the pages are recomputed.
    with LLM(**disk, **SMALL_POOL) as llm:
        for path in files:
            with open(path, "r+b") as f:
                f.truncate(100)
        with caplog.at_level("WARNING"):
            assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert _tier(llm, "disk").errors > 0
        assert "unusable" in caplog.text
        assert_no_leaks(llm)


def test_disk_hits_are_promoted_to_the_cpu_tier(reference, tmp_path):
    prompts = _prompts(3, 100, seed=8)
    others = _prompts(4, 100, seed=9)  # fill the device pool, so that the prompts come back from a tier
    expected = _tokens(reference.generate(prompts, GREEDY))
    disk = dict(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gb=0.05)
    with LLM(**disk, **SMALL_POOL) as llm:
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
    with LLM(kv_offload_cpu_gb=CPU_GB, **disk, **SMALL_POOL) as llm:  # a restart: only the disk has them
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        from_disk = _tier(llm, "disk").hit_tokens
        assert from_disk > 0
        offload = llm.core.kv.offload
        hashes = list(offload.disk.entries)
        assert len(hashes) == 18 and all(key in offload.cpu for key in hashes)  # every page the disk held, promoted
        llm.generate(others, GREEDY)
        from_cpu = _tier(llm, "cpu").hit_tokens  # (a request preempted in the 24-page pool came back from it)
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert _tier(llm, "disk").hit_tokens == from_disk  # the second reuse is a CPU hit
        assert _tier(llm, "cpu").hit_tokens - from_cpu >= 3 * 96
        assert_no_leaks(llm)


@pytest.mark.parametrize("engine", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(async_scheduling=True)], ids=["tp2", "pp2", "async"])
def test_cpu_tier_under_parallelism_and_async_scheduling(reference, engine):
    # Every rank offloads its own shard of each page (its own layers under pipeline parallelism).
    prompts = _prompts(6, 100, seed=5)
    expected = _tokens(reference.generate(prompts, GREEDY))
    with LLM(kv_offload_cpu_gb=CPU_GB, **SMALL_POOL, **engine) as llm:
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        assert _tier(llm, "cpu").loaded_bytes > 0
        assert_no_leaks(llm)


def test_full_disk_shrinks_the_disk_tier_instead_of_failing(reference, tmp_path, monkeypatch, caplog):
    # A file system with room for 10 pages, whatever the tier's size says.
    from pagoda_engine.worker import kv_stores

    write = kv_stores.DiskStore.write
    lock = threading.Lock()  # the engine writes from two threads: one file system, one count

    def write_until_full(self, key, payload):
        with lock:
            if len(list(self.dir.glob("*.kv"))) >= 10:
                raise OSError(28, "No space left on device")
            write(self, key, payload)

    monkeypatch.setattr(kv_stores.DiskStore, "write", write_until_full)
    prompts = _prompts(4, 100, seed=6)
    expected = _tokens(reference.generate(prompts, GREEDY))
    with LLM(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        with caplog.at_level("WARNING"):
            assert _tokens(llm.generate(prompts, GREEDY)) == expected
            assert _tokens(llm.generate(prompts[::-1], GREEDY)) == expected[::-1]
        d = _tier(llm, "disk")
        assert d.errors > 0 and "disk tier now holds at most" in caplog.text
        assert d.capacity_bytes < 10 * llm.core.kv.offload.page_bytes  # shrunk below what fits
        assert d.usage_bytes <= d.capacity_bytes
        assert len(list((tmp_path / "kv").glob("*/*.kv"))) == len(llm.core.kv.offload.disk)  # no orphan files
        assert_no_leaks(llm)


def test_request_aborted_while_its_prefix_loads_leaves_no_page_held(tmp_path):
    from pagoda_engine.messages import EngineCoreRequest

    prompts = _prompts(6, 100, seed=7)
    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        llm.generate(prompts, GREEDY)  # all on disk; the device pool kept only the last ones
        core = llm.core
        core.wait_for_offload()
        core.add_request(EngineCoreRequest("again", prompts[0], GREEDY))
        core.step()
        assert core.kv.split_limit(core.scheduler.requests["again"]) is not None  # the rest of its prefix loads
        assert core.kv.pool.num_free_pages < core.num_kv_pages - 1
        core.abort_requests(["again"])
        core.wait_for_offload()
        assert not core.has_unfinished_requests()
        assert_no_leaks(llm)


def test_request_aborted_while_its_deferred_host_memory_load_lands_leaves_no_page_held(monkeypatch):
    from pagoda_engine.messages import EngineCoreRequest

    prompts = _prompts(6, 100, seed=9)
    with LLM(kv_offload_cpu_gb=CPU_GB, **SMALL_POOL) as llm:
        llm.generate(prompts, GREEDY)
        core = llm.core
        core.wait_for_offload()
        monkeypatch.setattr(core.kv.offload, "_copy_outlasts_step", lambda num_pages: True)
        core.add_request(EngineCoreRequest("busy", prompts[5], SamplingParams(temperature=0, max_tokens=6)))
        core.step()
        core.add_request(EngineCoreRequest("again", prompts[0], GREEDY))
        core.step()
        assert core.kv.offload.is_loading("again")
        core.abort_requests(["again"])
        while core.has_unfinished_requests():
            core.step()
        core.wait_for_offload()
        assert not core.kv.offload.has_loaded("again")
        assert_no_leaks(llm)


def test_a_prefix_on_disk_is_computed_from_the_front_while_its_rest_loads(reference, tmp_path):
    """A split load: the request runs at once, computing its prefix's front, and joins the rest,
    landed from disk, where its computing reaches it; its tokens are those of a run without tiers,
    and nothing leaks. Without a CPU tier, every prefix comes from disk."""
    from pagoda_engine.messages import EngineCoreRequest

    prompts = _prompts(6, 200, seed=8)
    expected = _tokens(reference.generate(prompts[:1], GREEDY))
    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        llm.generate(prompts, GREEDY)  # all on disk; the device pool kept only the last ones
        core = llm.core
        core.wait_for_offload()
        disk_hits = _tier(llm, "disk").hit_tokens
        core.add_request(EngineCoreRequest("again", prompts[0], GREEDY))
        core.step()
        req = core.scheduler.requests["again"]
        assert req.status.name == "RUNNING" and not core.kv.offload.is_loading("again")
        assert core.kv.split_limit(req) == 96  # 12 pages, nothing measured yet: it computes 6, 6 load
        assert _tier(llm, "disk").hit_tokens - disk_hits == 192  # the 12 pages the disk held, computed or loaded
        core.wait_for_offload()  # every chunk has landed
        while core.has_unfinished_requests():
            core.step()
        assert req.output_token_ids == expected[0]
        assert req.num_cached_tokens == 96  # joined: computed 6 pages and the last 8 tokens, loaded 6 pages
        core.wait_for_offload()
        assert_no_leaks(llm)


def test_under_async_scheduling_a_split_waits_at_its_cut_for_its_load_instead_of_computing_it(
        reference, tmp_path, monkeypatch):
    """The step after the one that computes up to the cut is scheduled while that one runs: the
    request sits it out, and then waits for its load (slow here: 50 ms a page) for as long as
    computing those pages would take, and joins them."""
    from pagoda_engine.messages import EngineCoreRequest
    from pagoda_engine.worker.kv_stores import DiskStore

    read = DiskStore.read

    def slow_read(self, key, payload_bytes):
        time.sleep(0.05)
        return read(self, key, payload_bytes)

    prompts = _prompts(6, 200, seed=8)
    expected = _tokens(reference.generate(prompts[:1], GREEDY))
    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, async_scheduling=True,
             **SMALL_POOL) as llm:
        llm.generate(prompts, GREEDY)  # all on disk; the device pool kept only the last ones
        core = llm.core
        core.wait_for_offload()
        core.kv.offload._token_prefill_s = 0.01  # computing the 6 loading pages would take ~1 s: worth waiting
        monkeypatch.setattr(DiskStore, "read", slow_read)
        core.add_request(EngineCoreRequest("again", prompts[0], GREEDY))
        core.step()  # launches the step that computes its first 6 pages
        req = core.scheduler.requests["again"]
        assert core.kv.split_limit(req) == 96 and req.num_steps_in_flight == 1
        core.step()  # schedules the next step with the cut still in flight: the request waits
        while core.has_unfinished_requests():
            core.step()
        assert req.output_token_ids == expected[0]
        assert req.num_cached_tokens == 96 and req.num_steps_in_flight == 0  # the 6 loaded pages joined
        core.wait_for_offload()
        assert_no_leaks(llm)


def test_a_split_at_its_cut_waits_for_its_load_no_longer_than_computing_it_would_take(tmp_path):
    from pagoda_engine.core.kv.offload.manager import Load, _Split

    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        offload = llm.core.kv.offload
        pages = llm.core.kv.pool.get_new_pages(10)  # the 10 pages its load fills
        offload._loads[99] = Load("r", list(pages), list(pages), [], [], [], time.monotonic())
        offload._splits["r"] = _Split(cut=2, load_id=99)
        assert not offload.split_ready("r", cut_in_flight=True)  # the cut's own step still runs
        assert offload.split_ready("r", cut_in_flight=False)  # no prefill measured: computing them is the bet
        offload._splits["r"] = _Split(cut=2, load_id=99)
        offload.observe_step(4096, 4096 * 50e-6)  # 0.8 ms a page: 8 ms for its 10
        assert not offload.split_ready("r", cut_in_flight=False)  # waits from now on...
        time.sleep(0.01)
        assert offload.split_ready("r", cut_in_flight=False)  # ...as long as computing them would take
        offload._splits["r"] = _Split(cut=2, load_id=99, landed=[])
        assert offload.split_ready("r", cut_in_flight=True)  # landed: taken at once
        offload._splits.clear()
        del offload._loads[99]
        llm.core.kv.pool.free_pages(pages)


def test_a_split_load_never_takes_the_requests_own_free_device_hits(reference, tmp_path):
    """The front of a prefix still on the device (free, cached, first in the free queue) and its
    rest on disk: the chunks that load take other pages, so the device hits keep their bytes."""
    from pagoda_engine.messages import EngineCoreRequest

    prompt = _prompts(1, 100, seed=10)[0]
    expected = _tokens(reference.generate([prompt], GREEDY))
    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        assert _tokens(llm.generate([prompt], GREEDY)) == expected
        core = llm.core
        core.wait_for_offload()
        pool = core.kv.pool
        # Hand out every free page but the prompt's first three: its later pages leave the device.
        pool.free_pages(pool.get_new_pages(pool.num_free_pages - 3))
        disk_hits = core.kv.offload.counters["disk"].hit_tokens
        core.add_request(EngineCoreRequest("again", prompt, GREEDY))
        core.step()
        req = core.scheduler.requests["again"]
        assert req.num_cached_tokens == 48  # its first three pages, still on the device
        assert core.kv.offload.counters["disk"].hit_tokens - disk_hits == 48  # pages 3-5, on disk
        while core.has_unfinished_requests():
            core.step()
        assert req.output_token_ids == expected[0]
        core.wait_for_offload()
        assert_no_leaks(llm)


def test_a_request_passed_over_while_the_pool_is_full_counts_its_tier_lookup_once(tmp_path):
    """Its prefix is on disk but the pool has no room to load it: every schedule looks again and
    passes it over; once admitted (with room, its split loads part), the disk counts its pages once."""
    from pagoda_engine.messages import EngineCoreRequest

    prompt = _prompts(1, 200, seed=13)[0]
    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        llm.generate([prompt], GREEDY)
        core = llm.core
        core.wait_for_offload()
        pool = core.kv.pool
        taken = pool.get_new_pages(pool.num_free_pages)  # evicts its device pages, leaves no room
        disk = core.kv.offload.counters["disk"]
        hits, misses, queries = disk.hit_tokens, disk.miss_tokens, core.kv.prefix_queries
        core.add_request(EngineCoreRequest("again", prompt, GREEDY))
        for _ in range(5):
            core.step()
        assert core.scheduler.requests["again"].status.name == "WAITING"
        assert (disk.hit_tokens, disk.miss_tokens, core.kv.prefix_queries) == (hits, misses, queries)  # not yet
        pool.free_pages(taken)
        while core.has_unfinished_requests():
            core.step()
        assert core.kv.prefix_queries - queries == len(prompt)
        assert disk.hit_tokens + disk.miss_tokens - hits - misses == 192  # its 12 full pages: once
        assert disk.hit_tokens - hits == 192  # found there (a split computes the front of them)
        core.wait_for_offload()
        assert_no_leaks(llm)


def test_a_prefix_in_host_memory_is_admitted_in_the_step_that_loads_it(reference):
    """A CPU-tier load lands at once: the request runs in the very step its load starts (the step
    waits for the copies on the device), with the loaded pages as prefix hits, and its tokens are
    those of a run without tiers."""
    from pagoda_engine.messages import EngineCoreRequest

    prompts = _prompts(6, 100, seed=7)
    expected = _tokens(reference.generate(prompts[:1], GREEDY))
    with LLM(kv_offload_cpu_gb=CPU_GB, **SMALL_POOL) as llm:
        llm.generate(prompts, GREEDY)  # all in host memory; the device pool kept only the last ones
        core = llm.core
        core.wait_for_offload()
        cpu_hits = _tier(llm, "cpu").hit_tokens
        core.add_request(EngineCoreRequest("again", prompts[0], GREEDY))
        core.step()
        assert not core.kv.offload.is_loading("again")
        req = core.scheduler.requests["again"]
        assert req.num_cached_tokens == 96  # 6 of its 6 full pages before the last token, from host memory
        assert _tier(llm, "cpu").hit_tokens - cpu_hits == 96
        assert req.num_output_tokens or req.num_output_placeholders  # it ran in the step that loaded it
        while core.has_unfinished_requests():
            core.step()
        assert req.output_token_ids == expected[0]
        core.wait_for_offload()
        assert_no_leaks(llm)


def test_a_host_memory_load_that_would_hold_up_other_requests_joins_the_next_schedule(reference, monkeypatch):
    """Copies that would outlast a good part of the step (`_copy_outlasts_step`, forced here: on
    the CPU nothing is timed) are not awaited by the step that starts them while other requests
    run in it: the request joins on the next schedule, once the poll has landed its pages, with
    them as prefix hits and the tokens of a run without tiers. With nothing else running it
    joins at once, as any host-memory load."""
    from pagoda_engine.messages import EngineCoreRequest

    prompts = _prompts(6, 100, seed=8)
    expected = _tokens(reference.generate(prompts[:2], GREEDY))
    with LLM(kv_offload_cpu_gb=CPU_GB, **SMALL_POOL) as llm:
        llm.generate(prompts, GREEDY)
        core = llm.core
        core.wait_for_offload()
        offload = core.kv.offload
        monkeypatch.setattr(offload, "_copy_outlasts_step", lambda num_pages: True)
        core.add_request(EngineCoreRequest("alone", prompts[0], SamplingParams(temperature=0, max_tokens=12)))
        core.step()
        alone = core.scheduler.requests["alone"]
        assert alone.num_cached_tokens == 96 and (alone.num_output_tokens or alone.num_output_placeholders)
        core.add_request(EngineCoreRequest("joins", prompts[1], GREEDY))
        core.step()  # "alone" decodes; the load of "joins" runs beside that step
        joins = core.scheduler.requests["joins"]
        assert offload.is_loading("joins") and joins.status.name == "WAITING"
        core.step()  # the poll lands it; this step waits for its copies
        assert not offload.is_loading("joins") and joins.status.name == "RUNNING"
        assert joins.num_cached_tokens == 96
        while core.has_unfinished_requests():
            core.step()
        assert [alone.output_token_ids[:8], joins.output_token_ids] == expected
        core.wait_for_offload()
        assert_no_leaks(llm)


def test_a_host_memory_load_is_deferred_only_when_its_copies_would_take_half_a_small_step():
    with LLM(kv_offload_cpu_gb=CPU_GB, **SMALL_POOL) as llm:
        offload = llm.core.kv.offload
        assert not offload._copy_outlasts_step(10_000)  # nothing timed on the CPU
        offload._rank_copies = [[50e9, 1.0, 0.0, 0.0]]  # loads timed at 50 GB/s
        assert not offload._copy_outlasts_step(10_000)  # no small step measured yet
        offload._small_step_s = 0.008
        half_step_pages = 0.004 * 50e9 / offload.page_bytes
        assert offload._copy_outlasts_step(int(half_step_pages) + 1)
        assert not offload._copy_outlasts_step(int(half_step_pages) - 1)


@pytest.mark.parametrize("tier, message", [
    ({"kv_offload_cpu_gb": 1e-9}, r"--kv-offload-cpu-gb 1e-09 holds no page \(\d+ bytes each\)"),
    ({"kv_offload_disk_gb": 1e-9}, r"--kv-offload-disk-gb 1e-09 holds no page \(\d+ bytes each\)"),
])
def test_a_tier_too_small_for_one_page_is_refused_at_start(tier, message, tmp_path):
    if "kv_offload_disk_gb" in tier:
        tier = {**tier, "kv_offload_disk_path": str(tmp_path)}
    with pytest.raises(ModelLoadError, match=message):
        LLM(MODEL, num_gpu_blocks_override=24, max_model_len=256, **tier)


def test_a_split_load_cuts_where_measured_load_and_compute_would_end_together(tmp_path):
    from pagoda_engine.core.kv.offload.manager import Lookup

    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        offload = llm.core.kv.offload
        lookup = Lookup([bytes([i]) * 16 for i in range(12)], ["disk"] * 12, 12)
        assert offload._split_cut(lookup) == 6  # nothing measured yet: half and half
        offload.observe_step(512, 1.0)  # too short a step to estimate a prefill from
        assert offload._split_cut(lookup) == 6
        offload.observe_step(4096, 4096 * 50e-6)  # 50 us a token: 0.8 ms a page of 16
        offload._page_load_s["disk"] = 4 * 0.8e-3  # a page loads 4 x slower than it computes
        assert offload._split_cut(lookup) == 10  # 12 x 4 / 5 = 9.6 pages computed, the rest loaded
        offload._page_load_s["disk"] = 0.8e-3 / 3  # 3 x faster
        assert offload._split_cut(lookup) == 3
        offload._page_load_s["disk"] = 100.0  # hopeless: still the last page loads
        assert offload._split_cut(lookup) == 11
        # Pages that would save less compute than the step a split adds (two of 10 ms), or that
        # are under a fifth of what was found, are recomputed.
        offload.observe_step(1, 0.010)
        offload.observe_step(16, 0.030)  # a step that waited for a load's copies: not what a step costs
        assert offload._small_step_s == 0.010
        assert offload._worth_loading(30, 100)  # 24 ms of prefill saved
        assert not offload._worth_loading(12, 40)  # 9.6 ms
        assert not offload._worth_loading(30, 200)  # 15 % of what was found


def test_a_tiers_load_speed_is_the_median_of_its_recent_loads_of_sixteen_pages_or_more(tmp_path):
    """One slow load (cold connections, a busy moment) does not stop the splits that would measure
    the tier again; loads too small to amortize their fixed cost do not count."""
    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        offload = llm.core.kv.offload
        offload.observe_load_speed("remote", 8, 0.1)
        assert "remote" not in offload._page_load_s
        offload.observe_load_speed("remote", 100, 0.5)  # cold: 5 ms a page
        assert offload._page_load_s["remote"] == pytest.approx(5e-3)
        offload.observe_load_speed("remote", 100, 0.04)
        offload.observe_load_speed("remote", 50, 0.05)
        assert offload._page_load_s["remote"] == pytest.approx(1e-3)  # 0.4, 1 and 5 ms a page
        for _ in range(8):  # the cold one leaves the window of the last 8
            offload.observe_load_speed("remote", 100, 0.06)
        assert offload._page_load_s["remote"] == pytest.approx(6e-4)
        assert "disk" not in offload._page_load_s


def test_a_split_that_would_not_pay_recomputes_but_every_fourth_loads_half_to_measure_again(tmp_path):
    from pagoda_engine.core.kv.block_pool import hash_pages

    prompt = _prompts(1, 200, seed=12)[0]
    hashes = hash_pages(prompt, 16)
    with LLM(kv_offload_disk_path=str(tmp_path), kv_offload_disk_gb=0.05, **SMALL_POOL) as llm:
        llm.generate([prompt], GREEDY)
        llm.core.wait_for_offload()
        offload = llm.core.kv.offload
        lookup = offload.lookup(hashes)
        assert lookup.tiers == ["disk"] * 12
        offload.observe_step(4096, 4096 * 50e-6)
        offload._page_load_s["disk"] = 100.0  # hopeless: the cut leaves 1 of 12 pages to load
        cuts = []
        for i in range(8):
            assert offload.start_split_load(f"r{i}", [], lookup, 1)
            cuts.append(offload.split_limit(f"r{i}"))
        assert cuts == [None, None, None, 6, None, None, None, 6]
        for i in (3, 7):
            offload.cancel_split(f"r{i}")
        llm.core.wait_for_offload()
        assert_no_leaks(llm)


def test_kv_events_follow_pages_onto_disk_off_it_when_corrupt_and_back_into_the_pool(reference, tmp_path):
    """The disk tier's events (medium "STORAGE"): a page written is stored with its tokens, a
    page found corrupt is removed, and is stored again once recomputed; pages loaded back into
    the pool (split loads: the part after the cut) are "GPU" stores chained to the page before
    them. (Host memory and the wire format: `tests/server/test_kv_events_tiers.py`.)"""
    from kv_event_replay import held_hashes, replayed

    from pagoda_engine.core.kv.block_pool import hash_pages
    from pagoda_engine.kv_event_wire import block_hash_int

    prompts = _prompts(3, 100, seed=21)
    others = _prompts(4, 100, seed=22)  # fill the device pool, so that the prompts come back from disk
    expected = _tokens(reference.generate(prompts, GREEDY))
    hashes = [[block_hash_int(h) for h in hash_pages(p, 16)] for p in prompts]
    with LLM(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gb=0.05,
             kv_events_config='{"enable_kv_cache_events": true, "endpoint": "inproc://kv-events-disk-tier"}',
             **SMALL_POOL) as llm:
        events = []
        llm.core.kv_events.publish = events.extend  # every step's events, as the publisher gets them
        assert _tokens(llm.generate(prompts, GREEDY)) == expected
        llm.core.wait_for_offload()
        llm.core.get_stats()

        def of(kind: str, medium: str, since: int = 0) -> list:
            return [e for e in events[since:] if type(e).__name__ == kind and e.medium == medium]

        stored = {h: e for e in of("BlockStored", "STORAGE") for h in e.block_hashes}
        assert set(stored) == {h for p in hashes for h in p}
        for prompt, chain in zip(prompts, hashes):
            runs = [e for e in of("BlockStored", "STORAGE") if set(e.block_hashes) & set(chain)]
            assert [h for e in runs for h in e.block_hashes] == chain
            assert [t for e in runs for t in e.token_ids] == prompt[:96] and runs[0].parent_block_hash is None
        # The first prompt's files go bad; the others' pages leave the pool.
        for path in sorted((tmp_path / "kv").glob("*/*.kv")):
            if int.from_bytes(bytes.fromhex(path.stem)[-8:], "big") in hashes[0]:
                with open(path, "r+b") as f:
                    f.truncate(100)
        llm.generate(others, GREEDY)
        mark = len(events)
        for prompt, tokens in zip(prompts, expected):  # one at a time: each a split load
            assert _tokens(llm.generate([prompt], GREEDY)) == [tokens]
        llm.core.wait_for_offload()
        llm.core.get_stats()
        removed = {h for e in of("BlockRemoved", "STORAGE", mark) for h in e.block_hashes}
        assert removed and removed <= set(hashes[0])  # only what was found corrupt
        # Replayed in order, the events give what the disk and the pool hold now.
        for medium, held in (("STORAGE", llm.core.kv.offload.disk.entries), ("GPU", llm.core.kv.pool.cached)):
            assert replayed(events, medium) == held_hashes(held), medium
        # What came back from disk into the pool is known to the device's index again.
        loaded = [e for e in of("BlockStored", "GPU", mark) if set(e.block_hashes) & set(hashes[1])]
        assert loaded
        for e in loaded:
            i = hashes[1].index(e.block_hashes[0])
            assert e.block_hashes == hashes[1][i:i + len(e.block_hashes)]
            assert e.parent_block_hash == (hashes[1][i - 1] if i else None)
            assert e.token_ids == prompts[1][i * 16:(i + len(e.block_hashes)) * 16]
        assert any(e.parent_block_hash is not None for e in loaded)  # the split's loaded part follows its cut
        assert_no_leaks(llm)

"""KV offload tiers on the GPU: pages stored through the copy stream into pinned host slots and
disk files, and loaded back into other device pages, are bit-identical to what was stored; a
load issued while the compute stream still writes its destination pages lands after that
write (its host copy runs at once, its scatter waits for the step in flight); the
engine with a CPU tier (async scheduling, CUDA graphs, FlashInfer) gives the same greedy tokens
as without one, with prefixes loaded back from host memory, and leaves no page held."""

from __future__ import annotations

import time

import pytest
import torch

from gpu_support import CUDA, make_llm, random_prompts, requires_gpu
from pagoda_engine import SamplingParams
from pagoda_engine.kv_tiers import CPU, DISK, OffloadSetup
from pagoda_engine.worker.kv_offload import KVOffloader

pytestmark = [pytest.mark.gpu, requires_gpu]


def _poll_until(offloader: KVOffloader, done, timeout: float = 30.0):
    events = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events.append(offloader.poll())
        if done(events):
            return events
        time.sleep(0.001)
    raise AssertionError("offload copies did not finish")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_stored_and_reloaded_pages_are_bit_identical(tmp_path):
    layers = [torch.randn(40, 2, 16, 8, 128, dtype=torch.bfloat16, device=CUDA) for _ in range(4)]
    setup = OffloadSetup(b"f" * 16, num_cpu_slots=16, disk_path=str(tmp_path))
    offloader = KVOffloader(layers, setup, b"g" * 16)
    assert offloader.cpu_slots.is_pinned()
    pages = [3, 5, 6, 9, 17, 30]
    slots = [0, 1, 2, 7, 8, -1]  # runs of consecutive slots, and one page that goes to disk only
    keys = [bytes([i]) * 16 for i in range(len(pages))]
    original = [torch.stack([layer[p] for layer in layers]).clone() for p in pages]
    offloader.store(1, pages, slots, keys, [None] * len(pages), [])
    events = _poll_until(offloader, lambda evs: any(e.written for e in evs))
    assert [1] == [s for e in events for s in e.copied]
    assert all(not failed for e in events for _, failed, _ in e.written)
    for i, slot in enumerate(slots):
        if slot >= 0:
            assert torch.equal(_bits(offloader.cpu_slots[slot]), _bits(original[i].cpu()))
    for layer in layers:
        layer.zero_()
    targets = [20, 21, 22, 23, 24, 25]
    sources = [(CPU, s) for s in slots[:5]] + [(DISK, keys[5])]
    offloader.load(2, targets, sources)
    events = _poll_until(offloader, lambda evs: any(e.loaded for e in evs))
    assert [(2, len(targets))] == [(load_id, ok) for e in events for load_id, ok, _ in e.loaded]
    offloader.wait_for_loads()  # what the next step does: its stream waits for the copies the poll reported
    for i, page in enumerate(targets):
        assert torch.equal(_bits(torch.stack([layer[page] for layer in layers])), _bits(original[i]))
    # The copies were timed on the device: every byte each way, in some time.
    torch.cuda.synchronize()
    load_bytes, load_s, store_bytes, store_s = offloader.poll().copy
    assert load_bytes == store_bytes == len(pages) * offloader.payload_bytes and load_s > 0 and store_s > 0
    offloader.close()


def test_load_scatters_after_the_step_in_flight():
    layers = [torch.randn(300, 2, 16, 8, 128, dtype=torch.bfloat16, device=CUDA) for _ in range(8)]
    offloader = KVOffloader(layers, OffloadSetup(b"f" * 16, num_cpu_slots=128), b"g" * 16)
    pages, targets = list(range(1, 129)), list(range(150, 278))
    original = torch.stack([layer[pages] for layer in layers]).clone()
    offloader.store(1, pages, list(range(128)), [None] * 128, [None] * 128, [])
    _poll_until(offloader, lambda evs: any(e.copied for e in evs))
    # A step in flight that still writes the pages the load is about to fill (they were freed under it).
    torch.cuda._sleep(50_000_000)
    for layer in layers:
        layer[targets] = 0
    offloader.load(2, targets, [(CPU, s) for s in range(128)])
    _poll_until(offloader, lambda evs: any(e.loaded for e in evs))
    offloader.wait_for_loads()
    assert torch.equal(_bits(torch.stack([layer[targets] for layer in layers])), _bits(original))
    # A CPU-tier load the next step waits for on the device: read at once, with no host wait.
    for layer in layers:
        layer[targets] = 0
    offloader.load(3, targets, [(CPU, s) for s in range(128)], awaited=True)
    offloader.wait_for_loads()
    assert torch.equal(_bits(torch.stack([layer[targets] for layer in layers])), _bits(original))
    offloader.close()


def _greedy(llm, prompts, max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_cpu_tier_gives_same_greedy_tokens_on_gpu(gpu_model_dir):
    # 12 prompts of 30 pages in a pool of 120: the second round's prefixes come back from host memory.
    prompts = random_prompts(7, [480] * 12)
    reference = make_llm(gpu_model_dir, num_kv_pages=2048, max_model_len=512)
    expected = _greedy(reference, prompts)
    del reference
    llm = make_llm(gpu_model_dir, num_gpu_blocks_override=120, max_model_len=512, kv_offload_cpu_gb=0.5, max_num_seqs=4,
                   async_scheduling=True)  # the offline LLM is synchronous unless asked
    assert llm.core.config.scheduler.async_scheduling and llm.core.cuda_graphs
    assert _greedy(llm, prompts) == expected
    assert _greedy(llm, prompts) == expected
    (cpu,) = llm.core.get_stats().kv_offload
    assert cpu.loaded_bytes > 0 and cpu.hit_tokens > 0
    offload = llm.core.kv.offload
    assert not offload.busy and offload.cpu.num_pinned == 0
    assert llm.core.kv.pool.num_free_pages == llm.core.num_kv_pages - 1


def test_kv_events_follow_pages_through_the_cpu_tier_on_gpu(gpu_model_dir):
    """KV events with a CPU tier under async scheduling and CUDA graphs: the greedy tokens do not
    change, the tier evicts, and the events replayed in order give exactly what the tier and the
    device pool hold (a store reported once every copy is done, a load as a GPU store)."""
    from kv_event_replay import held_hashes, replayed

    prompts = random_prompts(8, [480] * 12)  # 30 pages each: 360 pages through a tier of 200
    reference = make_llm(gpu_model_dir, num_kv_pages=2048, max_model_len=512)
    expected = _greedy(reference, prompts)
    del reference
    page_bytes = 2 * 2 * 16 * 2 * 64 * 2  # layers, K and V, tokens, KV heads, head dim, bf16
    llm = make_llm(gpu_model_dir, num_gpu_blocks_override=120, max_model_len=512, max_num_seqs=4,
                   kv_offload_cpu_gb=200 * page_bytes / 2**30, async_scheduling=True,
                   kv_events_config='{"enable_kv_cache_events": true, "endpoint": "inproc://kv-events-gpu-tier"}')
    offload = llm.core.kv.offload
    assert offload.cpu.capacity == 200 and llm.core.cuda_graphs
    events = []
    llm.core.kv_events.publish = events.extend
    assert _greedy(llm, prompts) == expected
    assert _greedy(llm, prompts[::-1]) == expected[::-1]  # the last ones first: they are still in the tier
    llm.core.wait_for_offload()
    llm.core.get_stats()  # the last step's events
    (cpu,) = llm.core.get_stats().kv_offload
    assert cpu.loaded_bytes > 0
    assert any(type(e).__name__ == "BlockRemoved" and e.medium == "CPU" for e in events)
    for medium, held in (("CPU", offload.cpu.entries), ("GPU", llm.core.kv.pool.cached)):
        assert replayed(events, medium) == held_hashes(held), medium

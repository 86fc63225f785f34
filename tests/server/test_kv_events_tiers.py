"""`--kv-events-config` together with KV offload tiers, on a real `pagoda serve` whose device pool
holds about one prompt and a half: the events a subscriber reads (with the msgpack reader written
from the spec, `msgpack_reader.py`, against vLLM's schema) follow a prompt's pages across media,
in order: stored on the GPU, stored in host memory ("CPU") and on disk ("STORAGE", vLLM's name
for its file-system offload medium), evicted from the GPU by other prompts, loaded back from host
memory into the GPU (a "GPU" `BlockStored` again, with the prompt's tokens and parent hashes),
and evicted from host memory. The hashes are computed here from the prompt's tokens."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import zmq
from conftest import free_port, launch
from msgpack_reader import unpack

from pagoda_engine.core.kv.block_pool import hash_pages

BLOCK = 16
PAGE_BYTES = 8192  # one page of the tiny model
CPU_PAGES = 32
DISK_PAGES = 40  # about: each of the tiny model's layer files takes a header besides its share
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx"]


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 400, size=length).tolist()


def _hashes(prompt: list[int]) -> list[int]:
    """vLLM's integer form (the low 64 bits) of the chained hashes of the prompt's full pages."""
    return [int.from_bytes(h[-8:], "big") for h in hash_pages(prompt, BLOCK)]


@pytest.fixture(scope="module")
def ports():
    return free_port(), free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory, ports):
    config = (f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{ports[0]}", '
              f'"replay_endpoint": "tcp://*:{ports[1]}"}}')
    tmp = tmp_path_factory.mktemp("serve")
    # 19 usable device pages: two prompts of 12 pages evict a third one's 6.
    srv = launch(tmp, "--model", "pagoda-tiny", "--num-kv-pages", "20", "--max-model-len", "256", "--max-num-seqs", "1",
                 "--kv-offload-cpu-gb", repr(CPU_PAGES * PAGE_BYTES / 2**30),
                 "--kv-offload-disk-path", str(tmp / "kv"), "--kv-offload-disk-gb",
                 repr(DISK_PAGES * PAGE_BYTES * 1.01 / 2**30), "--kv-events-config", config)
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def subscriber(server, ports):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{ports[0]}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.5)  # the PUB side drops what it sends before the subscription arrives
    yield sub
    sub.close(linger=0)


class Events:
    """Every event read so far, in the order published."""

    def __init__(self, sub):
        self.sub, self.seen, self.next_seq = sub, [], None

    def until(self, holds, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not holds():
            assert time.monotonic() < deadline, (f"no matching KV events in {timeout} s; got "
                                                 f"{[(e['type'], e['medium'], len(e['block_hashes'])) for e in self.seen]}")
            if self.sub.poll(200):
                _, seq, payload = self.sub.recv_multipart()
                seq = int.from_bytes(seq, "big")
                assert self.next_seq in (None, seq)  # no batch lost or reordered
                self.next_seq = seq + 1
                ts, events, rank = unpack(payload)
                assert isinstance(ts, float) and rank == 0
                self.seen += events

    def of(self, kind: str, medium: str) -> list[dict]:
        return [e for e in self.seen if e["type"] == kind and e["medium"] == medium]

    def hashes(self, kind: str, medium: str) -> set[int]:
        return {h for e in self.of(kind, medium) for h in e["block_hashes"]}

    def index(self, kind: str, medium: str, hashes: list[int]) -> int:
        """Where the last of `hashes` arrived in an event of this kind and medium."""
        where = {}
        for i, e in enumerate(self.seen):
            if e["type"] == kind and e["medium"] == medium:
                where.update(dict.fromkeys(set(e["block_hashes"]) & set(hashes), i))
        assert set(where) == set(hashes), (kind, medium, set(hashes) - set(where))
        return max(where.values())


def _complete(server, prompt: list[int]) -> None:
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"model": "pagoda-tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text


def _chain(events: list[dict], prompt: list[int]) -> None:
    """These stores describe the prompt's full pages: one chain from its start, its tokens, whole."""
    hashes = _hashes(prompt)
    assert [h for e in events for h in e["block_hashes"]] == hashes
    assert events[0]["parent_block_hash"] is None
    for before, after in zip(events, events[1:]):
        assert after["parent_block_hash"] == before["block_hashes"][-1]
    assert [t for e in events for t in e["token_ids"]] == prompt[:len(hashes) * BLOCK]
    for e in events:
        assert list(e) == STORED_KEYS
        assert e["block_size"] == BLOCK and e["group_idx"] == 0 and e["kv_cache_spec_kind"] == "full_attention"
        assert e["lora_id"] is None and e["lora_name"] is None and e["extra_keys"] == [None] * len(e["block_hashes"])


def _stores_of(events: Events, medium: str, prompt: list[int], after: int = -1) -> list[dict]:
    hashes = set(_hashes(prompt))
    return [e for i, e in enumerate(events.seen) if i > after and e["type"] == "BlockStored"
            and e["medium"] == medium and hashes & set(e["block_hashes"])]


def test_a_prompts_pages_are_followed_across_gpu_host_memory_and_disk(server, subscriber):
    events = Events(subscriber)
    a = _prompt(0, 100)  # 6 full pages
    others = [_prompt(seed, 200) for seed in range(1, 7)]  # 12 full pages each
    a_hashes = _hashes(a)
    assert len(a_hashes) == 6

    # Stored on the device, then in host memory and on disk once every rank has copied it.
    _complete(server, a)
    events.until(lambda: set(a_hashes) <= events.hashes("BlockStored", "CPU")
                 and set(a_hashes) <= events.hashes("BlockStored", "STORAGE"))
    for medium in ("GPU", "CPU", "STORAGE"):
        _chain(_stores_of(events, medium, a), a)
    gpu_stored = events.index("BlockStored", "GPU", a_hashes)
    assert gpu_stored < events.index("BlockStored", "CPU", a_hashes)
    assert gpu_stored < events.index("BlockStored", "STORAGE", a_hashes)

    # Two longer prompts take the device pool: the first prompt's pages leave the GPU only.
    for prompt in others[:2]:
        _complete(server, prompt)
    events.until(lambda: set(a_hashes) <= events.hashes("BlockRemoved", "GPU")
                 and set(_hashes(others[1])) <= events.hashes("BlockStored", "CPU"))
    evicted = events.index("BlockRemoved", "GPU", a_hashes)
    assert not set(a_hashes) & (events.hashes("BlockRemoved", "CPU") | events.hashes("BlockRemoved", "STORAGE"))
    for e in events.of("BlockRemoved", "GPU"):
        assert list(e) == REMOVED_KEYS

    # Sent again, it is loaded back from host memory: the GPU's index learns its pages again,
    # with the prompt's tokens and hashes, and nothing is stored in a tier twice.
    _complete(server, a)
    events.until(lambda: len(_stores_of(events, "GPU", a, after=evicted)) > 0
                 and set(a_hashes) <= {h for e in _stores_of(events, "GPU", a, after=evicted)
                                       for h in e["block_hashes"]})
    _chain(_stores_of(events, "GPU", a, after=evicted), a)
    assert sum(len(e["block_hashes"]) for e in _stores_of(events, "CPU", a)) == len(a_hashes)

    # More prompts push it out of host memory (and the oldest pages off the disk's 40).
    reloaded = len(events.seen)
    for prompt in others[2:]:
        _complete(server, prompt)
    events.until(lambda: set(a_hashes) <= events.hashes("BlockRemoved", "CPU") and events.of("BlockRemoved", "STORAGE"))
    assert events.index("BlockRemoved", "CPU", a_hashes) > reloaded
    for medium in ("CPU", "STORAGE"):
        for e in events.of("BlockRemoved", medium):
            assert list(e) == REMOVED_KEYS and e["group_idx"] == 0
        # A tier removes only what it reported stored, and each page once per stay.
        assert events.hashes("BlockRemoved", medium) <= events.hashes("BlockStored", medium)
        removed = [h for e in events.of("BlockRemoved", medium) for h in e["block_hashes"]]
        assert len(removed) == len(set(removed))

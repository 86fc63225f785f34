"""`--kv-events-config` on a real `pagoda serve`: a ZMQ subscriber as llm-d's KV-cache indexer
runs one gets vLLM's KVEventBatch messages, read with a msgpack reader written from the spec
(`msgpack_reader.py`) against vLLM's schema (`vllm/distributed/kv_events.py`): the batch an array
`[ts, events, data_parallel_rank]`, each event a map tagged by `type` with vLLM's fields in vLLM's
order; the hashes chain; the tokens are the prompt's; an evicted page is reported; a subscriber
that joins late gets the missed batches from the replay endpoint."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq
from conftest import free_port, launch
from msgpack_reader import unpack

from pagoda_engine.config import EngineConfig
from pagoda_engine.kv_events import parse_kv_events_config

BLOCK = 16
# vLLM's BlockStored fields in declaration order, as they go on the wire (`group_idx` and
# `kv_cache_spec_kind` set, `kv_cache_spec_sliding_window` left out at its default).
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx"]


@pytest.fixture(scope="module")
def ports():
    return free_port(), free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory, ports):
    pub, replay = ports
    config = (f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{pub}", '
              f'"replay_endpoint": "tcp://*:{replay}", "topic": "kv-events"}}')
    # 19 usable pages: a few prompts of 6+ pages each make it evict.
    srv = launch(tmp_path_factory.mktemp("serve"), "--model", "pagoda-tiny", "--num-kv-pages", "20",
                 "--max-model-len", "256", "--max-num-seqs", "4", "--kv-events-config", config)
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def subscriber(server, ports):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{ports[0]}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    time.sleep(0.5)  # the PUB side drops what it sends before the subscription arrives
    yield sub
    sub.close(linger=0)


def _receive(sub, until, timeout: float = 30.0) -> list[tuple[int, list]]:
    """(seq, batch) messages until `until(batches)` holds."""
    got, deadline = [], time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"no matching KV events in {timeout} s: {got}"
        if sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv-events" and len(seq) == 8
            got.append((int.from_bytes(seq, "big"), unpack(payload)))
    return got


def _events(batches) -> list[dict]:
    return [event for _, batch in batches for event in batch[1]]


def _prompt(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"model": "pagoda-tiny", "prompt": text}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _complete(server, text: str) -> None:
    r = httpx.post(f"{server.base_url}/completions", timeout=60,
                   json={"model": "pagoda-tiny", "prompt": text, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def _text(seed: int) -> str:
    return " ".join(f"tenant{seed} word{i}" for i in range(10))


def test_a_prompts_full_pages_arrive_as_one_chained_block_stored(server, subscriber):
    text = _text(0)
    tokens = _prompt(server, text)
    assert len(tokens) >= 4 * BLOCK
    _complete(server, text)
    batches = _receive(subscriber, lambda got: any(e["type"] == "BlockStored" for e in _events(got)))
    for _, batch in batches:
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, rank = batch
        assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
    stored = [e for e in _events(batches) if e["type"] == "BlockStored"]
    first = stored[0]
    assert list(first) == STORED_KEYS
    num_pages = (len(tokens) + 1) // BLOCK  # the prompt's full pages (the first generated token may fill one)
    assert len(tokens) // BLOCK <= len(first["block_hashes"]) <= num_pages
    assert first["parent_block_hash"] is None
    assert first["token_ids"][:len(tokens) // BLOCK * BLOCK] == tokens[:len(tokens) // BLOCK * BLOCK]
    assert len(first["token_ids"]) == BLOCK * len(first["block_hashes"])
    assert first["block_size"] == BLOCK and first["medium"] == "GPU" and first["group_idx"] == 0
    assert first["lora_id"] is None and first["lora_name"] is None
    assert first["extra_keys"] == [None] * len(first["block_hashes"])
    assert first["kv_cache_spec_kind"] == "full_attention"
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in first["block_hashes"])
    assert len(set(first["block_hashes"])) == len(first["block_hashes"])


def test_a_shared_prefix_is_stored_once_and_its_continuation_chains_to_it(server, subscriber):
    shared = _text(1)
    _complete(server, shared)
    [first] = [e for e in _events(_receive(subscriber, lambda got: any(
        e["type"] == "BlockStored" for e in _events(got)))) if e["type"] == "BlockStored"]
    _complete(server, shared + " and then a question of its own that runs on for a while longer")
    later = [e for e in _events(_receive(subscriber, lambda got: any(
        e["type"] == "BlockStored" for e in _events(got)))) if e["type"] == "BlockStored"]
    # The second prompt's own pages follow the shared ones: the first new page's parent is a
    # page the first event stored, and no hash is stored twice.
    assert later[0]["parent_block_hash"] in first["block_hashes"]
    assert not set(later[0]["block_hashes"]) & set(first["block_hashes"])


def test_evicted_pages_are_reported_removed(server, subscriber):
    stored, removed = set(), set()
    for seed in range(2, 8):  # about 6 pages each through a pool of 19
        _complete(server, _text(seed))
    batches = _receive(subscriber, lambda got: any(e["type"] == "BlockRemoved" for e in _events(got)))
    for event in _events(batches):
        if event["type"] == "BlockStored":
            stored.update(event["block_hashes"])
        elif event["type"] == "BlockRemoved":
            assert list(event) == REMOVED_KEYS and event["medium"] == "GPU"
            removed.update(event["block_hashes"])
    assert removed


def test_a_late_subscriber_replays_from_a_sequence_number(server, ports, subscriber):
    _complete(server, _text(9))
    live = _receive(subscriber, lambda got: any(e["type"] == "BlockStored" for e in _events(got)))
    seq, batch = live[-1]
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect(f"tcp://127.0.0.1:{ports[1]}")
    try:
        replay.send_multipart((b"", (seq - 1).to_bytes(8, "big")))
        frames = []
        while True:
            assert replay.poll(10_000), "no answer from the replay endpoint"
            empty, seq_bytes, payload = replay.recv_multipart()
            assert empty == b""
            if seq_bytes == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            frames.append((int.from_bytes(seq_bytes, "big"), unpack(payload)))
    finally:
        replay.close(linger=0)
    seqs = [s for s, _ in frames]
    assert seqs == list(range(seq - 1, seq - 1 + len(seqs))) and len(seqs) >= 2  # every buffered one from there
    assert dict(frames)[seq] == batch  # the batch the live stream carried


def test_the_config_is_checked_field_by_field():
    assert not parse_kv_events_config(None).enabled
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').publisher == "zmq"  # vLLM's default then
    for bad, says in (('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "unknown field(s) endpont"),
                      ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                      ('{"enable_kv_cache_events": true, "endpoint": "http://x:1"}', "endpoint"),
                      ('{"publisher": "zmq"}', "enable_kv_cache_events"),
                      ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
                      ("[1]", "JSON object"), ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            parse_kv_events_config(bad)
    # With offload tiers the tiers' pages are reported too (`test_kv_events_tiers.py`).
    assert EngineConfig.from_kwargs(kv_events_config='{"enable_kv_cache_events": true}',
                                    kv_offload_cpu_gb=1.0).kv_events_config.enabled
    with pytest.raises(ValueError, match="enable-prefix-caching"):
        EngineConfig.from_kwargs(kv_events_config='{"enable_kv_cache_events": true}', enable_prefix_caching=False)

"""The remote KV tier's reads against a real `redis-server` (the Debian package; the module skips
without it): `RedisStore.read_into` lands entries in the caller's rows over K connections (its
own RESP reader) with the same bytes as redis-py's MGET, turns absent, corrupt and foreign
entries into misses from that page on, survives Redis stopping and dying mid-read within its
timeout, comes back after its backoff, and authenticates (password, user, db, unix socket).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pagoda_engine import envs, kv_tiers
from pagoda_engine.kv_tiers import HEADER_BYTES, REMOTE, OffloadSetup
from pagoda_engine.worker import kv_stores
from pagoda_engine.worker.kv_offload import KVOffloader
from pagoda_engine.worker.kv_stores import RedisStore

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (make setup installs it as root)")

PASSWORD = "kv-read-secret"
FINGERPRINT = b"f" * 16
PAYLOAD = 48 << 10  # several reads of the socket per entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProc:
    """A redis-server on 127.0.0.1 and a unix socket, no persistence, `flags` besides."""

    def __init__(self, tmp: Path, *flags: str, port: int | None = None):
        self.port = port or _free_port()
        self.socket = tmp / f"redis-{self.port}.sock"
        self.socket.unlink(missing_ok=True)  # a killed server's; redis-server makes it once it listens
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--unixsocket", str(self.socket), "--dir", str(tmp), *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    redis = RedisProc(tmp_path_factory.mktemp("redis"), "--requirepass", PASSWORD)
    yield redis
    redis.stop()


@pytest.fixture
def store(server):
    """Reading over 4 connections (shares of at least 2 entries) unless a test says otherwise."""
    store = RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{server.port}", FINGERPRINT, read_connections=4)
    store.min_share_bytes = 2 * PAYLOAD
    return store


def _entries(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)], rng.integers(0, 256, (n, PAYLOAD), dtype=np.uint8)


def _written(store: RedisStore, n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    keys, data = _entries(n, seed)
    assert store.write([(k, memoryview(data[i])) for i, k in enumerate(keys)])
    return keys, data


def _read(store: RedisStore, keys: list[bytes]) -> tuple[int, object, np.ndarray]:
    rows = np.zeros((len(keys), PAYLOAD), dtype=np.uint8)
    intact, corrupt = store.read_into(keys, list(rows))
    return intact, corrupt, rows


@pytest.mark.parametrize("connections", [1, 3, 4, 8])
def test_resp_reader_returns_the_bytes_mget_returns(store, connections):
    keys, data = _written(store, 37, seed=connections)  # shares of unequal length
    store.read_connections, store.min_share_bytes = connections, 0
    intact, corrupt, rows = _read(store, keys)
    assert (intact, corrupt) == (len(keys), None)
    assert np.array_equal(rows, data)
    store.resp_reads = False  # redis-py's MGET, the reader of rediss://
    intact, corrupt, mget_rows = _read(store, keys)
    assert (intact, corrupt) == (len(keys), None) and np.array_equal(mget_rows, rows)
    assert store.errors == 0


def test_a_small_read_takes_one_connection_a_large_one_as_many_as_allowed(server):
    store = RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{server.port}", FINGERPRINT, read_connections=4)
    keys, _ = _written(store, 40, seed=9)  # 1.9 MiB: less than one share of the default 4 MiB
    assert _read(store, keys)[0] == 40 and len(store._idle) == 1
    store.min_share_bytes = 8 * PAYLOAD  # 5 shares' worth, 4 connections allowed
    assert _read(store, keys)[0] == 40 and len(store._idle) == 4


def test_an_absent_entry_is_a_miss_from_that_page_on_and_the_connections_stay_usable(store):
    keys, data = _written(store, 24, seed=10)
    store.client.delete(store.name(keys[9]))  # evicted since the lookup, in the middle of a share
    intact, corrupt, rows = _read(store, keys)
    assert (intact, corrupt) == (9, None)
    assert np.array_equal(rows[:9], data[:9])
    # Every reply was read to its end: the same connections read the entries after it intact.
    assert _read(store, keys[10:])[:2] == (14, None)
    assert store.errors == 0


def _truncated(blob: bytes) -> bytes:
    return blob[:HEADER_BYTES + PAYLOAD // 2]


def _flipped(blob: bytes) -> bytes:
    return blob[:-1] + bytes([blob[-1] ^ 1])


@pytest.mark.parametrize("damage, error", [
    (lambda blob: b"garbage" * 100, "not a Pagoda KV entry"),
    (lambda blob: b"garbage", "truncated header"),
    (_truncated, "truncated"),
    (lambda blob: blob + b"more", "truncated"),
    (_flipped, "checksum mismatch"),
])
def test_a_corrupt_entry_is_a_miss_from_that_page_on(store, damage, error):
    keys, data = _written(store, 12, seed=11)
    store.client.set(store.name(keys[5]), damage(store.client.get(store.name(keys[5]))))
    intact, corrupt, rows = _read(store, keys)
    assert intact == 5 and error in str(corrupt)
    assert np.array_equal(rows[:5], data[:5])
    assert _read(store, keys[6:])[:2] == (6, None)
    store.resp_reads = False
    intact, corrupt, _ = _read(store, keys)
    assert intact == 5 and error in str(corrupt)  # both readers judge an entry alike


def test_a_key_holding_no_string_is_a_corrupt_entry_not_a_store_failure(store):
    keys, data = _written(store, 8, seed=17)
    store.client.delete(store.name(keys[6]))
    store.client.rpush(store.name(keys[6]), b"not an entry")  # GET answers -WRONGTYPE
    intact, corrupt, rows = _read(store, keys)
    assert intact == 6 and "holds no string" in str(corrupt) and store.errors == 0
    assert np.array_equal(rows[:6], data[:6])
    assert _read(store, keys[7:])[:2] == (1, None)  # the connection read past the error reply


def test_an_entry_of_another_fingerprint_is_a_miss(server, store):
    keys, _ = _written(store, 6, seed=12)
    other = RedisStore(f"redis://:{PASSWORD}@127.0.0.1:{server.port}", b"o" * 16)
    _written(other, 1, seed=12)  # the same page key, another engine's KV bytes
    store.client.set(store.name(keys[0]), store.client.get(other.name(keys[0])))
    intact, corrupt, _ = _read(store, keys)
    assert intact == 0 and "fingerprint mismatch" in str(corrupt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])  # FP8 pages go through Redis as they are
def test_the_offloader_counts_a_corrupt_remote_entry_and_loads_the_pages_before_it(server, dtype):
    layers = [torch.randn(12, 2, 4, 2, 8).to(dtype) for _ in range(2)]
    url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}"
    offloader = KVOffloader(layers, OffloadSetup(FINGERPRINT, remote_url=url), FINGERPRINT)
    pages, keys = [1, 2, 3, 4, 5], [bytes([40 + i]) * 16 for i in range(5)]
    original = [torch.stack([layer[p] for layer in layers]).clone() for p in pages]
    offloader.store(1, pages, [-1] * 5, [None] * 5, keys, [])
    assert _poll(offloader, lambda e: e.written) == [(1, [], True)]
    offloader.remote.client.set(offloader.remote.name(keys[3]), b"garbage")
    offloader.load(2, [7, 8, 9, 10, 11], [(REMOTE, k) for k in keys])
    events = []
    loaded = _poll(offloader, lambda e: events.append(e) or e.loaded)
    assert [(load_id, ok) for load_id, ok, _ in loaded] == [(2, 3)] and loaded[0][2] > 0
    assert events[-1].bad == [(REMOTE, keys[3])] and events[-1].errors[REMOTE] == 1
    for i, page in enumerate([7, 8, 9]):
        assert torch.equal(torch.stack([layer[page] for layer in layers]).view(torch.uint8),
                           original[i].view(torch.uint8))
    offloader.close()


def _poll(offloader: KVOffloader, pick, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pick(offloader.poll())
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError("the offloader did not finish in time")


def test_redis_stopped_or_killed_mid_read_is_a_bounded_miss_then_reads_recover(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_KV_REMOTE_BACKOFF_S", "1")
    redis = RedisProc(tmp_path)
    try:
        store = RedisStore(f"redis://127.0.0.1:{redis.port}", FINGERPRINT, read_connections=4, timeout_s=0.5)
        store.min_share_bytes = 0
        keys, data = _written(store, 32, seed=13)
        assert _read(store, keys)[0] == 32  # the connections are open and idle now

        redis.proc.send_signal(signal.SIGSTOP)  # hung: no reply comes
        t0 = time.monotonic()
        assert _read(store, keys)[:2] == (0, None)
        assert time.monotonic() - t0 < 2.0 and store.errors == 1  # one failure, however many connections
        assert _read(store, keys)[:2] == (0, None) and store.errors == 1  # backing off: not even tried

        time.sleep(1.0)
        result = []
        reading = threading.Thread(target=lambda: result.append(_read(store, keys)))
        t0 = time.monotonic()
        reading.start()
        time.sleep(0.2)
        redis.stop()  # dies with the GETs in flight
        reading.join(5)
        assert not reading.is_alive() and time.monotonic() - t0 < 2.0
        assert result[0][:2] == (0, None) and store.errors == 2

        redis = RedisProc(tmp_path, port=redis.port)  # back, empty: the engine that computes them writes again
        time.sleep(1.0)
        keys, data = _written(store, 32, seed=14)
        intact, corrupt, rows = _read(store, keys)
        assert (intact, corrupt) == (32, None) and np.array_equal(rows, data)
        assert store.errors == 2

        redis.stop()  # restarted between two reads: the idle connections it closed are not used again
        redis = RedisProc(tmp_path, port=redis.port)
        keys, data = _written(store, 32, seed=15)
        intact, corrupt, rows = _read(store, keys)
        assert (intact, corrupt) == (32, None) and np.array_equal(rows, data)
        assert store.errors == 2
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        redis.stop()


@pytest.mark.parametrize("url, env", [
    ("redis://:{pw}@127.0.0.1:{port}/3", None),  # password in the URL, and a db to SELECT
    ("redis://default:{pw}@127.0.0.1:{port}", None),  # AUTH with a user name
    ("redis://127.0.0.1:{port}", "{pw}"),  # password from PAGODA_KV_REMOTE_PASSWORD
    ("unix://:{pw}@{socket}?db=2", None),
])
def test_reads_authenticate_and_select_the_urls_db(server, monkeypatch, url, env):
    if env:
        monkeypatch.setenv(envs.KV_REMOTE_PASSWORD_ENV, env.format(pw=PASSWORD))
    store = RedisStore(url.format(pw=PASSWORD, port=server.port, socket=server.socket), FINGERPRINT, read_connections=3)
    store.min_share_bytes = 0  # each connection authenticates
    assert store.resp_reads
    keys, data = _written(store, 9, seed=15)
    intact, corrupt, rows = _read(store, keys)
    assert (intact, corrupt) == (9, None) and np.array_equal(rows, data) and store.errors == 0


def test_a_wrong_password_is_a_counted_failure_not_an_exception(server):
    store = RedisStore(f"redis://:wrong@127.0.0.1:{server.port}", FINGERPRINT)
    keys, _ = _entries(4, seed=16)
    assert store.read_into(keys, list(np.zeros((4, PAYLOAD), dtype=np.uint8))) == (0, None)
    assert store.errors == 1


@pytest.mark.parametrize("value", ["0", "-2", "four", ""])
def test_a_bad_read_connection_count_is_refused_at_start(monkeypatch, value):
    from pagoda_engine import LLM
    from pagoda_engine.tiny import default_model_dir

    monkeypatch.setenv("PAGODA_KV_REMOTE_READ_CONNECTIONS", value)
    message = f"PAGODA_KV_REMOTE_READ_CONNECTIONS must be a whole number >= 1, got '{value}'"
    with pytest.raises(ValueError, match=message):
        RedisStore("redis://127.0.0.1:1", FINGERPRINT)
    with pytest.raises(ValueError, match=message):  # an engine with a remote tier does not start
        LLM(str(default_model_dir()), num_gpu_blocks_override=24, max_model_len=256,
            kv_offload_remote_url="redis://127.0.0.1:1")


# --- the remote tier over several servers (ShardedRedisStore) --------------------------------------


def test_shard_index_spreads_names_evenly_and_an_appended_server_takes_only_its_share():
    names = [b"pagoda:kv:%d" % i for i in range(6000)]
    three = [kv_stores.shard_index(n, 3) for n in names]
    assert all(1700 < three.count(s) < 2300 for s in range(3))
    four = [kv_stores.shard_index(n, 4) for n in names]
    moved = [(a, b) for a, b in zip(three, four) if a != b]
    assert all(b == 3 for _, b in moved)  # a key moves only to the new server
    assert 1200 < len(moved) < 1800  # about a quarter of them
    assert {kv_stores.shard_index(n, 1) for n in names} == {0}


def test_remote_urls_are_split_and_checked():
    assert kv_tiers.split_remote_urls("redis://a:1, rediss://b:2/3 ,unix:///run/r.sock") == [
        "redis://a:1", "rediss://b:2/3", "unix:///run/r.sock"]
    for bad, message in (("http://a:1", "is not redis://"), ("redis://a:1,,redis://b:1", "'' is not redis://"),
                         ("redis://", "is not redis://"), ("redis://a:1,redis://a:1", "names a server twice")):
        with pytest.raises(ValueError, match=message):
            kv_tiers.split_remote_urls(bad)
    assert isinstance(kv_stores.remote_store("redis://a:1", FINGERPRINT), RedisStore)
    assert kv_tiers.redacted_url("redis://:pw@a:1/2,rediss://user:pw@b:2,unix:///r.sock,unix://:pw@/s?db=2") == (
        "redis://a:1/2,rediss://b:2,unix:///r.sock,unix:///s?db=2")
    assert kv_stores.remote_store("redis://u:secret@a:1,redis://b:2", FINGERPRINT).label == "redis://a:1,redis://b:2"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("redis-shards")
    servers = [RedisProc(tmp, "--requirepass", PASSWORD) for _ in range(3)]
    yield servers
    for server in servers:
        server.stop()


def _sharded(servers: list[RedisProc], **options) -> kv_stores.ShardedRedisStore:
    urls = ",".join(f"redis://:{PASSWORD}@127.0.0.1:{s.port}" for s in servers)
    store = kv_stores.remote_store(urls, FINGERPRINT, read_connections=2, **options)
    assert isinstance(store, kv_stores.ShardedRedisStore)
    for shard in store.shards:
        shard.min_share_bytes = 2 * PAYLOAD
    return store


def test_a_sharded_store_puts_each_entry_on_its_server_and_reads_them_all_back(shards):
    store = _sharded(shards)
    keys, data = _written(store, 45, seed=20)
    held = [sum(shard.client.exists(shard.name(k)) for k in keys) for shard in store.shards]
    want = [sum(kv_stores.shard_index(store.shards[0].name(k), 3) == s for k in keys) for s in range(3)]
    assert held == want and sum(held) == 45 and min(held) > 0  # each entry once, on its server
    assert store.exists(keys + [b"\0" * 16]) == [True] * 45 + [False]
    intact, corrupt, rows = _read(store, keys)
    assert (intact, corrupt) == (45, None) and np.array_equal(rows, data)
    capacity, used = store.memory()
    assert capacity == 0 and used >= 45 * PAYLOAD  # no maxmemory on these servers: no cap
    assert store.errors == 0


def test_a_sharded_read_stops_at_the_first_entry_not_intact_on_any_server(shards):
    store = _sharded(shards)
    keys, data = _written(store, 30, seed=21)
    owner = store.shards[kv_stores.shard_index(store.shards[0].name(keys[17]), 3)]
    owner.client.set(owner.name(keys[17]), b"garbage" * 100)
    gone = store.shards[kv_stores.shard_index(store.shards[0].name(keys[23]), 3)]
    gone.client.delete(gone.name(keys[23]))
    intact, corrupt, rows = _read(store, keys)
    assert intact == 17 and "not a Pagoda KV entry" in str(corrupt)
    assert np.array_equal(rows[:17], data[:17])
    assert _read(store, keys[18:])[:2] == (5, None)  # then the absent one, a plain miss


def test_a_dead_server_costs_only_its_own_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_KV_REMOTE_BACKOFF_S", "60")
    servers = [RedisProc(tmp_path, "--requirepass", PASSWORD) for _ in range(2)]
    try:
        store = _sharded(servers, timeout_s=0.5)
        keys, data = _written(store, 24, seed=22)
        where = [kv_stores.shard_index(store.shards[0].name(k), 2) for k in keys]
        first_dead = where.index(0)
        servers[0].stop()
        t0 = time.monotonic()
        assert store.exists(keys) == [s == 1 for s in where]
        intact, corrupt, rows = _read(store, keys)
        assert (intact, corrupt) == (first_dead, None) and np.array_equal(rows[:intact], data[:intact])
        assert time.monotonic() - t0 < 2.0
        assert store.errors == 1 and store.available  # one server backs off, the other serves
        alive = [k for k, s in zip(keys, where) if s == 1]
        intact, _, rows = _read(store, alive)
        assert intact == len(alive) and np.array_equal(rows, data[[s == 1 for s in where]])
        for key in (b"\1" * 16, b"\2" * 16, b"\3" * 16):  # a write succeeds when its server is the live one
            assert store.write([(key, memoryview(data[0]))]) == (kv_stores.shard_index(store.shards[0].name(key), 2) == 1)
        assert store.memory() is not None  # the live server's figures
    finally:
        for server in servers:
            server.stop()

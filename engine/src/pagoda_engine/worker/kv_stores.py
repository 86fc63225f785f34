"""Where offloaded KV pages live below host memory: local files (`DiskStore`) and Redis
(`RedisStore`, or `ShardedRedisStore` over several servers: `remote_store` picks), and the one
entry format both use (`encode_header` / `decode_entry`; the header's layout is
`kv_tiers.ENTRY_HEADER`, shared with the core, which sizes the disk tier by it).

An entry is a header (magic, the fingerprint of what makes KV bytes compatible, the page's key,
the payload's length and CRC-32) followed by the page's bytes, so that a truncated or corrupted
entry, or one written by an engine whose KV bytes differ (another model, dtype, page size, KV
layout or parallel rank), reads as a miss (`CorruptEntry`) and never as wrong tokens.

Every call is bounded and never raises into the step: Redis calls time out
(PAGODA_KV_REMOTE_TIMEOUT_S, default 1 s); after a failure the remote store is skipped for
PAGODA_KV_REMOTE_BACKOFF_S (default 5 s), with one warning per backoff.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from pagoda_engine import envs
from pagoda_engine.kv_tiers import ENTRY_HEADER, ENTRY_MAGIC, HEADER_BYTES, redacted_url, split_remote_urls

logger = logging.getLogger(__name__)

# Connections (and threads) one remote read spreads its keys over, each given at least
# MIN_SHARE_BYTES of it (below that a thread and a connection cost more than they save).
MIN_SHARE_BYTES = 4 << 20
# Every Redis key of the remote tier: NAMESPACE + <fingerprint hex> + b":" + <page key hex>.
REDIS_KEY_NAMESPACE = b"pagoda:kv:"


def shard_index(name: bytes, shards: int) -> int:
    """Which of `shards` servers holds the Redis key `name`: jump consistent hashing (Lamping and
    Veach, 2014) of the key's 64-bit BLAKE2b digest. Every engine and rank agrees without talking,
    and a server appended to the list takes 1/n of the keys from the others and moves no others."""
    key = int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")
    b, j = -1, 0
    while j < shards:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


class CorruptEntry(Exception):
    """An entry that is truncated, fails its checksum, or belongs to another fingerprint or key."""


def encode_header(fingerprint: bytes, key: bytes, payload: memoryview) -> bytes:
    return ENTRY_HEADER.pack(ENTRY_MAGIC, fingerprint, key, payload.nbytes, zlib.crc32(payload))


def decode_entry(blob: bytes | memoryview, fingerprint: bytes, key: bytes, payload_bytes: int) -> memoryview:
    """The payload of a stored entry, checked against what the reader expects; CorruptEntry otherwise."""
    view = memoryview(blob)
    payload = view[HEADER_BYTES:]
    check_entry(view[:HEADER_BYTES], payload, payload.nbytes, fingerprint, key, payload_bytes)
    return payload


def check_entry(header: memoryview, payload: memoryview, stored_bytes: int, fingerprint: bytes, key: bytes,
                payload_bytes: int) -> None:
    """CorruptEntry unless `header` and `payload` (the `stored_bytes` that followed the header, of
    which `payload` holds all when they are `payload_bytes`) are the entry the reader expects."""
    if header.nbytes < HEADER_BYTES:
        raise CorruptEntry(f"truncated header ({header.nbytes} bytes)")
    magic, fp, k, length, crc = ENTRY_HEADER.unpack_from(header)
    if magic != ENTRY_MAGIC:
        raise CorruptEntry("not a Pagoda KV entry")
    if fp != fingerprint:
        raise CorruptEntry("written by an engine with other KV bytes (fingerprint mismatch)")
    if k != key:
        raise CorruptEntry("holds another page's key")
    if length != payload_bytes or stored_bytes != length:
        raise CorruptEntry(f"truncated: {stored_bytes} of {payload_bytes} payload bytes")
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum mismatch")


class RateLimitedLog:
    """One warning per `every_s` for each kind of failure, so a dead store cannot flood the log."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -1e9) < self.every_s:
                return
            self._last[kind] = now
        logger.warning(message, *args)


class DiskStore:
    """One file per page under `root/<fingerprint hex>/`: `<key hex>.kv`, written to a temporary
    name and renamed, so a crash leaves no half-written entry under a real name."""

    def __init__(self, root: str, fingerprint: bytes):
        self.dir = Path(root) / fingerprint.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint

    def path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def write(self, key: bytes, payload: memoryview) -> None:
        """OSError (disk full, ...) leaves nothing behind."""
        path = self.path(key)
        tmp = path.with_suffix(f".tmp{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(encode_header(self.fingerprint, key, payload))
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, key: bytes, payload_bytes: int) -> memoryview:
        """CorruptEntry for a bad entry (the file is removed); OSError when it cannot be read."""
        path = self.path(key)
        with open(path, "rb") as f:
            blob = f.read(HEADER_BYTES + payload_bytes + 1)
        try:
            return decode_entry(blob, self.fingerprint, key, payload_bytes)
        except CorruptEntry:
            path.unlink(missing_ok=True)
            raise

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)

    def scan(self, payload_bytes: int) -> list[tuple[bytes, float]]:
        """The entries a previous run left, (key, mtime), oldest first. Each header is checked
        (magic, fingerprint, key, length against the file's size); bad files and leftover
        temporaries are removed. The payload's checksum is checked when it is loaded."""
        found = []
        for path in self.dir.iterdir():
            if path.suffix != ".kv":
                path.unlink(missing_ok=True)  # a temporary from a run that died mid-write
                continue
            try:
                key = bytes.fromhex(path.stem)
                st = path.stat()
                with open(path, "rb") as f:
                    magic, fp, k, length, _ = ENTRY_HEADER.unpack(f.read(HEADER_BYTES))
                ok = (magic == ENTRY_MAGIC and fp == self.fingerprint and k == key and length == payload_bytes
                      and st.st_size == HEADER_BYTES + payload_bytes)
            except (ValueError, OSError, struct.error):
                ok = False
            if not ok:
                logger.warning("kv offload: removing unusable disk entry %s", path.name)
                path.unlink(missing_ok=True)
                continue
            found.append((key, st.st_mtime))
        found.sort(key=lambda e: e[1])
        return found


class RedisStore:
    """Pages in Redis under `pagoda:kv:<fingerprint hex>:<key hex>`, shared by every replica.
    Thread-safe. Failures count in `errors`; while backing off after one, calls return at once as
    misses or skipped writes.

    Lookups, writes and INFO go through redis-py. Reads (`read_into`) land each entry's payload
    straight in the caller's host row: over redis:// and unix://, up to `read_connections` (default
    PAGODA_KV_REMOTE_READ_CONNECTIONS, 4; one per `min_share_bytes` read) persistent connections
    of the store's own, each in a thread of its own, pipeline a GET for each key of their share and receive each payload into its
    row with no bytes object in between (`_RespConnection`), then check the entry in place (zlib's
    CRC-32 lets go of the GIL, so the shares are checked in parallel). Over rediss:// (TLS) reads
    go through redis-py's MGET, each reply then checked and copied into its row, as they do with
    `resp_reads = False` (the benchmark's baseline)."""

    def __init__(self, url: str, fingerprint: bytes, password: str | None = None, read_connections: int | None = None,
                 timeout_s: float | None = None):
        import redis
        from redis.connection import parse_url

        self.url = url
        self.label = redacted_url(url)
        self.fingerprint = fingerprint
        self.prefix = REDIS_KEY_NAMESPACE + fingerprint.hex().encode() + b":"
        password = password or envs.kv_remote_password()
        self.timeout_s = timeout_s or envs.kv_remote_timeout_s()
        self.backoff_s = envs.kv_remote_backoff_s()
        self.client = redis.Redis.from_url(url, password=password,
                                           socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s)
        options = parse_url(url)  # what redis-py connects with: the URL's credentials win over `password`
        self.resp_reads = urlsplit(url).scheme in ("redis", "unix")
        self._address = options["path"] if "path" in options else (options.get("host") or "localhost",
                                                                    options.get("port") or 6379)
        self._username, self._password = options.get("username"), options.get("password") or password
        self._db = int(options.get("db") or 0)
        self.read_connections = read_connections if read_connections is not None else envs.kv_remote_read_connections()
        self.min_share_bytes = MIN_SHARE_BYTES
        self._idle: list[_RespConnection] = []
        self.errors = 0
        self._down_until = 0.0
        self._log = RateLimitedLog(self.backoff_s)
        self._lock = threading.Lock()

    def name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + self.backoff_s
        self._log.warning("remote", "kv offload: remote tier %s at %s failed (%s: %s); skipping it for %.0fs, "
                          "serving goes on", what, self.label, type(error).__name__, error, self.backoff_s)

    def exists(self, keys: list[bytes]) -> list[bool]:
        """Which of `keys` the store holds (all False while it is down)."""
        if not keys or not self.available:
            return [False] * len(keys)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.name(key))
            return [bool(n) for n in pipe.execute()]
        except Exception as e:  # redis errors, timeouts, refused connections
            self._failed("lookup", e)
            return [False] * len(keys)

    def write(self, entries: list[tuple[bytes, memoryview]]) -> bool:
        if not entries or not self.available:
            return not entries
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, payload in entries:
                pipe.set(self.name(key), encode_header(self.fingerprint, key, payload) + payload)
            pipe.execute()
            return True
        except Exception as e:
            self._failed("write", e)
            return False

    def read_into(self, keys: list[bytes], rows: list) -> tuple[int, CorruptEntry | None]:
        """Read the entry of `keys[i]` into `rows[i]` (a writable buffer of one payload's bytes).
        Returns how many leading entries arrived intact, and why the next did not when it was
        corrupt; None when it was absent or the store failed (counted in `errors`; the pages read
        intact before the failure still count). Never raises."""
        if not keys or not self.available:
            return 0, None
        rows = [memoryview(row).cast("B") for row in rows]
        return self._read_resp(keys, rows) if self.resp_reads else self._read_mget(keys, rows)

    def _read_mget(self, keys: list[bytes], rows: list[memoryview]) -> tuple[int, CorruptEntry | None]:
        try:
            blobs = self.client.mget([self.name(k) for k in keys])
        except Exception as e:
            self._failed("read", e)
            return 0, None
        for i, (key, blob, row) in enumerate(zip(keys, blobs, rows)):
            if blob is None:
                return i, None
            try:
                row[:] = decode_entry(blob, self.fingerprint, key, row.nbytes)
            except CorruptEntry as e:
                return i, e
        return len(keys), None

    def _read_resp(self, keys: list[bytes], rows: list[memoryview]) -> tuple[int, CorruptEntry | None]:
        """The keys in contiguous shares, one per connection; the calling thread reads the last."""
        total = sum(row.nbytes for row in rows)
        n = max(1, min(self.read_connections, len(keys), total // max(1, self.min_share_bytes)))
        bounds = [(len(keys) * s // n, len(keys) * (s + 1) // n) for s in range(n)]
        conns: list[_RespConnection] = []
        try:
            while len(conns) < n:
                conns.append(self._connection())
        except Exception as e:  # refused, timed out, AUTH or SELECT refused
            for conn in conns:
                conn.close()
            self._failed("read", e)
            return 0, None
        results: list = [None] * n

        def share(s: int) -> None:
            results[s] = self._read_share(conns[s], keys, rows, *bounds[s])

        threads = [threading.Thread(target=share, args=(s,), name=f"kv-remote-read-{s}") for s in range(n - 1)]
        for t in threads:
            t.start()
        share(n - 1)
        for t in threads:
            t.join()
        failure = next((error for _, _, error in results if error is not None), None)
        if failure is not None:
            self._failed("read", failure)
        # The first share that stopped short decides: the shares before it read whole.
        return next(((stop, corrupt) for (stop, corrupt, _), (_, end) in zip(results, bounds) if stop < end),
                    (len(keys), None))

    def _read_share(self, conn: _RespConnection, keys: list[bytes], rows: list[memoryview], start: int,
                    end: int) -> tuple[int, CorruptEntry | None, Exception | None]:
        """(first entry of keys[start:end] not intact, or end; why, when corrupt; the failure that
        ended the share early). Every reply is read to its end, so the connection stays usable;
        after a failure it is closed."""
        stop, corrupt, i = end, None, start
        header = memoryview(bytearray(HEADER_BYTES))
        try:
            conn.send([(b"GET", self.name(keys[j])) for j in range(start, end)])
            for i in range(start, end):
                try:
                    stored, miss = conn.bulk_length(), None  # None: absent, evicted since the lookup
                except RespError as e:
                    if not str(e).startswith("WRONGTYPE"):
                        raise  # Redis itself is failing (loading, out of memory, ...)
                    stored, miss = None, CorruptEntry(f"the key holds no string ({e})")  # MGET reads it as nil
                if stored is None:
                    if i < stop:
                        stop, corrupt = i, miss
                    continue
                got = min(stored, HEADER_BYTES)
                conn.read_into(header[:got])
                row = rows[i]
                if stored == HEADER_BYTES + row.nbytes:
                    conn.read_into(row)
                else:
                    conn.skip(stored - got)
                conn.skip(2)  # the reply's CRLF
                if i < stop:
                    try:
                        check_entry(header[:got], row, stored - got, self.fingerprint, keys[i], row.nbytes)
                    except CorruptEntry as e:
                        stop, corrupt = i, e
            self._release(conn)
            return stop, corrupt, None
        except Exception as e:  # OSError (reset, timed out), RespError, a malformed reply
            conn.close()
            return min(stop, i), None, e

    def _connection(self) -> _RespConnection:
        """An idle connection that Redis has not closed meanwhile, else a new one."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return _RespConnection(self._address, self._username, self._password, self._db, self.timeout_s)
            if conn.alive():
                return conn
            conn.close()

    def _release(self, conn: _RespConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def memory(self) -> tuple[int, int] | None:
        """(maxmemory, used_memory) in bytes, from INFO; None when unavailable."""
        if not self.available:
            return None
        try:
            info = self.client.info("memory")
            return int(info.get("maxmemory", 0)), int(info.get("used_memory", 0))
        except Exception as e:
            self._failed("info", e)
            return None


def remote_store(url: str, fingerprint: bytes, **options) -> RedisStore | ShardedRedisStore:
    """The remote tier of `--kv-offload-remote-url`: a `RedisStore`, or a `ShardedRedisStore` when
    the value names several servers. `options` go to each server's `RedisStore`."""
    urls = split_remote_urls(url)
    if len(urls) == 1:
        return RedisStore(urls[0], fingerprint, **options)
    return ShardedRedisStore(urls, fingerprint, **options)


class ShardedRedisStore:
    """The remote tier spread over several Redis servers, each key on the one `shard_index` picks,
    so that a read draws on all their threads and links at once (one Redis serves a read from one
    thread: about 1 GB/s on the machines measured). The servers are independent (no Redis Cluster):
    every engine and rank must list the same URLs in the same order.

    The `RedisStore` interface: each call goes to the servers that hold its keys, in parallel (one
    pool thread per server), each server's part as `RedisStore` does it. Each server fails and backs
    off alone: while one is down, its keys are misses and its writes are skipped; the others serve."""

    def __init__(self, urls: list[str], fingerprint: bytes, **options):
        self.shards = [RedisStore(url, fingerprint, **options) for url in urls]
        self.url = ",".join(urls)
        self.label = ",".join(shard.label for shard in self.shards)
        self.fingerprint = fingerprint
        self._pool = ThreadPoolExecutor(len(urls), thread_name_prefix="kv-remote-shard")

    @property
    def errors(self) -> int:
        return sum(shard.errors for shard in self.shards)

    @property
    def available(self) -> bool:
        return any(shard.available for shard in self.shards)

    def _spread(self, keys: list[bytes]) -> dict[int, list[int]]:
        """The positions of `keys` each server holds, in order."""
        name = self.shards[0].name
        out: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            out.setdefault(shard_index(name(key), len(self.shards)), []).append(i)
        return out

    def _each(self, parts: dict[int, list[int]], call) -> dict[int, object]:
        """`call(shard, positions)` for every part, the last in this thread; their results by shard."""
        items = list(parts.items())
        futures = [(s, self._pool.submit(call, self.shards[s], where)) for s, where in items[:-1]]
        results = {s: call(self.shards[s], where) for s, where in items[-1:]}
        results.update((s, future.result()) for s, future in futures)
        return results

    def exists(self, keys: list[bytes]) -> list[bool]:
        found = [False] * len(keys)
        parts = self._spread(keys)
        for s, hits in self._each(parts, lambda shard, where: shard.exists([keys[i] for i in where])).items():
            for i, hit in zip(parts[s], hits):
                found[i] = hit
        return found

    def write(self, entries: list[tuple[bytes, memoryview]]) -> bool:
        parts = self._spread([key for key, _ in entries])
        return all(self._each(parts, lambda shard, where: shard.write([entries[i] for i in where])).values())

    def read_into(self, keys: list[bytes], rows: list) -> tuple[int, CorruptEntry | None]:
        """As `RedisStore.read_into`: the first of `keys` not intact on its server decides."""
        parts = self._spread(keys)
        results = self._each(parts, lambda shard, where: shard.read_into([keys[i] for i in where],
                                                                          [rows[i] for i in where]))
        stop, why = len(keys), None
        for s, (intact, corrupt) in results.items():
            if intact < len(parts[s]) and parts[s][intact] < stop:
                stop, why = parts[s][intact], corrupt
        return stop, why

    def memory(self) -> tuple[int, int] | None:
        """(maxmemory, used_memory) summed over the servers that answer; None when none does."""
        known = [m for m in (shard.memory() for shard in self.shards) if m is not None]
        if not known:
            return None
        unbounded = any(cap == 0 for cap, _ in known)  # maxmemory 0: no cap on that server
        return (0 if unbounded else sum(cap for cap, _ in known)), sum(used for _, used in known)


class RespError(Exception):
    """Redis answered with an error reply, or with something a GET cannot answer."""


class _RespConnection:
    """One connection to Redis spoken in RESP here: commands out, and replies read so that a bulk
    string's bytes go straight into the caller's buffer. Every socket call is bounded by `timeout`."""

    _BUFFER = 16 << 10  # reply lines and the first bytes after them; a payload bypasses it
    _MAX_LINE = 4096

    def __init__(self, address: str | tuple[str, int], username: str | None, password: str | None, db: int,
                 timeout: float):
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect(address)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.buf = bytearray(self._BUFFER)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # the unread bytes: buf[start:end]
        try:
            setup = []
            if password:
                setup.append((b"AUTH", *([username] if username else []), password))
            if db:
                setup.append((b"SELECT", str(db)))
            if setup:
                self.send(setup)
                for _ in setup:
                    self.ok()
        except Exception:
            self.close()
            raise

    def send(self, commands: list[tuple]) -> None:
        out = []
        for command in commands:
            out.append(b"*%d\r\n" % len(command))
            for arg in command:
                arg = arg.encode() if isinstance(arg, str) else arg
                out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
        self.sock.sendall(b"".join(out))

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            self.buf[:self.end - self.start] = self.buf[self.start:self.end]
            self.start, self.end = 0, self.end - self.start
        got = self.sock.recv_into(self.view[self.end:])
        if not got:
            raise ConnectionError("Redis closed the connection")
        self.end += got

    def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n", self.start, self.end)) < 0:
            if self.end - self.start > self._MAX_LINE:
                raise RespError("reply line too long")
            self._fill()
        line = bytes(self.view[self.start:i])
        self.start = i + 2
        return line

    def _reply_line(self, kinds: bytes) -> bytes:
        line = self._line()
        if line[:1] == b"-":
            raise RespError(line[1:].decode(errors="replace"))
        if line[:1] not in kinds:
            raise RespError(f"unexpected reply {line[:40]!r}")
        return line[1:]

    def ok(self) -> None:
        self._reply_line(b"+")

    def bulk_length(self) -> int | None:
        """The length of the bulk string reply whose bytes come next; None for a nil reply."""
        length = int(self._reply_line(b"$"))
        return None if length < 0 else length

    def read_into(self, dest: memoryview) -> None:
        done = min(dest.nbytes, self.end - self.start)
        dest[:done] = self.view[self.start:self.start + done]
        self.start += done
        while done < dest.nbytes:
            got = self.sock.recv_into(dest[done:])
            if not got:
                raise ConnectionError("Redis closed the connection")
            done += got

    def skip(self, n: int) -> None:
        while True:
            take = min(n, self.end - self.start)
            self.start += take
            n -= take
            if not n:
                return
            self._fill()

    def alive(self) -> bool:
        """Whether the peer has not closed it (nothing may be pending on an idle connection)."""
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0.0)  # a timeout would make recv wait for a byte first
        try:
            self.sock.recv(1, socket.MSG_PEEK)  # b"": closed; a byte: a reply nobody asked for
            return False
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            self.sock.settimeout(timeout)

    def close(self) -> None:
        self.sock.close()

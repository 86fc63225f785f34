"""Where offloaded KV pages live below host memory: local files (`DiskStore`) and Redis
(`RedisStore`), and the one entry format both use (`encode_entry` / `decode_entry`).

An entry is a header (magic, the fingerprint of what makes KV bytes compatible, the page's key,
the payload's length and CRC-32) followed by the page's bytes, so that a truncated or corrupted
entry, or one written by an engine whose KV bytes differ (another model, dtype, page size, KV
layout or parallel rank), reads as a miss (`CorruptEntry`) and never as wrong tokens.

Every call is bounded and never raises into the step: Redis calls time out
(PAGODA_KV_REMOTE_TIMEOUT_S, default 1 s); after a failure the remote store is skipped for
PAGODA_KV_REMOTE_BACKOFF_S (default 5 s), with one warning per backoff.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from pathlib import Path

logger = logging.getLogger(__name__)

_MAGIC = b"PGKV1\n"
_HEADER = struct.Struct("<6s16s16sQI")  # magic, fingerprint, key, payload length, crc32
HEADER_BYTES = _HEADER.size
REMOTE_TIMEOUT_S = float(os.environ.get("PAGODA_KV_REMOTE_TIMEOUT_S", "1.0"))
REMOTE_BACKOFF_S = float(os.environ.get("PAGODA_KV_REMOTE_BACKOFF_S", "5.0"))
# The Redis password (the operator renders it from the Secret the spec names).
REMOTE_PASSWORD_ENV = "PAGODA_KV_REMOTE_PASSWORD"
# Every Redis key of the remote tier: NAMESPACE + <fingerprint hex> + b":" + <page key hex>.
REDIS_KEY_NAMESPACE = b"pagoda:kv:"


class CorruptEntry(Exception):
    """An entry that is truncated, fails its checksum, or belongs to another fingerprint or key."""


def encode_header(fingerprint: bytes, key: bytes, payload: memoryview) -> bytes:
    return _HEADER.pack(_MAGIC, fingerprint, key, payload.nbytes, zlib.crc32(payload))


def decode_entry(blob: bytes | memoryview, fingerprint: bytes, key: bytes, payload_bytes: int) -> memoryview:
    """The payload of a stored entry, checked against what the reader expects; CorruptEntry otherwise."""
    view = memoryview(blob)
    if view.nbytes < HEADER_BYTES:
        raise CorruptEntry(f"truncated header ({view.nbytes} bytes)")
    magic, fp, k, length, crc = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise CorruptEntry("not a Pagoda KV entry")
    if fp != fingerprint:
        raise CorruptEntry("written by an engine with other KV bytes (fingerprint mismatch)")
    if k != key:
        raise CorruptEntry("holds another page's key")
    payload = view[HEADER_BYTES:]
    if length != payload_bytes or payload.nbytes != length:
        raise CorruptEntry(f"truncated: {payload.nbytes} of {payload_bytes} payload bytes")
    if zlib.crc32(payload) != crc:
        raise CorruptEntry("checksum mismatch")
    return payload


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
                    magic, fp, k, length, _ = _HEADER.unpack(f.read(HEADER_BYTES))
                ok = (magic == _MAGIC and fp == self.fingerprint and k == key and length == payload_bytes
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
    Thread-safe (redis-py's connection pool). Failures count in `errors`; while backing off
    after one, calls return at once as misses or skipped writes."""

    def __init__(self, url: str, fingerprint: bytes, password: str | None = None):
        import redis

        self.url = url
        self.fingerprint = fingerprint
        self.prefix = REDIS_KEY_NAMESPACE + fingerprint.hex().encode() + b":"
        self.client = redis.Redis.from_url(url, password=password or os.environ.get(REMOTE_PASSWORD_ENV) or None,
                                           socket_timeout=REMOTE_TIMEOUT_S, socket_connect_timeout=REMOTE_TIMEOUT_S)
        self.errors = 0
        self._down_until = 0.0
        self._log = RateLimitedLog(REMOTE_BACKOFF_S)
        self._lock = threading.Lock()

    def name(self, key: bytes) -> bytes:
        return self.prefix + key.hex().encode()

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + REMOTE_BACKOFF_S
        self._log.warning("remote", "kv offload: remote tier %s failed (%s: %s); skipping it for %.0fs, serving goes on",
                          what, type(error).__name__, error, REMOTE_BACKOFF_S)

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

    def read(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's stored blob, None where absent, all None when the store fails."""
        if not keys or not self.available:
            return [None] * len(keys)
        try:
            return self.client.mget([self.name(k) for k in keys])
        except Exception as e:
            self._failed("read", e)
            return [None] * len(keys)

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

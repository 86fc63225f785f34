"""The client keys `pagoda route --api-key-file PATH` accepts, and their rotation.

PATH is a file of keys, one per line, or a directory (a mounted Secret) whose every regular,
non-hidden file holds keys, one per line; blank lines and the whitespace around a key are
ignored. The set is re-read when PATH changes, checked at most once per `check_interval_s`
seconds on the request path: kubelet swaps a mounted Secret's files atomically, so a rotated
key works, and a removed one stops working, within about a second, without a restart.

Only SHA-256 digests of the keys are kept, so looking a presented key up takes the same time
whatever its bytes are.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

from pagoda_engine.api.server.api_keys import bearer_token
from pagoda_engine.router.reread import Reread

log = logging.getLogger("pagoda.router")


class ClientKeyError(ValueError):
    """--api-key-file cannot be used: the router refuses to start (exit 2)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _key_files(path: Path) -> list[Path]:
    """The files of keys under `path`: the file itself, or a directory's regular, non-hidden
    files (a mounted Secret's keys are symlinks into its hidden `..data` directory; the links
    are followed, the hidden entries skipped)."""
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())


def _signature(path: Path) -> tuple:
    """What changes when any file of keys under `path` is written, replaced, added or removed."""
    out = []
    for file in _key_files(path):
        st = file.stat()
        out.append((file.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def read_keys(path: Path) -> frozenset[bytes]:
    """The digests of the keys under `path`."""
    keys = set()
    for file in _key_files(path):
        for line in file.read_text(encoding="utf-8").splitlines():
            if line.strip():
                keys.add(_digest(line.strip()))
    return frozenset(keys)


class ClientKeys:
    """The keys under one --api-key-file path, kept current as it changes."""

    def __init__(self, path: str, check_interval_s: float = 1.0, clock=time.monotonic):
        self.path = Path(path)
        try:
            self._keys = Reread(f"--api-key-file {path}", lambda: _signature(self.path), lambda: read_keys(self.path),
                                check_interval_s, clock, on_change=self._changed)
        except (OSError, UnicodeDecodeError) as e:
            raise ClientKeyError(f"--api-key-file {path}: cannot read it ({e})") from None
        if not self._keys.value:
            where = "no file in the directory holds a key" if self.path.is_dir() else "the file holds no key"
            raise ClientKeyError(f"--api-key-file {path}: {where} (one key per line)")

    def _changed(self, old: frozenset[bytes], new: frozenset[bytes]) -> None:
        if new != old:
            log.info("--api-key-file %s changed: %d key(s) now accepted", self.path, len(new))
            if not new:
                log.warning("--api-key-file %s holds no key: every request to the API is refused", self.path)

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries one of the keys as a Bearer token."""
        token = bearer_token(authorization)
        return token is not None and _digest(token) in self._keys.current()

    def __len__(self) -> int:
        return len(self._keys.value)

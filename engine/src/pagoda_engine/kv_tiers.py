"""The KV offload tiers' shared vocabulary, read by the engine core (`core.kv.offload.manager`),
the worker ranks (`worker.kv_offload`, `worker.kv_stores`), `EngineConfig.validate` and the
operator: the tier names, what the core tells every rank at start-up (`OffloadSetup`) and what a
rank answers and reports (`OffloadStarted`, `OffloadEvents`), the stored entry's header, and
the rules for the remote tier's Redis URLs (`remote_url_problems`, `split_remote_urls`).

A base module: standard library only, and nothing of the engine's layers, so that every side
(and the operator's image, which has no torch) can import it.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from urllib.parse import urlsplit

CPU, DISK, REMOTE = "cpu", "disk", "remote"
TIERS = (CPU, DISK, REMOTE)

# A stored entry (disk file or Redis value): this header, then the page's bytes.
ENTRY_MAGIC = b"PGKV1\n"
ENTRY_HEADER = struct.Struct("<6s16s16sQI")  # magic, fingerprint, key, payload length, crc32
HEADER_BYTES = ENTRY_HEADER.size

REMOTE_URL_SCHEMES = ("redis", "rediss", "unix")
REMOTE_URL_FORMS = "redis://host[:port][/db], rediss://... or unix:///path"


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
    # (load id, leading pages that arrived intact, seconds it took on this rank: its reads, and its
    # copies at the copy speed measured so far): the next step waits for the copies on the device.
    loaded: list[tuple[int, int, float]] = field(default_factory=list)
    bad: list[tuple[str, bytes]] = field(default_factory=list)  # (tier, key) entries found corrupt or unreadable
    errors: dict[str, int] = field(default_factory=dict)  # cumulative, per tier
    copy: list[float] = field(default_factory=list)  # cumulative: load bytes, load s, store bytes, store s (CUDA)


def split_remote_urls(value: str) -> list[str]:
    """The Redis servers of `--kv-offload-remote-url`: one URL, or several separated by commas
    (the remote tier is then sharded over them, in that order). ValueError names every bad one."""
    problems = remote_url_problems(value)
    if problems:
        raise ValueError("--kv-offload-remote-url: " + "; ".join(problems))
    return [u.strip() for u in value.split(",")]


def remote_url_problems(value: str) -> list[str]:
    """What is wrong with `value` as the remote tier's servers, a sentence a fault; [] when every
    URL is one the store connects to as written. The operator checks kvCache's remote url with
    this too, so a URL the engine would refuse at start is refused before a pod starts."""
    urls = [u.strip() for u in value.split(",")]
    problems = [f"{url!r} is not {REMOTE_URL_FORMS}: {fault}" for url in urls if (fault := _remote_url_fault(url))]
    return problems + [f"names a server twice: {url!r}" for url in dict.fromkeys(urls) if urls.count(url) > 1]


def _remote_url_fault(url: str) -> str | None:
    """Why redis-py would refuse `url`, or read it other than as written (an ignored host or db,
    a port of 0 taken as 6379, options the store's own connections do not honour); None: fine."""
    if not url:
        return "an empty entry (several servers: comma-separated URLs)"
    if any(c.isspace() for c in url):
        return "it contains whitespace"
    scheme, sep, _ = url.partition("://")
    if not sep or scheme not in REMOTE_URL_SCHEMES:
        return "the scheme must be redis://, rediss:// or unix:// (lower case)"
    try:
        parts = urlsplit(url)
    except ValueError as e:  # a bracketed host that is no IPv6 address
        return f"its host is not a name or address ({e})"
    if parts.fragment:
        return f"it has a fragment #{parts.fragment}"
    if not re.fullmatch(r"(db=[0-9]+)?", parts.query):
        return f"the query ?{parts.query} is not ?db=N (the only option the engine takes from a URL)"
    host_port = parts.netloc.rpartition("@")[2]
    if scheme == "unix":
        if host_port:
            return f"{host_port!r} stands where a unix:// URL names no host: the socket's path follows three slashes"
        return None if parts.path.strip("/") else "it names no socket path"
    if not parts.hostname:
        return "it names no host"
    port = host_port.rpartition("]")[2].partition(":")
    if port[1] and not (re.fullmatch(r"[0-9]{1,5}", port[2]) and 1 <= int(port[2]) <= 65535):
        return f"the port {port[2]!r} is not a number from 1 to 65535"
    if not re.fullmatch(r"(/[0-9]*)?", parts.path):
        return f"the path {parts.path!r} is not /db (a database number)"
    return None


def redacted_url(url: str) -> str:
    """`url` (one or several, comma-separated) without user names and passwords: what logs and
    benchmark reports may show."""
    return ",".join(re.sub(r"^([a-z]+://)[^/]*@", r"\1", u) for u in url.split(","))

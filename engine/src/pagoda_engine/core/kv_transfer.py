"""Disaggregated prefill and decode in the engine core: the control plane of `--kv-transfer-config`.

Producer (`kv_producer`, `kv_both`): a request sent with `kv_transfer_params: {"do_remote_decode":
true}` runs as usual; when it finishes, the full pages of its prompt (those a consumer can use: all
but the one holding the last prompt token's page when the prompt ends on a page boundary) get one
more reference each, a *hold*, and its output carries the params a consumer needs
(`hold` → `EngineCoreOutput.kv_transfer_params`). A consumer's pull (or an empty pull: "nothing
needed") releases the hold; one never pulled is released after `hold_timeout_s`.

Consumer (`kv_consumer`, `kv_both`): a request whose params say `do_remote_prefill` is added
waiting for remote KV (`Request.waits_for_remote_kv`; the scheduler passes it over, the other
requests keep stepping). `start_pull` looks up its prompt's pages in this pool: the pages the
producer holds past the local prefix hit (only those whose chained hashes match the producer's)
get fresh pages here, and a transfer thread asks the producer's endpoint for them (the handshake
checks model, page size, KV dtype and layout through their fingerprints) and receives them over
the worker's data plane (`worker/kv_transfer.py`). When the pull lands the pages are registered
in the prefix cache under their hashes and let go: the request is admitted with them as prefix
hits and computes only its last token(s). A pull that fails, or outlives `transfer_timeout_s`,
lets the request compute its prompt itself (a fallback); its pages go back to the pool when the
thread has finished with them, never before.

The endpoint is one TCP listener per core (`kv_ip:kv_port + data-parallel rank`); each message on
it is a 4-byte length and a JSON object. Threads touch no page-pool state: they hand what they
finished to the engine thread through a queue, which `poll()` drains at the start of every step.
Tensor and pipeline parallelism are refused by the config (each rank would pull its own shard).
"""

from __future__ import annotations

import base64
import json
import logging
import queue
import secrets
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field

from pagoda_engine.core.kv.block_pool import BlockPool, Page, hash_pages
from pagoda_engine.core.request import Request
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.kv_transfer import NIXL_CONNECTOR, TORCH_CONNECTOR, KVTransferConfig, RemotePrefill, remote_prefill

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
_MAX_MESSAGE = 16 << 20
_IDLE_WAIT_S = 0.001


def _send_message(sock: socket.socket, message: dict) -> None:
    body = json.dumps(message).encode()
    sock.sendall(_LENGTH.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        data += chunk
    return bytes(data)


def _recv_message(sock: socket.socket) -> dict:
    (n,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if n > _MAX_MESSAGE:
        raise ConnectionError(f"a {n}-byte control message is too long")
    message = json.loads(_recv_exactly(sock, n))
    if not isinstance(message, dict):
        raise ConnectionError("a control message must be a JSON object")
    return message


@dataclass
class TransferCounters:
    """Since the start; exported as the `pagoda:kv_transfer_*` and external prefix cache families."""

    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # pulls' wall time, handshake included
    pulls: int = 0  # pulls that landed
    failures: int = 0  # pulls that failed or timed out
    fallbacks: int = 0  # requests that computed their prompt themselves after all
    external_queries: int = 0  # prompt tokens of requests with do_remote_prefill
    external_hits: int = 0  # of them, tokens received instead of computed


@dataclass
class _Hold:
    pages: list[Page]
    hashes: list[bytes]
    deadline: float
    claimed: bool = False  # a pull is sending it: it is released when that ends, not at the deadline


@dataclass
class _Pull:
    request: Request
    remote: RemotePrefill
    hits: list[Page]  # the local prefix hit, referenced while the pull runs
    pages: list[Page]  # fresh pages the producer's land in
    hashes: list[bytes]  # the hashes they are registered under
    remote_block_ids: list[int]
    started: float
    deadline: float
    abandoned: bool = False  # timed out on the engine's side: the thread still owns `pages`
    done: threading.Event = field(default_factory=threading.Event)


class KVTransfer:
    """One engine core's holds, pulls and transfer endpoint. The methods without a leading
    underscore run on the engine thread; the page pool is touched there alone."""

    def __init__(self, config: KVTransferConfig, executor, pool: BlockPool, page_size: int, fingerprint: str,
                 description: str, data_parallel_rank: int = 0):
        self.config = config
        self.executor = executor
        self.pool = pool
        self.page_size = page_size
        self.fingerprint = fingerprint
        self.description = description  # the fingerprint's human-readable facts, for errors
        self.engine_id = config.engine_id or f"pagoda-{uuid.uuid4().hex[:12]}"
        if data_parallel_rank:
            self.engine_id = f"{self.engine_id}-dp{data_parallel_rank}"
        self.counters = TransferCounters()
        self._holds: dict[str, _Hold] = {}
        self._lock = threading.Lock()  # `_holds`' claimed flags, between the engine and endpoint threads
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()  # holds the endpoint finished with
        self._finished: queue.SimpleQueue[tuple[_Pull, int, str | None]] = queue.SimpleQueue()
        self._pulls: dict[str, _Pull] = {}
        self._closed = False
        self._listener: socket.socket | None = None
        self.host, self.port = config.kv_ip, 0
        self.connector, self._nixl = self._start_connector(config.kv_connector)
        if config.is_producer:
            port = config.kv_port + data_parallel_rank if config.kv_port else 0
            self._listener = socket.create_server((config.kv_ip, port), reuse_port=False)
            self.port = self._listener.getsockname()[1]
            threading.Thread(target=self._serve, name="kv-transfer-endpoint", daemon=True).start()
            logger.info("KV transfer: %s (%s, %s) serves its held pages at %s:%d", self.engine_id,
                        config.kv_role, self.connector, self.host, self.port)

    def _start_connector(self, asked: str | None) -> tuple[str, tuple[bytes, str] | None]:
        """NIXL where it is asked for, or where none is named and it is installed; else the torch
        connector. With NIXL: this rank's agent metadata and memory type."""
        if asked == TORCH_CONNECTOR:
            return TORCH_CONNECTOR, None
        try:
            return NIXL_CONNECTOR, self.executor.collective_rpc("kv_transfer_nixl_start", self.engine_id)[0]
        except RuntimeError as e:
            if asked == NIXL_CONNECTOR:
                raise ModelLoadError(f"--kv-transfer-config: kv_connector NixlConnector cannot start: {e}") from None
            logger.info("KV transfer: NIXL unavailable (%s); using %s", e, TORCH_CONNECTOR)
            return TORCH_CONNECTOR, None

    # --- engine thread ------------------------------------------------------------------------
    @property
    def pages_held(self) -> int:
        return sum(len(h.pages) for h in self._holds.values())

    @property
    def busy(self) -> bool:
        """Pulls in flight (requests wait for them)."""
        return bool(self._pulls)

    def _prompt_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        return hash_pages(req.prompt_token_ids[:num_pages * self.page_size], self.page_size, req.page_hash_key)

    def hold(self, req: Request) -> dict:
        """A finished `do_remote_decode` request: hold its prompt's cached pages (taken from the
        pool's cache, where `free` just left them) and say where a consumer finds them."""
        usable = (req.num_prompt_tokens - 1) // self.page_size  # a consumer computes the last token
        hashes, pages = [], []
        for page_hash in self._prompt_hashes(req, usable):
            page = self.pool.get_cached_page(page_hash)
            if page is None:
                break
            hashes.append(page_hash)
            pages.append(page)
        # The hold's own id: a request id the client chose may come again, and only the consumer
        # given these params should be able to name the pages.
        hold_id = f"{req.request_id}#{secrets.token_hex(8)}"
        if pages:
            self.pool.touch(pages)
            with self._lock:
                self._holds[hold_id] = _Hold(pages, hashes, time.monotonic() + self.config.hold_timeout_s)
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.engine_id,
                "remote_request_id": hold_id, "remote_block_ids": [p.page_id for p in pages],
                "remote_block_hashes": [h.hex() for h in hashes], "remote_host": self.host,
                "remote_port": self.port, "remote_block_size": self.page_size,
                "remote_num_tokens": req.num_prompt_tokens, "remote_fingerprint": self.fingerprint,
                "remote_kv_description": self.description, "tp_size": 1}

    def start_pull(self, req: Request) -> None:
        """A new `do_remote_prefill` request: pull the pages it misses here, or let it compute them."""
        params = req.kv_transfer_params or {}
        remote = remote_prefill(params)
        if remote is None:
            return
        self.counters.external_queries += req.num_prompt_tokens
        if req.sampling_params.prompt_logprobs is not None:  # every prompt position is computed here anyway
            self._release_remote(remote)
            return
        error = self._mismatch(remote, params)
        if error is not None:
            logger.error("KV transfer for %s refused: %s; it computes its prompt itself", req.request_id, error)
            self._fall_back(failed=True)
            self._release_remote(remote)
            return
        usable = min((req.num_prompt_tokens - 1) // self.page_size, len(remote.block_ids))
        hashes = self._prompt_hashes(req, usable)
        theirs = params.get("remote_block_hashes")
        if isinstance(theirs, list):  # only the pages both sides hold for the same tokens
            matching = 0
            while matching < min(len(hashes), len(theirs)) and hashes[matching].hex() == theirs[matching]:
                matching += 1
            hashes = hashes[:matching]
        hits: list[Page] = []
        for page_hash in hashes:
            page = self.pool.get_cached_page(page_hash)
            if page is None:
                break
            hits.append(page)
        missing = len(hashes) - len(hits)
        # Pages in pulls are taken outside the scheduler's admission: at most half the pool, so
        # that the running requests' growth never waits for them.
        pulling = sum(len(p.pages) for p in self._pulls.values())
        if missing == 0 or not self.pool.has_room(hits, missing) or pulling + missing > (self.pool.num_pages - 1) // 2:
            if missing:
                logger.warning("KV transfer for %s: no room for %d pages; it computes its prompt itself",
                               req.request_id, missing)
                self._fall_back(failed=False)
            self._release_remote(remote)
            return
        self.pool.touch(hits)
        pages = self.pool.get_new_pages(missing)
        now = time.monotonic()
        pull = _Pull(req, remote, hits, pages, hashes[len(hits):], remote.block_ids[len(hits):len(hashes)],
                     now, now + self.config.transfer_timeout_s)
        self._pulls[req.request_id] = pull
        req.waits_for_remote_kv = True
        threading.Thread(target=self._pull, args=(pull,), name=f"kv-pull-{req.request_id}", daemon=True).start()

    def _mismatch(self, remote: RemotePrefill, params: dict) -> str | None:
        if remote.block_size != self.page_size:
            return f"the producer's page size is {remote.block_size} tokens, this engine's {self.page_size}"
        if remote.fingerprint != self.fingerprint:
            theirs = params.get("remote_kv_description", "unknown")
            return f"the producer's KV differs (producer: {theirs}; this engine: {self.description})"
        return None

    def _fall_back(self, failed: bool) -> None:
        self.counters.fallbacks += 1
        if failed:
            self.counters.failures += 1

    def poll(self) -> bool:
        """Landed or failed pulls, timed-out pulls, released and expired holds: at each step's start
        (and once a second while the core is idle). Whether any hold was released."""
        now = time.monotonic()
        held = self.pages_held
        while True:
            try:
                pull, num_bytes, error = self._finished.get_nowait()
            except queue.Empty:
                break
            self._land(pull, num_bytes, error, now)
        for pull in list(self._pulls.values()):
            if not pull.abandoned and now > pull.deadline:
                logger.warning("KV transfer for %s timed out after %.1fs; it computes its prompt itself",
                               pull.request.request_id, self.config.transfer_timeout_s)
                pull.abandoned = True
                pull.request.waits_for_remote_kv = False
                self._fall_back(failed=True)
        while True:
            try:
                rid = self._released.get_nowait()
            except queue.Empty:
                break
            self._drop_hold(rid)
        with self._lock:
            expired = [rid for rid, h in self._holds.items() if not h.claimed and now > h.deadline]
        for rid in expired:
            logger.info("KV transfer: pages held for %s released unpulled after %.0fs", rid,
                        self.config.hold_timeout_s)
            self._drop_hold(rid)
        return self.pages_held != held

    def _land(self, pull: _Pull, num_bytes: int, error: str | None, now: float) -> None:
        del self._pulls[pull.request.request_id]
        req = pull.request
        if error is None and not pull.abandoned and not req.is_finished:
            first, size = len(pull.hits), self.page_size
            for i, (page, page_hash) in enumerate(zip(pull.pages, pull.hashes)):
                # A hash cached meanwhile keeps its page; this one is then just freed.
                if self.pool.cache_page(page, page_hash):  # reported as vLLM's BlockStored (KV events on)
                    parent = pull.hashes[i - 1] if i else (pull.hits[-1].page_hash if pull.hits else None)
                    k = first + i
                    self.pool.record_stored([page_hash], parent, req.prompt_token_ids[k * size:(k + 1) * size], size,
                                            req.lora_request)
            self.counters.pulls += 1
            self.counters.bytes_received += num_bytes
            self.counters.seconds += now - pull.started
            self.counters.external_hits += len(pull.pages) * self.page_size
        elif error is not None and not pull.abandoned:
            logger.warning("KV transfer for %s failed (%s); it computes its prompt itself", req.request_id, error)
            self._fall_back(failed=True)
        req.waits_for_remote_kv = False
        self.pool.free_pages(reversed(pull.hits + pull.pages))

    def _drop_hold(self, request_id: str) -> None:
        with self._lock:
            hold = self._holds.pop(request_id, None)
        if hold is not None:
            self.pool.free_pages(reversed(hold.pages))

    def idle(self) -> None:
        """Nothing to run but requests waiting for their pulls: wait for one a moment."""
        if self._pulls:
            time.sleep(_IDLE_WAIT_S)

    def stats(self) -> list[float]:
        c = self.counters
        return [c.bytes_sent, c.bytes_received, c.seconds, c.pulls, c.failures, c.fallbacks, self.pages_held,
                c.external_queries, c.external_hits]

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            self._listener.close()

    # --- threads ------------------------------------------------------------------------------
    def _pull(self, pull: _Pull) -> None:
        """A consumer's transfer thread: the handshake, then the pages."""
        remote, timeout = pull.remote, self.config.transfer_timeout_s
        num_bytes, error = 0, None
        try:
            with socket.create_connection((remote.host, remote.port), timeout=timeout) as sock:
                _send_message(sock, {"op": "pull", "request_id": remote.request_id, "engine_id": self.engine_id,
                                     "block_ids": pull.remote_block_ids, "fingerprint": self.fingerprint,
                                     "description": self.description, "block_size": self.page_size,
                                     "connector": self.connector})
                reply = _recv_message(sock)
                if not reply.get("ok"):
                    raise ConnectionError(reply.get("error", "refused"))
                page_ids = [p.page_id for p in pull.pages]
                if self.connector == NIXL_CONNECTOR:
                    try:
                        num_bytes = self.executor.collective_rpc(
                            "kv_transfer_nixl_read", base64.b64decode(reply["nixl_metadata"]), reply["descs"],
                            reply["mem_type"], page_ids, timeout)[0]
                    finally:  # the producer holds the pages until it hears the read has ended
                        _send_message(sock, {"op": "done"})
                else:
                    num_bytes = self.executor.collective_rpc("kv_transfer_recv", remote.host, reply["store_port"],
                                                             page_ids, timeout)[0]
        except Exception as e:  # noqa: BLE001 - any failure means: compute the prompt here
            error = f"{type(e).__name__}: {e}"
        self._finished.put((pull, num_bytes, error))

    def _release_remote(self, remote: RemotePrefill) -> None:
        """Tell the producer its hold is not needed (best effort: it expires anyway)."""
        def release() -> None:
            try:
                with socket.create_connection((remote.host, remote.port), timeout=self.config.transfer_timeout_s) as s:
                    _send_message(s, {"op": "release", "request_id": remote.request_id})
                    _recv_message(s)
            except OSError:
                pass
        threading.Thread(target=release, name="kv-release", daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), name="kv-transfer-peer", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        """The producer's side of one pull (or release)."""
        timeout = self.config.transfer_timeout_s
        rid = None
        try:
            with conn:
                conn.settimeout(timeout)
                message = _recv_message(conn)
                rid = message.get("request_id")
                with self._lock:
                    hold = self._holds.get(rid)
                    if hold is not None and not hold.claimed:
                        hold.claimed = True
                    else:
                        hold = None
                if message.get("op") == "release" or hold is None:
                    _send_message(conn, {"ok": hold is not None, "error": f"no pages held for {rid!r}"})
                    return
                error = self._refusal(message, hold)
                if error is not None:
                    _send_message(conn, {"ok": False, "error": error})
                    return
                page_ids = message["block_ids"]
                if self.connector == NIXL_CONNECTOR:
                    descs = self.executor.collective_rpc("kv_transfer_nixl_descs", page_ids)[0]
                    metadata, mem_type = self._nixl
                    _send_message(conn, {"ok": True, "nixl_metadata": base64.b64encode(metadata).decode(),
                                         "descs": descs, "mem_type": mem_type})
                    # The consumer reads the held pages now: they stay held until it says the read
                    # has ended, or its connection breaks, or the hold's bound passes.
                    conn.settimeout(self.config.hold_timeout_s)
                    _recv_message(conn)
                    sent = sum(d[1] for d in descs)
                else:
                    sent = self.executor.collective_rpc(
                        "kv_transfer_send", self.host, page_ids, timeout,
                        lambda port: _send_message(conn, {"ok": True, "store_port": port}))[0]
                self.counters.bytes_sent += sent
        except Exception as e:  # noqa: BLE001 - the consumer falls back; the hold is released either way
            logger.warning("KV transfer: a pull of %s failed on the producer's side: %s", rid, e)
        finally:
            if rid is not None and isinstance(rid, str):
                self._released.put(rid)

    def _refusal(self, message: dict, hold: _Hold) -> str | None:
        if message.get("connector") != self.connector:
            return (f"connector mismatch: the producer moves pages with {self.connector}, the consumer with "
                    f"{message.get('connector')}")
        if message.get("block_size") != self.page_size:
            return f"page size mismatch: the producer's is {self.page_size}, the consumer's {message.get('block_size')}"
        if message.get("fingerprint") != self.fingerprint:
            return (f"KV mismatch: the producer holds {self.description}; the consumer has "
                    f"{message.get('description', 'unknown')}")
        ids = message.get("block_ids")
        if not isinstance(ids, list) or not set(ids) <= {p.page_id for p in hold.pages}:
            return "block_ids name pages not held for this request"
        return None

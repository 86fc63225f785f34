"""Forwarding one OpenAI request: hold it while no replica is ready, pick a replica, send, retry
elsewhere (up to --max-migrations times) if the replica fails before its first byte, then pass
the response through chunk by chunk.

A stream that can be continued on another replica (`migration.migratable`) goes through
`MigratingStream`, which splices a continuation in when its replica fails mid-way. Everything
else goes upstream byte for byte as the client sent it and comes back byte for byte
(`aiter_raw`); such a stream that breaks after its headers went out ends with one OpenAI error
frame (the status line, 200, cannot be taken back).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from pagoda_engine.api.server.errors import error_response, sse_error_frame
from pagoda_engine.router.backends import Backend, BackendPool, adapter_affinity, is_adapter
from pagoda_engine.router.client_stream import ClientStream
from pagoda_engine.router.metrics import RouterMetrics
from pagoda_engine.router.migration import MigratingStream
from pagoda_engine.router.policy import PrefixAware, PrefixKey

log = logging.getLogger("pagoda.router")

# Hop-by-hop headers (RFC 9110 §7.6.1) and the ones httpx recomputes; never forwarded.
_DROP_REQUEST = {"host", "content-length", "connection", "keep-alive", "proxy-authenticate",
                 "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade"}
_DROP_RESPONSE = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "date", "server"}
# A replica answering these before any body byte is overloaded (its waiting queue full), draining
# or behind a failing proxy: another replica may well succeed.
_RETRYABLE_STATUS = {429, 502, 503, 504}
# A connection that failed before its response: httpx's transport errors, and the AttributeError
# anyio raises on uvloop when the peer resets the connection while it is set up (the transport's
# socket is gone when anyio asks it for its peer's address).
_CONNECT_FAILURES = (httpx.TransportError, AttributeError)


@dataclass
class QueueConfig:
    size: int = 1024  # requests held at most while no replica is ready
    timeout_s: float = 60.0  # how long one request is held
    retry_after_s: int = 5  # Retry-After sent with the 503 when the wait expires or the queue is full


class Router:
    """`backend_api_key`: sent to the engines as `Authorization: Bearer`, in place of the client's;
    without it the client's header goes on only when `forward_client_key` (the router checks no
    keys of its own, so the client's key is for the engines)."""

    def __init__(self, pool: BackendPool, policy, metrics: RouterMetrics, client: httpx.AsyncClient,
                 queue: QueueConfig, backend_api_key: str | None = None, forward_client_key: bool = True,
                 max_migrations: int = 3, max_waiting_per_model: int | None = None):
        self.pool = pool
        # Requests of one model accepted and without response headers yet (held, connecting,
        # queued in an engine) past which a new one gets 429: bounded memory under overload.
        self.max_waiting_per_model = max_waiting_per_model
        self._waiting: dict[str | None, int] = {}
        # Replicas a request may move to after its first fails: before the first byte (a
        # connection error, 502-504) or, for a stream, mid-way (`migration.py`).
        self.max_migrations = max_migrations
        self.policy = policy
        self.metrics = metrics
        self.client = client
        self.queue = queue
        self.held = 0
        self._drop_request = _DROP_REQUEST if forward_client_key and not backend_api_key \
            else _DROP_REQUEST | {"authorization"}
        self._added_headers = [("authorization", f"Bearer {backend_api_key}")] if backend_api_key else []
        if isinstance(policy, PrefixAware):
            pool.on_remove(policy.forget)

    # ---- hold queue (scale from zero) ----
    def _unavailable(self, message: str) -> Response:
        return error_response(503, message, code="no_backend_available",
                              headers={"Retry-After": str(self.queue.retry_after_s)})

    def _ready(self, model: str | None, exclude: set[str]) -> bool:
        return any(b.url not in exclude for b in self.pool.ready(model))

    def _untried(self, tried: set[str]) -> bool:
        """Does the pool know a replica, ready or not, outside `tried`?"""
        return any(url not in tried for url in self.pool.backends)

    async def _hold_until_ready(self, model: str | None, exclude: set[str] = frozenset()) -> Response | None:
        """None once a replica serving `model`, other than those in `exclude`, is ready; a 503
        response when the queue is full or the wait expires."""
        if self._ready(model, exclude):
            return None
        if self.held >= self.queue.size:
            self.metrics.queue_rejected.inc()
            return self._unavailable(f"No backend is ready and the router's hold queue is full "
                                     f"({self.queue.size} requests); retry later.")
        self.held += 1
        self.metrics.queue_length.set(self.held)
        try:
            deadline = time.monotonic() + self.queue.timeout_s
            while not self._ready(model, exclude):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.metrics.queue_timeouts.inc()
                    return self._unavailable(f"No backend became ready within {self.queue.timeout_s:g}s; "
                                             f"retry later.")
                if self.pool.ready():  # ready, but not for this request: wait for the set to change
                    await asyncio.sleep(min(0.1, remaining))
                else:
                    await self.pool.wait_ready(remaining)
            return None
        finally:
            self.held -= 1
            self.metrics.queue_length.set(self.held)

    # ---- forwarding ----
    def _choose(self, model: str | None, key: PrefixKey | None, exclude: set[str]) -> Backend | None:
        candidates = [b for b in self.pool.ready(model) if b.url not in exclude]
        if not candidates:
            return None
        if is_adapter(candidates, model):
            candidates = adapter_affinity(candidates, model)
        url = self.policy.choose([b.view() for b in candidates], key)
        return self.pool.backends[url]

    async def forward(self, method: str, path: str, headers, body: bytes, model: str | None,
                      key: PrefixKey | None, migrate: dict | None = None) -> Response:
        """`migrate`: the parsed body of a stream that may move to another replica if its own
        fails (`migration.py`); None: relayed byte for byte."""
        start = time.monotonic()
        limit = self.max_waiting_per_model
        if limit is not None and self._waiting.get(model, 0) >= limit:
            self.metrics.waiting_rejected.labels(model or "").inc()
            self.metrics.requests.labels("none", "429").inc()
            return error_response(429, f"The router holds {limit} requests of this model waiting for a replica "
                                       f"already (--max-waiting-per-model); retry later.", type="rate_limit_error",
                                  code="too_many_requests", headers={"Retry-After": str(self.queue.retry_after_s)})
        if migrate is not None:
            body = json.dumps(dict(migrate, return_token_ids=True)).encode()
        self.metrics.waiting_for_backend.inc()
        self._waiting[model] = self._waiting.get(model, 0) + 1
        try:
            upstream, backend = await self._connect(method, path, headers, body, model, key)
        finally:
            self.metrics.waiting_for_backend.dec()
            self._waiting[model] -= 1
            if not self._waiting[model]:
                del self._waiting[model]
        if isinstance(upstream, Response):  # the router's own error
            self.metrics.requests.labels("none", str(upstream.status_code)).inc()
            return upstream
        if migrate is not None and upstream.status_code == 200 and _is_sse(upstream):
            async def reopen(new_body: bytes, exclude: set[str]):
                return await self._connect(method, path, headers, new_body, model, key, exclude)

            return MigratingStream(self, reopen, migrate, upstream, backend, start, self.max_migrations,
                                   _response_headers(upstream, backend))
        return self._relay(upstream, backend, start)

    async def _connect(self, method, path, headers, body, model, key, exclude: set[str] = frozenset()):
        tried: set[str] = set(exclude)
        # Held while no replica is ready (scale from zero); a continuation, while none it has not
        # failed on is, as long as the pool knows one.
        held = await self._hold_until_ready(model, tried if self._untried(tried) else frozenset())
        if held is not None:
            return held, None
        fwd_headers = [(k, v) for k, v in headers.items() if k.lower() not in self._drop_request] + self._added_headers
        last_error = "no backend is ready"
        for attempt in range(1 + self.max_migrations):
            backend = self._choose(model, key, tried)
            if backend is None and self._untried(tried):
                # The replicas tried so far failed and the others are not ready this instant (a
                # missed health poll on a loaded node, a restart): wait for one as a held request does.
                held = await self._hold_until_ready(model, tried)
                if held is not None:
                    return held, None
                backend = self._choose(model, key, tried)
            if backend is None:
                break
            if attempt:
                self.metrics.retries.inc()
            tried.add(backend.url)
            backend.in_flight += 1
            request = self.client.build_request(method, backend.url + path, content=body, headers=fwd_headers)
            try:
                upstream = await self.client.send(request, stream=True)
            except _CONNECT_FAILURES as e:
                backend.in_flight -= 1
                last_error = f"{backend.url}: {type(e).__name__}: {e}"
                self.pool.mark_failed(backend, last_error)
                continue
            if upstream.status_code == 503 and upstream.headers.get("connection", "").lower() == "close":
                # A draining replica (SIGTERM): no more work for it, not even until the next poll.
                self.pool.mark_failed(backend, "draining")
            if upstream.status_code in _RETRYABLE_STATUS and attempt < self.max_migrations \
                    and self._choose(model, key, tried):
                last_error = f"{backend.url} answered {upstream.status_code}"
                await upstream.aclose()
                backend.in_flight -= 1
                continue
            if isinstance(self.policy, PrefixAware) and key is not None:
                self.policy.remember(key, backend.url)
            return upstream, backend
        return error_response(502, f"No backend could take the request ({last_error}).",
                              code="backend_unavailable"), None

    def _relay(self, upstream: httpx.Response, backend: Backend, start: float) -> Response:
        return RelayResponse(self, upstream, backend, start)


def _response_headers(upstream: httpx.Response, backend: Backend) -> list[tuple[bytes, bytes]]:
    headers = [(k.encode("latin-1"), v.encode("latin-1"))
               for k, v in upstream.headers.multi_items() if k.lower() not in _DROP_RESPONSE]
    headers.append((b"x-pagoda-backend", backend.url.encode("latin-1")))
    return headers


def _is_sse(upstream: httpx.Response) -> bool:
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


class RelayResponse(ClientStream):
    """Streams an upstream response to the client and always releases it: on completion, on a
    broken upstream, and when the client disconnects (then the upstream connection is closed,
    which makes the engine abort the request and free its pages)."""

    def __init__(self, router: Router, upstream: httpx.Response, backend: Backend, start: float):
        self.router = router
        self.upstream = upstream
        self.backend = backend
        self.start = start
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = _response_headers(upstream, backend)
        self.is_sse = _is_sse(upstream)
        self.outcome = str(upstream.status_code)

    async def _release(self) -> None:
        await self.upstream.aclose()
        self.backend.in_flight -= 1

    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        first = True
        tail = b""  # the stream's last bytes: whether it ended with [DONE] or an error frame
        broke = None
        try:
            async for chunk in self.upstream.aiter_raw():
                if first:
                    self.router.metrics.ttft.observe(time.monotonic() - self.start)
                    first = False
                tail = (tail + chunk)[-_TAIL_BYTES:]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:
            # The replica died or hung up mid-response: take it out of rotation now rather than
            # at the next health poll.
            broke = f"{type(e).__name__}: {e}"
            self.router.pool.mark_failed(self.backend, broke)
        if self.is_sse and broke is None and not _ended(tail):
            broke = "closed before [DONE]"  # a clean close mid-stream is a cut all the same
        if broke is not None:
            self.outcome = "stream_error"
            log.warning("response from %s broke: %s", self.backend.url, broke)
            if self.is_sse:  # said in-band: the status line, 200, went out already
                self.router.metrics.stream_errors.inc()
                frame = sse_error_frame(f"The backend {self.backend.url} failed mid-stream ({broke}); the "
                                        f"response is incomplete.", code="backend_stream_error")
                await send({"type": "http.response.body", "body": frame.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


_TAIL_BYTES = 4096  # more than one error frame: an engine's own in-band error ends its stream too


def _ended(tail: bytes) -> bool:
    """Whether an SSE body's last frame is a proper end: [DONE], or an error frame (the engine's
    own, say the drain deadline's)."""
    frames = [f for f in tail.replace(b"\r\n", b"\n").split(b"\n\n") if f.strip()]
    if not frames:
        return False
    last = frames[-1].strip()
    if last == b"data: [DONE]":
        return True
    try:
        frame = json.loads(last.removeprefix(b"data: "))
    except ValueError:
        return False
    return isinstance(frame, dict) and "error" in frame

"""Mid-stream migration: a streamed completion whose replica fails is continued on another one,
and the client sees one uninterrupted stream.

The router asks the engine for each chunk's token ids (vLLM's `return_token_ids`) and counts
the ids of every chunk it passed on. When the stream breaks (connection reset or closed before
`[DONE]`, or an in-band server error such as the drain deadline's `shutting_down`), the same
request goes to another ready replica with `resume_token_ids` set to those ids: that engine
re-renders the prompt, takes the ids as the start of the output (so max_tokens, penalties and
a seeded request's draws go on where they were) and streams only what follows. The splice drops
the continuation's opening role chunk and rewrites its `id` and `created` to the first
stream's, so the client sees each token once and one final `usage` (the engine counts resumed
tokens as generated). Token ids the client did not ask for are taken out again.

A stream that cannot be continued (no replica left, the migration budget spent, the
continuation refused) ends with one OpenAI error frame, never a silent cut.
"""

from __future__ import annotations

import json
import logging
import time

import httpx
from starlette.responses import Response

from pagoda_engine.api.server.errors import sse_error_frame
from pagoda_engine.router.backends import Backend
from pagoda_engine.router.client_stream import ClientStream

log = logging.getLogger("pagoda.router")

DONE = b"data: [DONE]"
# Why a stream moved (the migrations metric's `cause` label).
CAUSE_CONNECTION = "connection_error"  # reset, refused, or closed before [DONE]
CAUSE_DRAIN = "drain_deadline"  # the replica was SIGTERMed and its --drain-timeout ran out
CAUSE_SERVER_ERROR = "server_error"  # any other in-band error of the server's making (a dead core)


def migratable(parsed) -> bool:
    """Whether a request's stream can be continued elsewhere: one streamed sequence (n == 1, one
    prompt), no echo, no prompt_logprobs. (A grammar is fine: the engine replays the resumed
    tokens through it.)"""
    if not getattr(parsed, "stream", False) or getattr(parsed, "n", 1) != 1 or getattr(parsed, "echo", False):
        return False
    if getattr(parsed, "prompt_logprobs", None) is not None:
        return False
    prompt = getattr(parsed, "prompt", None)
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) != 1)


def _has_output(choice: dict) -> bool:
    """Whether a streamed choice carries generated output (a chat stream's opening role chunk
    does not)."""
    delta = choice.get("delta")
    if delta is None:
        return bool(choice.get("text"))
    return any(delta.get(k) for k in ("content", "reasoning", "tool_calls"))


def _break_cause(frame: dict) -> str | None:
    """Why an in-band error frame breaks the stream, when another replica may not have the
    problem (anything but the client's own mistake); None for the client's mistake."""
    error = frame.get("error")
    if not isinstance(error, dict) or error.get("type") == "invalid_request_error":
        return None
    return CAUSE_DRAIN if error.get("code") == "shutting_down" else CAUSE_SERVER_ERROR


class MigratingStream(ClientStream):
    """Streams a completion to the client across replica failures. `open_stream(body, exclude)`
    is the router's connect step (hold, choose, send): it returns (upstream, backend) or
    (error Response, None)."""

    def __init__(self, router, open_stream, body: dict, upstream: httpx.Response, backend: Backend, start: float,
                 max_migrations: int, headers: list[tuple[bytes, bytes]]):
        self.router = router
        self.open_stream = open_stream
        self.body = body
        self.client_wants_ids = bool(body.get("return_token_ids"))
        self.resumed_before = list(body.get("resume_token_ids") or [])  # the client's own continuation
        self.upstream = upstream
        self.backend = backend
        self.start = start
        self.max_migrations = max_migrations
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = headers
        self.outcome = str(upstream.status_code)
        self.token_ids: list[int] = []  # output ids of the chunks passed on
        self.finished = False  # a finish_reason went out
        self.untracked = False  # output went out whose token ids the replica did not report
        self.stream_id: str | None = None
        self.created: int | None = None
        self.prompt_len: int | None = None

    # ---- one upstream's frames ----
    async def _frames(self):
        buffer = b""
        async for chunk in self.upstream.aiter_raw():
            buffer += chunk
            while b"\n\n" in buffer:
                frame, buffer = buffer.split(b"\n\n", 1)
                yield frame

    def _rewrite(self, chunk: dict, continuation: bool) -> dict | None:
        """The chunk as the client sees it, or None to drop it; records its token ids."""
        if self.stream_id is None:
            self.stream_id, self.created = chunk.get("id"), chunk.get("created")
        elif continuation:
            chunk["id"], chunk["created"] = self.stream_id, self.created
        if "prompt_token_ids" in chunk:  # chat: on the first chunk
            ids = chunk.pop("prompt_token_ids")
            self.prompt_len = self.prompt_len or len(ids or ())
            if self.client_wants_ids and not continuation:
                chunk["prompt_token_ids"] = ids
        for choice in chunk.get("choices") or ():
            if "token_ids" not in choice and _has_output(choice):
                self.untracked = True  # a replica without return_token_ids: its output cannot be resumed exactly
            ids = choice.pop("token_ids", None) or []
            self.token_ids.extend(ids)
            if "prompt_token_ids" in choice:  # completions: on the first chunk of the choice
                prompt_ids = choice.pop("prompt_token_ids")
                self.prompt_len = self.prompt_len or len(prompt_ids or ())
                if self.client_wants_ids and not continuation:
                    choice["prompt_token_ids"] = prompt_ids
            if self.client_wants_ids:
                choice["token_ids"] = ids
            if choice.get("finish_reason") is not None:
                self.finished = True
            delta = choice.get("delta")
            if delta is None or choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
                continue
            if continuation and delta.get("role") and not ids and not delta.get("content"):
                return None  # the continuation's opening role chunk: the client has had one
            if (not self.client_wants_ids and ids and chunk.get("usage") is None
                    and not any(v is not None for v in delta.values())):
                return None  # text a parser holds back: sent only for its ids
        return chunk

    async def _pump(self, send, continuation: bool) -> str | None:
        """Pass one upstream's frames on. None when its stream ended with [DONE]; else the cause
        of the break."""
        metrics = self.router.metrics
        try:
            async for frame in self._frames():
                if frame.startswith(DONE):
                    return None
                if not frame.startswith(b"data: "):
                    continue
                try:
                    chunk = json.loads(frame[6:])
                except ValueError:
                    return CAUSE_SERVER_ERROR
                if "error" in chunk:
                    cause = _break_cause(chunk)
                    if cause is not None and not self.finished:
                        log.warning("stream from %s ended with %s", self.backend.url, chunk["error"].get("message"))
                        return cause
                    await self._send(send, frame + b"\n\n")  # the request's own error: the client's to see
                    continue
                # The first replica's chunk goes on as sent unless ids the client did not ask for
                # come out of it; a continuation's always gets the first stream's id.
                as_sent = not continuation and (self.client_wants_ids or b'token_ids"' not in frame)
                chunk = self._rewrite(chunk, continuation)
                if chunk is None:
                    continue
                if self.first_byte:
                    metrics.ttft.observe(time.monotonic() - self.start)
                    self.first_byte = False
                if as_sent:
                    await self._send(send, frame + b"\n\n")
                else:
                    await self._send(send, b"data: " + json.dumps(chunk, ensure_ascii=False,
                                                                   separators=(",", ":")).encode() + b"\n\n")
        except httpx.HTTPError as e:
            log.warning("stream from %s broke: %s", self.backend.url, e)
            return CAUSE_CONNECTION
        return CAUSE_CONNECTION  # closed without [DONE]

    async def _send(self, send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

    async def _release(self) -> None:
        """Close the current upstream (the engine aborts what it still runs) and count it out."""
        if self.upstream is not None:
            upstream, self.upstream = self.upstream, None
            await upstream.aclose()
            self.backend.in_flight -= 1

    # ---- the whole response ----
    async def _stream(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        metrics = self.router.metrics
        self.first_byte = True
        migrations = 0
        cause = await self._pump(send, continuation=False)
        while cause is not None:
            if self.finished:
                # Every token went out; only [DONE] (and perhaps the usage chunk) were lost.
                await self._send(send, self._usage_frame())
                break
            # Out of rotation until its next good health poll: it just failed a stream.
            self.router.pool.mark_failed(self.backend, f"a stream broke ({cause})")
            where = f"the stream from {self.backend.url} broke ({cause})"
            if self.untracked:
                return await self._fail(send, f"{where}, and that replica does not report token ids "
                                              f"(return_token_ids), so it cannot be continued exactly")
            if migrations >= self.max_migrations:
                return await self._fail(send, f"{where}, {migrations + 1} breaks in all (--max-migrations "
                                              f"{self.max_migrations})")
            migrations += 1
            metrics.migrations.labels(cause).inc()
            failed_url = self.backend.url
            await self._release()
            resume = self.resumed_before + self.token_ids
            body = dict(self.body, return_token_ids=True)
            if resume:
                body["resume_token_ids"] = resume
                metrics.continuation_tokens.inc(len(self.token_ids))
            upstream, backend = await self.open_stream(json.dumps(body).encode(), {failed_url})
            if backend is None or upstream.status_code != 200:
                detail = await _error_text(upstream)
                if backend is not None:
                    await upstream.aclose()
                    backend.in_flight -= 1
                return await self._fail(send, f"{where}, and no replica could continue it "
                                              f"(HTTP {upstream.status_code}: {detail})")
            log.info("stream moved from %s to %s after %d tokens (%s)", failed_url, backend.url,
                     len(self.token_ids), cause)
            self.upstream, self.backend = upstream, backend
            cause = await self._pump(send, continuation=True)
        await self._send(send, DONE + b"\n\n")
        await self._end(send)

    async def _fail(self, send, reason: str) -> None:
        """End the stream with one OpenAI error frame (the status line, 200, went out already)."""
        self.outcome = "stream_error"
        self.router.metrics.stream_errors.inc()
        log.warning("stream ended with an error: %s", reason)
        frame = sse_error_frame(f"The response is incomplete: {reason}.", code="backend_stream_error")
        await self._send(send, frame.encode())
        await self._end(send)

    async def _end(self, send) -> None:
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _usage_frame(self) -> bytes:
        """The usage a stream would have ended with, when only its tail was lost (an empty frame
        list when the client did not ask for usage)."""
        options = self.body.get("stream_options") or {}
        if not options.get("include_usage") or self.prompt_len is None:
            return b""
        completion = len(self.resumed_before) + len(self.token_ids)
        chunk = {"id": self.stream_id, "object": "chat.completion.chunk" if "messages" in self.body
                 else "text_completion", "created": self.created, "model": self.body.get("model"), "choices": [],
                 "usage": {"prompt_tokens": self.prompt_len, "completion_tokens": completion,
                           "total_tokens": self.prompt_len + completion}}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def _error_text(upstream) -> str:
    if isinstance(upstream, Response):  # the router's own answer (no replica ready)
        return bytes(upstream.body).decode(errors="replace")[:300]
    try:
        return (await upstream.aread()).decode(errors="replace")[:300]
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"

"""How the HTTP servers (the engine server and the router) read a request body: declared as JSON
(else 415, as vLLM answers), bounded in size (--max-request-body-bytes) and parsed as strict
JSON, so that nothing a client sends can give a 500 or reach a handler as text no tokenizer, log
or response could encode.

`bounded_json_route(limit)` is the FastAPI route class that does all three for every route of an app.
A body over the limit gets a 413 the client can read (`read_bounded_body`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException


def decode_json_body(body: bytes) -> Any:
    """A request body as JSON, strictly: UTF-8, no NaN or Infinity, no lone surrogates (text
    that no tokenizer, log or response could encode), nesting bounded by the interpreter's
    recursion limit. Anything else raises json.JSONDecodeError, which FastAPI and the router
    turn into a 400 `invalid_json`."""
    try:
        return msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
        message = "nesting too deep" if isinstance(e, RecursionError) else str(e)
        raise json.JSONDecodeError(message, "", 0) from None


def check_json_content_type(content_type: str | None) -> None:
    """Refuse, with a 415 in vLLM's words, a body not declared as JSON (`text/plain`, a form, no
    Content-Type at all): FastAPI would hand it on as bytes, and the client would hear that its
    JSON object is not one. `application/<anything>+json` is JSON, as FastAPI reads it."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    if kind == "application" and (subtype == "json" or subtype.endswith("+json")):
        return
    sent = f"the request's Content-Type is {content_type!r}" if content_type else "the request has no Content-Type"
    raise HTTPException(415, f"Unsupported Media Type: Only 'application/json' is allowed ({sent}; send "
                             f"`Content-Type: application/json`).")


# Past the limit, up to this many more bytes are read and dropped before the 413 goes out: a
# client still sending when the server answers and closes has its connection reset, and its
# library (requests, httpx, openai) reports a connection error instead of the answer. Beyond
# this the server stops reading (dropping costs bandwidth only, never memory).
DISCARD_BYTES = 64 << 20


async def read_bounded_body(request: Request, max_body_bytes: int) -> bytes:
    """The request's body, refused with a 413 naming --max-request-body-bytes once it is known to
    be larger (from Content-Length, or while it streams in), never buffered whole. The rest of
    an oversized body is read and dropped (up to DISCARD_BYTES) so that the client gets to read
    the 413; a client that asked `Expect: 100-continue` is answered before it sends anything."""
    too_large = HTTPException(413, f"The request body is larger than --max-request-body-bytes "
                                   f"({max_body_bytes} bytes).", headers={"Connection": "close"})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        expects_continue = "100-continue" in request.headers.get("expect", "").lower()
        if expects_continue or int(declared) > max_body_bytes + DISCARD_BYTES:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes + DISCARD_BYTES:
            break
        if size <= max_body_bytes:
            chunks.append(chunk)
    if size > max_body_bytes:
        raise too_large
    return b"".join(chunks)


def bounded_json_route(max_body_bytes: int) -> type[APIRoute]:
    """A route class whose requests declare their body as JSON (`check_json_content_type`), have
    a bounded body and parse it as strict JSON (`decode_json_body`): what a client sends can give
    a 4xx, never a 500."""

    class BoundedJSONRequest(Request):
        async def body(self) -> bytes:
            if not hasattr(self, "_body"):
                self._body = await read_bounded_body(self, max_body_bytes)
            return self._body

        async def json(self):
            if not hasattr(self, "_json"):
                # O(body), bounded by max_body_bytes (about 2 ns a byte); a thread would not
                # help: the decoder holds the GIL.
                self._json = decode_json_body(await self.body())
            return self._json

    class BoundedJSONRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()
            takes_body = self.body_field is not None

            async def bounded_handler(request: Request) -> Response:
                if takes_body:
                    check_json_content_type(request.headers.get("content-type"))
                return await handler(BoundedJSONRequest(request.scope, request.receive))

            return bounded_handler

    return BoundedJSONRoute

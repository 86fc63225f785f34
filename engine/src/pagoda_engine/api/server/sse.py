"""The wire form of a streamed OpenAI response: server-sent event frames and the response that
sends them.

A frame is `data: <json>\\n\\n`; a stream ends with `data: [DONE]`; an error after the status line
went out is a frame of its own (OpenAI's error shape). `StreamFrames` writes the common plain
chunks from byte templates; `SSEResponse` notices a client going away and always closes its
body iterator, whose `finally` aborts the request in the core.
"""

from __future__ import annotations

from typing import AsyncIterator

import anyio
from pydantic_core import to_json
from starlette.responses import StreamingResponse

from pagoda_engine.api.server.errors import exception_to_body, sse_error_frame

DONE = "data: [DONE]\n\n"


def sse_frame(obj) -> str:
    """The frame of one pydantic model."""
    return f"data: {obj.model_dump_json()}\n\n"


def sse_error(exc: BaseException) -> str:
    """The frame that reports `exc` in-band, as the error body a plain response would carry."""
    _, body = exception_to_body(exc)
    err = body["error"]
    return sse_error_frame(err["message"], err["type"], err["param"], err["code"])


class StreamFrames:
    """The SSE frames of a stream's plain chunks (one choice, no logprobs, no usage), written from
    byte templates instead of pydantic models: the bytes `sse_frame` would write for the same
    `CompletionStreamResponse` / `ChatCompletionStreamResponse`, at a fraction of the cost
    (strings are escaped by pydantic's own JSON writer)."""

    def __init__(self, request_id: str, created: int, model: str, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        self.head = (f'data: {{"id":{_json(request_id)},"object":"{kind}","created":{created},'
                     f'"model":{_json(model)},"choices":[{{"index":').encode()
        self.chat = chat

    def chunk(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None,
              token_ids: list[int] | None = None) -> bytes:
        """`token_ids`: the choice's new ids (`return_token_ids`), after its declared fields as
        pydantic writes an extra field."""
        end = b',"finish_reason":' + to_json(finish_reason) + b',"stop_reason":' + to_json(stop_reason)
        ids = b"" if token_ids is None else b',"token_ids":' + to_json(token_ids)
        if self.chat:
            return b"".join((self.head, str(index).encode(), b',"logprobs":null', end,
                             b',"delta":{"role":null,"content":', to_json(text),
                             b',"reasoning":null,"tool_calls":null}', ids, b'}],"usage":null}\n\n'))
        return b"".join((self.head, str(index).encode(), b',"text":', to_json(text), b',"logprobs":null', end, ids,
                         b'}],"usage":null}\n\n'))


def _json(text: str) -> str:
    return to_json(text).decode()


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that notices a client going away while the stream waits
    for tokens (not only on the next write) and always closes its body iterator, whose `finally`
    aborts the request in the core."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async def watch_disconnect() -> None:
            await self.listen_for_disconnect(receive)
            task_group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(watch_disconnect)
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client closed the connection mid-write
                task_group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def sse_response(stream: AsyncIterator[str | bytes]) -> SSEResponse:
    return SSEResponse(stream, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

"""A response streamed to the router's client that always ends its bookkeeping: whether the
stream completes, its replica breaks, or the client leaves (a disconnect cancels the stream, so
the upstream connection is closed and the engine aborts the request and frees its pages)."""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response


class ClientStream(Response):
    """Subclasses set `router`, `backend`, `start` and `outcome`, and write the body in
    `_stream(send)`; `_release()` gives the replica back, after which the request is counted."""

    async def _stream(self, send) -> None:
        raise NotImplementedError

    async def _release(self) -> None:
        raise NotImplementedError

    async def __call__(self, scope, receive, send) -> None:
        me = asyncio.current_task()
        disconnected = False

        async def watch_disconnect():
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            me.cancel()

        watcher = asyncio.create_task(watch_disconnect())
        try:
            await self._stream(send)
        except asyncio.CancelledError:
            if not disconnected:
                raise
            me.uncancel()
            self.outcome = "client_disconnected"
        except OSError:  # ASGI 2.4 servers raise on send() once the client is gone
            self.outcome = "client_disconnected"
        finally:
            watcher.cancel()
            await self._release()
            metrics = self.router.metrics
            metrics.requests.labels(self.backend.url, self.outcome).inc()
            metrics.e2e.observe(time.monotonic() - self.start)

"""One API server process: start the engine core(s), then the HTTP server; drain and stop on SIGTERM
(`pagoda serve`'s flags and which processes it runs: `pagoda_engine.serve`).

Order matters for Kubernetes probes and for clients: the port, bound before anything loads, opens
(listens) only after the core has loaded the model and reported its KV capacity, and on SIGTERM
the server stops accepting, lets in-flight requests finish (bounded by --drain-timeout), ends the rest with a clear error,
stops the core process, and exits 0.

With `--api-server-count N` > 1 the launcher (`api.server.launcher`) starts the cores and N API
server processes, each running `serve_http` below on the shared socket.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import signal
import socket
import sys
from typing import Awaitable, TypeVar

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import ModelLoadError

T = TypeVar("T")

logger = logging.getLogger("pagoda_engine.api.server")


class _DrainingServer(uvicorn.Server):
    """uvicorn, plus: the first SIGTERM/SIGINT starts the drain (`on_exit`) and the server goes on
    listening while it lasts, so that clients and routers hear `draining` (503 on /health, 503
    `shutting_down` on new work, `Connection: close`) instead of a refused connection; the drain
    stops the server when it is done. A second signal stops it at once. An API process under a
    launcher ignores SIGINT: the launcher owns shutdown, and a terminal's Ctrl-C reaches the whole
    process group. The one process of a server without a launcher says where it listens, as
    uvicorn does for an address it binds itself (it is silent on a socket given)."""

    def __init__(self, config: uvicorn.Config, on_exit, under_launcher: bool = False):
        super().__init__(config)
        self._on_exit = on_exit
        self._draining = False
        self._under_launcher = under_launcher

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and self._under_launcher:
            return
        if not self._draining:
            self._draining = True
            # Signal handlers run between bytecodes of the main thread: hop onto the loop.
            asyncio.get_event_loop().call_soon_threadsafe(self._on_exit)
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if sockets and self.started and not self._under_launcher:
            self._log_started_message(sockets)


def serve_one_process(config: EngineConfig, log_level: str, sock: socket.socket) -> int:
    """This process serves: its engine core(s), then HTTP on `sock` (bound by `pagoda serve`)."""
    try:
        return run_event_loop(serve(config, log_level, sock))
    except KeyboardInterrupt:  # Ctrl-C while the model was loading (the core is stopped already)
        print("pagoda serve: interrupted", file=sys.stderr)
        return 130


async def serve(config: EngineConfig, log_level: str, sock: socket.socket | None = None) -> int:
    from pagoda_engine.api.server.async_engine import AsyncEngine

    engine = AsyncEngine(config)
    try:
        ready = await engine.start()
    except ModelLoadError as e:
        print(f"pagoda serve: the engine could not start: {e}", file=sys.stderr, flush=True)
        return 1
    # The tokenizer and libraries loaded so far are long-lived: moved out of the collector's
    # reach, a full collection no longer walks them (hundreds of ms with the event loop stopped).
    gc.freeze()
    print(capacity_line(config, ready, engine.served_model_name), flush=True)
    return await serve_http(engine, log_level, sock=sock)


def capacity_line(config: EngineConfig, ready, served_model_name: str) -> str:
    cores = config.parallel.data_parallel_size
    per_core = f" per engine core × {cores} data-parallel cores" if cores > 1 else ""
    servers = config.server.api_server_count
    api = f"; {servers} API server processes" if servers > 1 else ""
    return (f"KV cache capacity: {ready.kv_capacity_tokens} tokens "
            f"({ready.num_kv_pages - 1} pages of {ready.block_size}){per_core}; max_model_len {ready.max_model_len}; "
            f"serving model {served_model_name!r}{api}")


async def serve_http(engine, log_level: str, sock=None, api_server_index: int | None = None) -> int:
    """Serve the OpenAI API over a started engine until SIGTERM, drain, stop the engine. `sock`:
    the listening socket `pagoda serve` bound (shared by every API process under a launcher; None:
    bind host:port now); `api_server_index`: this process's index under a launcher, sent as the
    X-Pagoda-API-Server header of every response."""
    from pagoda_engine import envs
    from pagoda_engine.api.server.app import create_app
    from pagoda_engine.api.server.errors import ServiceUnavailableError
    from pagoda_engine.api.server.warm_up import warm_up_routes

    config = engine.config
    drain_timeout = config.server.drain_timeout_s

    async def drain() -> None:
        engine.accepting = False
        try:
            if engine.num_in_flight:
                logger.info("draining %d in-flight request(s), up to %gs", engine.num_in_flight, drain_timeout)
            if not await engine.wait_idle(drain_timeout):
                logger.warning("drain timeout: ending %d request(s)", engine.num_in_flight)
                engine.abort_all(ServiceUnavailableError(
                    "The server is shutting down and could not finish this request in time.", code="shutting_down"))
        finally:
            server.should_exit = True  # stop listening; uvicorn lets the ended streams finish writing

    drain_tasks: list[asyncio.Task] = []
    app = create_app(engine, api_key=config.server.api_key)
    await warm_up_routes(app, config.server.api_key or envs.api_key())  # before the port listens
    headers = [] if api_server_index is None else [(API_SERVER_HEADER, str(api_server_index))]
    logger.info("HTTP: %s event loop, %s parser", *http_stack().values())
    uv_config = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=log_level,
                               lifespan="off", timeout_graceful_shutdown=int(drain_timeout) + 5, access_log=False,
                               headers=headers)
    server = _DrainingServer(uv_config, on_exit=lambda: drain_tasks.append(asyncio.ensure_future(drain())),
                             under_launcher=api_server_index is not None)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
    # place that is a no-op, and the process stops the core and exits 0. (Before this point the
    # default handlers apply: SIGTERM during model loading simply ends the process, and the
    # core follows its parent.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        if sock is not None:
            try:
                # Here, not in the event loop: uvloop does not report a listen() that fails (another
                # server bound the port too, both with SO_REUSEADDR, and listened first).
                sock.listen(uv_config.backlog)
            except OSError as e:
                print(f"pagoda serve: cannot listen on {config.server.host}:{config.server.port}: {e.strerror or e}",
                      file=sys.stderr, flush=True)
                return STARTUP_FAILURE
        await server.serve(sockets=None if sock is None else [sock])
    finally:
        for task in drain_tasks:
            task.cancel()
        await engine.shutdown()
    return 0


API_SERVER_HEADER = "X-Pagoda-API-Server"


def http_stack() -> dict[str, str]:
    """The event loop and HTTP/1.1 parser this environment serves on: uvloop and httptools where
    they import (the engine depends on both; the image installs them), else asyncio's own loop
    (`run_event_loop`) and h11 (uvicorn's fallback), which cost the API process about a sixth more
    CPU per streamed token (docs/benchmarks.md, 2026-11-28)."""
    stack = {}
    for key, module, fallback in (("event_loop", "uvloop", "asyncio"), ("http_parser", "httptools", "h11")):
        try:
            stack[key] = f"{module} {importlib.import_module(module).__version__}"
        except ImportError:
            stack[key] = fallback
    return stack


def run_event_loop(main: Awaitable[T]) -> T:
    """`asyncio.run(main)` on uvloop's event loop where uvloop is installed (as vLLM's server
    and `uvicorn.run` do; `Server.serve` alone keeps whatever loop it is given): its loop and
    transports are C, which the API process's per-chunk writes and wake-ups spend much of their
    time in. Without uvloop, asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)

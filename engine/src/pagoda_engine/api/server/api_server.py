"""`pagoda serve`: start the engine core(s), then the HTTP server; drain and stop on SIGTERM.

Order matters for Kubernetes probes and for clients: the port opens only after the core has
loaded the model and reported its KV capacity, and on SIGTERM the server stops accepting,
lets in-flight requests finish (bounded by --drain-timeout), ends the rest with a clear error,
stops the core process, and exits 0.

With `--api-server-count N` > 1 this process is the launcher (`api.server.launcher`): it starts
the cores and N API server processes, each running `serve_http` below on the shared socket.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import logging
import signal
import sys
from typing import Awaitable, TypeVar

import prometheus_client
import uvicorn

from pagoda_engine.api.tokenizer import load_chat_template
from pagoda_engine.config import EngineConfig, add_engine_args, add_request_limit_args, config_from_args
from pagoda_engine.envs import check_environment
from pagoda_engine.errors import ModelLoadError

T = TypeVar("T")

logger = logging.getLogger("pagoda_engine.api.server")


def add_chat_output_args(parser: argparse.ArgumentParser) -> None:
    """Chat templating, tool calling and reasoning (vLLM's flags and parser names)."""
    parser.add_argument("--chat-template", default=None,
                        help="the chat template: a file, or the Jinja template itself (default: the model's)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide when to call tools (tool_choice \"auto\"); needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the format the model writes tool calls in: hermes | llama3_json | mistral")
    parser.add_argument("--reasoning-parser", default=None,
                        help="split the model's <think> reasoning into the `reasoning` field: qwen3 | deepseek_r1")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help="with tool_choice \"none\", do not show the tools to the chat template")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer <key>` on /v1/* (default: PAGODA_API_KEY, else no key)")
    parser.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served")
    add_api_server_count_arg(parser)
    add_request_limit_args(parser)
    add_chat_output_args(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def add_api_server_count_arg(parser: argparse.ArgumentParser) -> None:
    """`pagoda serve`'s and `pagoda bench serve`'s (which passes it to the server it starts)."""
    parser.add_argument("--api-server-count", "-asc", type=int, default=1,
                        help="API server processes sharing the port, each connected to every engine core "
                             "(tokenization, detokenization and streaming spread over N CPU cores); "
                             "a --headless node runs none and refuses N > 1 (default 1)")


class _DrainingServer(uvicorn.Server):
    """uvicorn, plus: on the first SIGTERM/SIGINT refuse new work and bound the drain. An API
    process under a launcher ignores SIGINT: the launcher owns shutdown, and a terminal's Ctrl-C
    reaches the whole process group."""

    def __init__(self, config: uvicorn.Config, on_exit, ignore_sigint: bool = False):
        super().__init__(config)
        self._on_exit = on_exit
        self._draining = False
        self._ignore_sigint = ignore_sigint

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and self._ignore_sigint:
            return
        if not self._draining:
            self._draining = True
            # Signal handlers run between bytecodes of the main thread: hop onto the loop.
            asyncio.get_event_loop().call_soon_threadsafe(self._on_exit)
        super().handle_exit(sig, frame)


async def serve(args: argparse.Namespace, config: EngineConfig) -> int:
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
    return await serve_http(engine, args.log_level)


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
    the launcher's shared listening socket (else bind host:port); `api_server_index`: this
    process's index under a launcher, sent as the X-Pagoda-API-Server header of every response."""
    from pagoda_engine.api.server.app import create_app
    from pagoda_engine.api.server.errors import ServiceUnavailableError

    config = engine.config
    drain_timeout = config.server.drain_timeout_s

    async def drain() -> None:
        engine.accepting = False
        if engine.num_in_flight:
            logger.info("draining %d in-flight request(s), up to %.0fs", engine.num_in_flight, drain_timeout)
        if not await engine.wait_idle(drain_timeout):
            logger.warning("drain timeout: ending %d request(s)", engine.num_in_flight)
            engine.abort_all(ServiceUnavailableError(
                "The server is shutting down and could not finish this request in time.", code="shutting_down"))

    drain_tasks: list[asyncio.Task] = []
    app = create_app(engine, api_key=config.server.api_key)
    headers = [] if api_server_index is None else [(API_SERVER_HEADER, str(api_server_index))]
    logger.info("HTTP: %s event loop, %s parser", *http_stack().values())
    uv_config = uvicorn.Config(app, host=config.server.host, port=config.server.port, log_level=log_level,
                               lifespan="off", timeout_graceful_shutdown=int(drain_timeout) + 5, access_log=False,
                               headers=headers)
    server = _DrainingServer(uv_config, on_exit=lambda: drain_tasks.append(asyncio.ensure_future(drain())),
                             ignore_sigint=sock is not None)
    # uvicorn re-raises the signal that stopped it once it has shut down; with these handlers in
    # place that is a no-op, and the process stops the core and exits 0. (Before this point the
    # default handlers apply: SIGTERM during model loading simply ends the process, and the
    # core follows its parent.)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        await server.serve(sockets=None if sock is None else [sock])  # exits the process with 1 if the port cannot be bound
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
    CPU per streamed token (benchmarks.md, ninth and twenty-seventh sessions)."""
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


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # *_created series are noise on every scrape (vLLM has none)
    try:
        config = config_from_args(args)
        config.server.chat_template = load_chat_template(config.server.chat_template)
        check_environment()
    except (ValueError, TypeError) as e:  # invalid engine flags (EngineConfig.validate) or PAGODA_* numbers
        print(f"pagoda serve: {e}", file=sys.stderr)
        return 2
    if config.parallel.headless and config.parallel.data_parallel_across_nodes:  # this node's engine cores
        from pagoda_engine.api.server.dp_nodes import serve_data_parallel_headless

        return serve_data_parallel_headless(config)
    if config.parallel.headless:  # a node other than the leader: only its ranks, no API server
        from pagoda_engine.worker.executor import serve_headless

        return serve_headless(config)
    if config.server.api_server_count > 1:
        from pagoda_engine.api.server.launcher import launch

        return launch(args, config)
    try:
        return run_event_loop(serve(args, config))
    except KeyboardInterrupt:  # Ctrl-C while the model was loading (the core is stopped already)
        print("pagoda serve: interrupted", file=sys.stderr)
        return 130

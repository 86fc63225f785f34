"""`pagoda serve`: its command line and which processes this invocation runs.

The flags are the configuration's own (`config.add_engine_args`, `config.add_server_args`: one
contract, which the operator reads too) plus --log-level. `run` checks them and the PAGODA_*
environment (exit 2 naming what is wrong), binds the listening port before any model loads
(a taken port: exit 2 naming the address, at once), and dispatches:

- a `--headless` node of data-parallel engine cores on several nodes: its cores (`api.server.dp_nodes`);
- any other `--headless` node: only its ranks (`worker.executor.serve_headless`);
- `--api-server-count` N > 1: the launcher, its engine cores and N API server processes on the
  bound socket (`api.server.launcher`);
- else one process: the engine core(s), then the HTTP server on the bound socket (`api.server.api_server`).

The package's entry module: it may import any layer, and no layer imports it (only `pagoda bench
serve`, another verb, which starts a `pagoda serve` of its own through it). Torch-free at import,
since the operator builds `pagoda serve`'s parser from it: the layers load in `run`.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from pagoda_engine.config import EngineConfig, add_engine_args, add_server_args, config_from_args
from pagoda_engine.envs import check_environment

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag `pagoda serve` takes."""
    add_engine_args(parser)
    add_server_args(parser)
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, bound (not yet listening: connections are refused until the
    server is ready) and inheritable by the launcher's API server processes, as uvicorn binds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _check(args: argparse.Namespace) -> EngineConfig:
    """The configuration the flags and environment ask for; ValueError (or TypeError) says what is wrong."""
    from pagoda_engine.api.tokenizer import load_chat_template

    config = config_from_args(args)
    config.server.chat_template = load_chat_template(config.server.chat_template)
    check_environment()
    return config


def run(args: argparse.Namespace) -> int:
    import prometheus_client

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prometheus_client.disable_created_metrics()  # *_created series are noise on every scrape (vLLM has none)
    try:
        config = _check(args)
    except (ValueError, TypeError) as e:  # invalid engine flags (EngineConfig.validate) or PAGODA_* numbers
        print(f"pagoda serve: {e}", file=sys.stderr)
        return 2
    parallel = config.parallel
    if parallel.headless and parallel.data_parallel_across_nodes:  # this node's engine cores
        from pagoda_engine.api.server.dp_nodes import serve_data_parallel_headless

        return serve_data_parallel_headless(config)
    if parallel.headless:  # a node other than the leader: only its ranks, no API server
        from pagoda_engine.worker.executor import serve_headless

        return serve_headless(config)
    server = config.server
    try:
        sock = bind_socket(server.host, server.port)
    except OSError as e:
        print(f"pagoda serve: cannot listen on {server.host}:{server.port}: {e.strerror or e}", file=sys.stderr,
              flush=True)
        return 2
    if server.api_server_count > 1:
        from pagoda_engine.api.server.launcher import launch

        return launch(config, args.log_level, sock)
    from pagoda_engine.api.server.api_server import serve_one_process

    return serve_one_process(config, args.log_level, sock)

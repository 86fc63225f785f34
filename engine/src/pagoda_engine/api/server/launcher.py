"""`pagoda serve --api-server-count N` (N > 1): this process serves no HTTP; on the port `pagoda
serve` bound, it starts the engine cores and N API server processes, watches them all, and owns
shutdown.

    launcher ── host:port, bound once ──► API server 0..N-1 (spawned, each `serve_http` on the
       │                                  inherited socket: a FastAPI/uvicorn OpenAI server with
       │                                  its own tokenizer, detokenizer and SSE; client index i)
       └── spawns engine core 0..M-1 ◄──ZMQ──► every API server (`core_client.CoreAddresses`)

The socket: bound by `pagoda serve` before any model loads (a taken port fails at once), and inherited by
every API process; each one's event loop calls listen() on it once its engine is ready, so the
port opens when the first API process can serve. All of them accept from the one queue, the
kernel handing each connection to whichever process calls accept() first: a busy process (its
loop is streaming) takes fewer. That is uvicorn's `--workers` and vLLM's scheme; SO_REUSEPORT
would instead hash connections onto per-process queues regardless of load, let any process of
the same user join the port, and lose the connections queued on a process that dies.

Each core serves every API process: a request carries its process's index, and the core sends
its outputs and refusals back to that process alone, its stats to all (`core.process`). Each API
process picks the least-loaded core itself (`dp_client`). /metrics of any process reports the
whole pod (`metrics`: prometheus_client's multiprocess mode in PROMETHEUS_MULTIPROC_DIR, set
here before any API process starts; a temporary directory unless the user set one).

Failures: a core that dies is reported by this process, which alone sees its exit, to every API
process (a CoreFailed on that core's socket to it): each one's /health answers 503, as with one
process. An API process that dies takes the server down: the others are stopped, then the cores,
and `pagoda serve` exits 1 (vLLM's behaviour), never a silent half-server.

Shutdown: on SIGTERM or SIGINT every API process gets SIGTERM and drains (--drain-timeout); once
they have exited the cores get ShutdownRequest; exit 0. A second signal kills the API processes
at once. Every child dies with this process if it is killed (`processes.die_with_parent`).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile

import zmq

from pagoda_engine.api.server.core_client import CoreAddresses, CoreProcess, IpcNames
from pagoda_engine.api.server.dp_client import lockstep_config, rank_config
from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.messages import CoreFailed, ShutdownRequest, make_encoder
from pagoda_engine.processes import die_with_parent

logger = logging.getLogger("pagoda_engine.api.server")

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_CORE_REPORT_GRACE_S = 5.0  # a core that exits during start-up: how long to wait for its own error
_CRASH_STOP_S = 5.0  # after an API process died: how long the others get before they are killed
_CORE_STOP_S = 10.0


def launch(config: EngineConfig, log_level: str, sock: socket.socket) -> int:
    """Serve on `sock` (bound, not listening) until shut down; the exit status."""
    metrics_dir = _metrics_dir()
    try:
        return asyncio.run(Launcher(config, log_level).run(sock))
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _metrics_dir() -> str | None:
    """Set PROMETHEUS_MULTIPROC_DIR for the API processes; the directory made here (to remove at
    exit), or None when the user set one (which must be emptied between runs, as vLLM says)."""
    if os.environ.get(MULTIPROC_DIR_ENV):
        logger.warning("%s is set: the API processes' metrics go there; empty it between runs of the server",
                       MULTIPROC_DIR_ENV)
        return None
    path = tempfile.mkdtemp(prefix="pagoda-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = path
    return path


class Launcher:
    def __init__(self, config: EngineConfig, log_level: str):
        self.config = lockstep_config(config)
        self.log_level = log_level
        self.num_servers = config.server.api_server_count
        self.names = IpcNames()
        self.addresses = [self.names.addresses(self.num_servers, control=True)
                          for _ in range(config.parallel.data_parallel_size)]
        self.cores: list[CoreProcess] = []
        self.servers: list[multiprocessing.process.BaseProcess] = []
        self.ctx = zmq.Context()
        self.control: list[zmq.Socket] = []
        self.encoder = make_encoder()
        self.stopping = False
        self._drain_deadline: asyncio.Future | None = None
        self._events: asyncio.Queue = asyncio.Queue()  # ("signal", sig) | ("core", rank, code) | ("server", i, code)

    async def run(self, sock: socket.socket) -> int:
        loop = asyncio.get_running_loop()
        server = self.config.server
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._events.put_nowait, ("signal", sig))
        try:
            reports = self._start(sock)
            sock.close()  # each API process holds its own copy
            code = await self._wait_ready(reports)
            if code is None:
                logger.info("%d API server processes serving on http://%s:%d (press CTRL+C to quit)",
                            self.num_servers, server.host, server.port)
                code = await self._supervise()
            return code
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self._stop_all()

    # --- start-up -----------------------------------------------------------------------------
    def _start(self, sock: socket.socket) -> list[asyncio.Future]:
        """Spawn the cores and the API processes; one future per API process for its report."""
        loop = asyncio.get_running_loop()
        for rank, addresses in enumerate(self.addresses):
            control = self.ctx.socket(zmq.PUSH)
            control.setsockopt(zmq.LINGER, 0)
            control.bind(addresses.control)
            self.control.append(control)
            core = CoreProcess(rank_config(self.config, rank), addresses,
                               on_exit=lambda code, rank=rank: self._events.put_nowait(("core", rank, code)))
            core.start()
            self.cores.append(core)
        mp = multiprocessing.get_context("spawn")
        reports = []
        for index in range(self.num_servers):
            receive, send = mp.Pipe(duplex=False)
            proc = mp.Process(target=run_api_server, name=f"pagoda-api-server-{index}",
                              args=(self.config, self.log_level, sock, self.addresses, index, send, os.getpid()))
            proc.start()
            send.close()
            self.servers.append(proc)
            loop.add_reader(proc.sentinel, self._on_server_exit, index)
            reports.append(_read_report(receive))
        return reports

    def _on_server_exit(self, index: int) -> None:
        proc = self.servers[index]
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1)  # its sentinel closes a moment before it can be reaped
        self._events.put_nowait(("server", index, proc.exitcode))

    async def _wait_ready(self, reports: list[asyncio.Future]) -> int | None:
        """None once every API process reported ready; else the exit code, the reason printed."""
        pending = set(reports)
        events = asyncio.ensure_future(self._events.get())
        core_exit: str | None = None
        try:
            while pending:
                waits = {*pending, events}
                deadline = _CORE_REPORT_GRACE_S if core_exit else None
                done, _ = await asyncio.wait(waits, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # a core died and no API process said why
                    return self._failed(core_exit)
                for report in done & pending:
                    pending.discard(report)
                    status, message = report.result()
                    if status != "ready":
                        return self._failed(message)
                    if report is reports[0]:
                        print(message, flush=True)
                if events in done:
                    event = events.result()
                    events = asyncio.ensure_future(self._events.get())
                    match event:
                        case ("signal", sig):
                            print("pagoda serve: interrupted", file=sys.stderr, flush=True)
                            return 130 if sig == signal.SIGINT else 0
                        case ("core", rank, code):
                            core_exit = core_exit or f"engine core {rank} exited during start-up (exit code {code})"
                        case ("server", index, code):
                            # It reports its own start-up error before it exits; give that a moment.
                            report = reports[index]
                            if not report.done():
                                await asyncio.wait({report}, timeout=1.0)
                            if report.done() and report.result()[0] != "ready":
                                return self._failed(report.result()[1])
                            return self._failed(f"API server process {index} exited during start-up (exit code {code})")
            return None
        finally:
            events.cancel()

    @staticmethod
    def _failed(reason: str) -> int:
        print(f"pagoda serve: the engine could not start: {reason}", file=sys.stderr, flush=True)
        return 1

    # --- serving ------------------------------------------------------------------------------
    async def _supervise(self) -> int:
        forced = False
        while True:
            match await self._events.get():
                case ("signal", _):
                    if self.stopping:
                        if not forced:
                            logger.warning("second signal: stopping the API server processes now")
                            forced = True
                            self._signal_servers(signal.SIGKILL)
                        continue
                    self.stopping = True
                    self._signal_servers(signal.SIGTERM)
                    self._drain_deadline = asyncio.ensure_future(self._after_drain())
                case ("server", index, code):
                    if self.stopping:
                        if not any(p.is_alive() for p in self.servers):
                            return 0
                        continue
                    logger.error("API server process %d exited unexpectedly (exit code %s): stopping the server",
                                 index, code)
                    self.stopping = True
                    self._signal_servers(signal.SIGTERM)
                    await self._join_servers(_CRASH_STOP_S)
                    return 1
                case ("core", rank, code):
                    if not self.stopping:
                        self._report_dead_core(rank, f"the engine core process exited unexpectedly (exit code {code})")

    async def _after_drain(self) -> None:
        """Kill API processes that outlive their drain (uvicorn's graceful timeout is drain + 5 s)."""
        await asyncio.sleep(self.config.server.drain_timeout_s + 15)
        self._signal_servers(signal.SIGKILL)

    def _report_dead_core(self, rank: int, reason: str) -> None:
        """Tell every API process, on its socket from that core, as the core would have."""
        logger.error("engine core %d died: %s", rank, reason)
        frame = self.encoder.encode(CoreFailed(error_type="EngineDeadError", message=reason))
        for output in self.addresses[rank].outputs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(output)
            sock.send(frame)
            sock.close()

    def _signal_servers(self, sig: int) -> None:
        for proc in self.servers:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    async def _join_servers(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(p.is_alive() for p in self.servers) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self._signal_servers(signal.SIGKILL)
        for proc in self.servers:
            await loop.run_in_executor(None, proc.join, 5)

    async def _stop_all(self) -> None:
        """API processes first (they may still be draining), then the cores; nothing outlives this."""
        loop = asyncio.get_running_loop()
        for proc in self.servers:
            try:
                loop.remove_reader(proc.sentinel)
            except (ValueError, OSError):
                pass
        self.stopping = True
        if any(p.is_alive() for p in self.servers):
            self._signal_servers(signal.SIGTERM)
            await self._join_servers(self.config.server.drain_timeout_s + 15)
        for control, core in zip(self.control, self.cores):
            if core.is_alive():
                try:
                    control.send(self.encoder.encode(ShutdownRequest()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        await asyncio.gather(*(core.join(_CORE_STOP_S) for core in self.cores))
        for core in self.cores:
            core.kill()
        for sock in self.control:
            sock.close(linger=0)
        self.ctx.term()
        self.names.close()


def _read_report(receive) -> asyncio.Future:
    """The one message an API process sends at start-up: ("ready", capacity line) or ("failed",
    reason); ("failed", ...) too when it exits without one."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def on_readable() -> None:
        loop.remove_reader(receive.fileno())
        try:
            message = receive.recv()
        except (EOFError, OSError):
            message = ("failed", "an API server process exited during start-up")
        finally:
            receive.close()
        if not future.done():
            future.set_result(message)

    loop.add_reader(receive.fileno(), on_readable)
    return future


# --- an API server process ----------------------------------------------------------------------

def run_api_server(config: EngineConfig, log_level: str, sock: socket.socket, addresses: list[CoreAddresses],
                   index: int, report, parent_pid: int) -> None:
    """Process entry point: API server `index`, serving on the inherited `sock`."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns shutdown (see the module docstring)
    _set_process_name(f"pagoda-api-{index}")
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s api{index} %(name)s: %(message)s")
    import prometheus_client

    from pagoda_engine.api.server.api_server import run_event_loop

    prometheus_client.disable_created_metrics()
    sys.exit(run_event_loop(_serve(config, log_level, sock, addresses, index, report)))


async def _serve(config: EngineConfig, log_level: str, sock: socket.socket, addresses: list[CoreAddresses],
                 index: int, report) -> int:
    from pagoda_engine.api.server.api_server import capacity_line, serve_http
    from pagoda_engine.api.server.async_engine import AsyncEngine

    engine = AsyncEngine(config, attach=addresses, api_server_index=index)
    try:
        ready = await engine.start()
    except ModelLoadError as e:
        report.send(("failed", str(e)))
        return 1
    gc.freeze()  # as `api_server.serve`
    report.send(("ready", capacity_line(config, ready, engine.served_model_name)))
    report.close()
    return await serve_http(engine, log_level, sock=sock, api_server_index=index)


def _set_process_name(name: str) -> None:
    """The name `ps -o comm` and /proc/PID/comm show (Linux), so the API processes can be told
    from the cores."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except OSError:
            pass

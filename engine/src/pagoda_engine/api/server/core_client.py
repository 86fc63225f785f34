"""The API process's side of the engine core: spawns the core process, performs the start-up
handshake, sends requests and aborts, and hands every message the core pushes back to callbacks
on the event loop. Knows sockets and processes, nothing about HTTP or text.

The core is a `spawn`ed process (never forked: the API process has threads and an event loop).
Its exit is noticed at once through the process sentinel on the event loop, so a dead core turns
into `EngineDeadError` for every waiting request instead of a hang.

With several API server processes (`--api-server-count N`, `api.server.launcher`) the launcher
spawns the cores (`CoreProcess`) and each API process attaches to every core: a client that binds
its own pair of sockets (`CoreAddresses`, client index i), stamps its requests with i, and learns of
a dead core from a CoreFailed message (the core's own, or the launcher's when the process exited).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import uuid
from dataclasses import dataclass
from typing import Callable

import zmq
import zmq.asyncio

from pagoda_engine.api.server.dp_links import watch_connection, with_heartbeats
from pagoda_engine.config import EngineConfig
from pagoda_engine.core import process as core_proc
from pagoda_engine.errors import EngineDeadError, ModelLoadError
from pagoda_engine.messages import (
    AbortRequest,
    CoreFailed,
    CoreReady,
    EngineCoreError,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    LoRAUpdate,
    LoRAUpdateReply,
    ProfileReply,
    ProfileRequest,
    ShutdownRequest,
    StartDPWave,
    make_decoder,
    make_encoder,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreAddresses:
    """Where one engine core meets its API server processes: client i binds inputs[i] (its
    requests) and outputs[i] (what the core sends it); the core connects to all of them. A
    launcher that serves no HTTP itself binds `control`, which the core's input also connects to."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    control: str | None = None

    def client(self, index: int) -> tuple[str, str]:
        return self.inputs[index], self.outputs[index]


class IpcNames:
    """Fresh ipc addresses for this process's cores; `close()` removes what they left on disk."""

    def __init__(self):
        self._dir: str | None = None

    def new(self, what: str) -> str:
        if sys.platform.startswith("linux"):
            # Abstract-namespace sockets: nothing on disk to leak when a process is SIGKILLed.
            return f"ipc://@pagoda-core-{os.getpid()}-{uuid.uuid4().hex[:12]}-{what}"
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="pagoda-core-")
        return f"ipc://{os.path.join(self._dir, f'{uuid.uuid4().hex[:12]}-{what}')}"

    def addresses(self, num_clients: int, control: bool = False) -> CoreAddresses:
        return CoreAddresses(inputs=tuple(self.new(f"input{i}") for i in range(num_clients)),
                             outputs=tuple(self.new(f"output{i}") for i in range(num_clients)),
                             control=self.new("control") if control else None)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


class CoreProcess:
    """One engine core process: spawned with the addresses of all its clients; its exit is
    reported once through `on_exit(exit code)` on the event loop."""

    def __init__(self, config: EngineConfig, addresses: CoreAddresses, on_exit: Callable[[int | None], None]):
        self.config = config
        self.addresses = addresses
        self.on_exit = on_exit
        self.exited: asyncio.Future | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None

    def start(self) -> None:
        inputs = [*self.addresses.inputs, *([self.addresses.control] if self.addresses.control else [])]
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(target=core_proc.run_engine_core,
                                name=f"pagoda-engine-core-{self.config.parallel.data_parallel_rank}",
                                args=(self.config, inputs, list(self.addresses.outputs), os.getpid(),
                                      logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        loop = asyncio.get_running_loop()
        self.exited = loop.create_future()
        loop.add_reader(self._proc.sentinel, self._on_sentinel)

    def _on_sentinel(self) -> None:
        asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        self._proc.join(1)  # its sentinel closes a moment before it can be reaped
        if not self.exited.done():
            self.exited.set_result(self._proc.exitcode)
        self.on_exit(self._proc.exitcode)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode if self._proc is not None else None

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    async def join(self, timeout: float) -> None:
        """Wait up to `timeout` for the process to exit, then kill it."""
        proc = self._proc
        if proc is None:
            return
        if self.exited is not None and not self.exited.done():
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), timeout)
            except asyncio.TimeoutError:
                logger.warning("engine core did not exit within %.0fs; killing it", timeout)
        if proc.is_alive():
            proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 5)

    def kill(self) -> None:
        if self._proc is None:
            return
        try:
            asyncio.get_running_loop().remove_reader(self._proc.sentinel)
        except (ValueError, OSError, RuntimeError):
            pass
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


class EngineCoreClient:
    """One engine core and this process's two sockets to it.

    `start()` spawns the core (one API process: it owns the core); `attach()` joins a core the
    launcher spawned, as client `client_index` of `addresses`.

    Callbacks (all called on the event loop): `on_outputs(EngineCoreOutputs)`,
    `on_refused(EngineCoreError)`, `on_dead(message)`.
    """

    def __init__(self, config: EngineConfig, *, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_refused: Callable[[EngineCoreError], None], on_dead: Callable[[str], None],
                 addresses: CoreAddresses | None = None, client_index: int = 0):
        self.config = config
        self.on_outputs = on_outputs
        self.on_refused = on_refused
        self.on_dead = on_dead
        self.client_index = client_index
        self.ready: CoreReady | None = None
        self.dead_reason: str | None = None
        self._stopping = False
        self._encoder = make_encoder()
        self._decoder = make_decoder(FromCore)
        self._ctx: zmq.asyncio.Context | None = None
        self._in: zmq.asyncio.Socket | None = None
        self._out: zmq.asyncio.Socket | None = None
        self._names = IpcNames()
        self._addresses = addresses
        self._process: CoreProcess | None = None
        self._remote: str | None = None  # a core on another node: which (`attach_remote`)
        self._watcher: asyncio.Task | None = None
        self._reader: asyncio.Task | None = None
        self._profile_replies: collections.deque[asyncio.Future] = collections.deque()  # in request order
        self._lora_replies: collections.deque[asyncio.Future] = collections.deque()  # in request order

    # --- life cycle ---------------------------------------------------------------------------
    async def start(self) -> CoreReady:
        """Spawn the core and wait until it has loaded the model. Raises ModelLoadError (or the
        typed error the core reported) when it cannot start."""
        self._addresses = self._names.addresses(1)
        self._bind()
        self._process = CoreProcess(self.config, self._addresses, on_exit=self._on_process_exit)
        self._process.start()
        return await self._handshake(self._process.exited)

    async def attach(self) -> CoreReady:
        """Join the core the launcher spawned and wait for its ready message (the launcher stops
        this process if the core dies first)."""
        self._bind()
        return await self._handshake(asyncio.get_running_loop().create_future())

    async def attach_remote(self, where: str, timeout_s: float) -> CoreReady:
        """Wait for a core on another node (`dp_nodes`), `where` naming it, to connect to this
        client's TCP addresses and report ready within `timeout_s`. Its connection dropping
        (heartbeats bound the wait) fails the start, or later marks it dead."""
        self._remote = where
        self._bind()
        with_heartbeats(self._out)
        self._in.setsockopt(zmq.LINGER, 2000)  # its ShutdownRequest reaches it after we close
        loop = asyncio.get_running_loop()
        lost = loop.create_future()

        def down() -> None:
            if self.ready is None and not lost.done():
                lost.set_result(f"{where} disconnected during start-up (its node's log says why)")
            elif self.ready is not None and not self._stopping:
                self._mark_dead(f"{where} disconnected (its process or node is gone)")

        self._watcher = asyncio.create_task(watch_connection(self._out, lambda: None, down))
        timer = loop.call_later(timeout_s, lambda: lost.done() or lost.set_result(
            f"{where} did not connect and report ready within {timeout_s:g} s (PAGODA_DIST_TIMEOUT_S); "
            "is its node running `pagoda serve --headless` with the same flags?"))
        try:
            return await self._handshake(lost)
        finally:
            timer.cancel()

    def _bind(self) -> None:
        input_addr, output_addr = self._addresses.client(self.client_index)
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.SNDHWM, 0)  # never drop or block a request; the core bounds the work
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(input_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.RCVHWM, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(output_addr)

    async def _handshake(self, exited: asyncio.Future) -> CoreReady:
        first = asyncio.ensure_future(self._out.recv())
        try:
            await asyncio.wait({first, exited}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (Ctrl-C while the model loads): leave nothing behind
            first.cancel()
            await asyncio.shield(self._cleanup())
            raise
        if not first.done():
            first.cancel()
            await self._cleanup()
            reason = exited.result()  # an exit code, or what became of a core on another node
            raise ModelLoadError(reason if isinstance(reason, str) else
                                 f"the engine core exited during start-up (exit code {reason})")
        message = self._decoder.decode(first.result())
        if isinstance(message, CoreFailed):
            if self._process is not None:
                await self._process.join(timeout=10)
            await self._cleanup()
            raise ModelLoadError(f"{message.error_type}: {message.message}")
        if not isinstance(message, CoreReady):
            await self.shutdown()
            raise ModelLoadError(f"the engine core sent {type(message).__name__} before its ready message")
        self.ready = message
        self._reader = asyncio.create_task(self._read_loop(), name="pagoda-core-reader")
        return self.ready

    def _on_process_exit(self, exitcode: int | None) -> None:
        if self.ready is not None and not self._stopping:
            self._mark_dead(f"the engine core process exited unexpectedly (exit code {exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("engine dead: %s", reason)
            for future in (*self._profile_replies, *self._lora_replies):
                if not future.done():
                    future.set_exception(EngineDeadError(reason))
            self._profile_replies.clear()
            self._lora_replies.clear()
            self.on_dead(reason)

    async def _read_loop(self) -> None:
        while True:
            try:
                frame = await self._out.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            try:
                match self._decoder.decode(frame):
                    case EngineCoreOutputs() as outputs:
                        self.on_outputs(outputs)
                    case EngineCoreError() as refused:
                        self.on_refused(refused)
                    case CoreFailed() as failed:
                        self._mark_dead(failed.message)
                    case ProfileReply() as reply:
                        if self._profile_replies:
                            future = self._profile_replies.popleft()
                            if not future.done():
                                future.set_result(reply)
                    case LoRAUpdateReply() as reply:
                        if self._lora_replies:
                            future = self._lora_replies.popleft()
                            if not future.done():
                                future.set_result(reply)
                    case other:
                        logger.error("unexpected %s from the engine core", type(other).__name__)
            except Exception:
                # A bug in output handling must not stop the reader (every request would hang).
                logger.exception("failed to handle a message from the engine core")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to exit, wait up to `timeout`, then kill it; an attached client only
        closes its sockets (the launcher stops the core). Idempotent."""
        self._stopping = True
        if (self._process is not None and self._process.is_alive()) or (self._remote and self.dead_reason is None
                                                                        and self._in is not None):
            try:
                self._send(ShutdownRequest())
            except zmq.ZMQError:
                pass
            if self._process is not None:
                await self._process.join(timeout)
        await self._cleanup()

    async def _cleanup(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._reader = self._watcher = None
        if self._process is not None:
            self._process.kill()
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close(linger=2000 if sock is self._in and self._remote else 0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._in = self._out = None
        self._names.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # --- requests -----------------------------------------------------------------------------
    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._in is None:
            raise EngineDeadError("the engine core is not running")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_alive()
        if self.client_index:
            request.client_index = self.client_index
        self._send(request)

    def start_dp_wave(self) -> None:
        """Wake this core for a step with its siblings (experts across cores; `StartDPWave`)."""
        if self.dead_reason is None and self._in is not None:
            self._send(StartDPWave())

    def abort_requests(self, request_ids: list[str]) -> None:
        # Aborts are best effort: after the core died there is nothing left to free.
        if request_ids and self.dead_reason is None and self._in is not None:
            self._send(AbortRequest(request_ids=list(request_ids), client_index=self.client_index))

    async def profile(self, start: bool, tag: str = "") -> ProfileReply:
        """Start (files named with `tag`) or stop torch.profiler on every rank of this core, and
        wait for the core to answer: after a stop, every trace is written."""
        self.check_alive()
        future = asyncio.get_running_loop().create_future()
        self._profile_replies.append(future)
        self._send(ProfileRequest(start=start, tag=tag, client_index=self.client_index))
        return await future

    async def update_lora(self, update: LoRAUpdate) -> LoRAUpdateReply:
        """Load or unload a LoRA adapter on this core, and wait for its answer."""
        self.check_alive()
        future = asyncio.get_running_loop().create_future()
        self._lora_replies.append(future)
        update.client_index = self.client_index
        self._send(update)
        return await future

    def _send(self, message) -> None:
        # Synchronous on purpose (callers include `finally` blocks of cancelled tasks): with an
        # unlimited high-water mark the send completes immediately.
        fut = self._in.send(self._encoder.encode(message), copy=False)
        if isinstance(fut, asyncio.Future):
            fut.add_done_callback(_log_send_failure)


def _log_send_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("send to the engine core failed: %s", fut.exception())

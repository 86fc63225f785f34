"""The engine core process: loads an `EngineCore`, then runs its busy loop between two ZMQ sockets.

Every message, both ways, is one frame: a `messages.ToCore` / `messages.FromCore` struct, encoded
with msgpack (the message list is in `messages.py`). The core decodes `ToCore` and dispatches on
the type; it sends CoreReady (or CoreFailed) once at start-up, then EngineCoreOutputs after every
step, EngineCoreError for a refused request, and CoreFailed when a step raises. A ProfileRequest
(/start_profile, /stop_profile) runs between two steps and is answered with a ProfileReply.

The core serves one or more API server processes (`pagoda serve --api-server-count N`): its one
input socket is connected to every client's input address (and, with N > 1, to the launcher's, which
only ever sends ShutdownRequest), and it has one output socket per client. A request carries its
client's index; its outputs and a refusal go to that client alone, while every step's stats and
the start-up and failure messages go to all (each API process routes by them and exports them).
With one client everything goes to it.

The loop never spins: with nothing to run it blocks on the input socket (waking once a second to
check that its parent is still alive, so it never outlives the API process). A bad request is
refused on its own; only a failure inside `step()` ends the process.

When the MoE layers' experts span the pod's data-parallel cores, every forward is a collective
of all cores, so they step in lockstep (`run_lockstep`, vLLM's DP waves): each turn of the loop
every core first agrees with the others, in one gloo all-reduce, whether any core has work; if
one has, every core runs one forward, its own step or, with nothing to run, a dummy batch. When
none has, each waits for input up to a second before the next agreement (a StartDPWave, sent by
the API server with every request to the other cores, ends the wait at once), so an idle pod
costs one tiny all-reduce a second and never spins. A ShutdownRequest is agreed on the same way,
so that the cores leave together. A core that dies breaks the others' collectives (gloo sees the
closed connections), and they fail instead of waiting for it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.messages import (AbortRequest, CoreFailed, CoreReady, EngineCoreError, EngineCoreOutputs,
                                    EngineCoreRequest, LoRAUpdate, LoRAUpdateReply, ProfileReply, ProfileRequest,
                                    ShutdownRequest, StartDPWave, ToCore, make_decoder, make_encoder)
from pagoda_engine.profiler import ProfilerAlreadyError, ProfilerStateError
from pagoda_engine.processes import die_with_parent, pause_collections_for_start_up

logger = logging.getLogger(__name__)

_PARENT_CHECK_S = 1.0


class CoreLoop:
    """The busy loop around one EngineCore. Separate from process start-up so it can be driven
    by anything that owns the sockets."""

    def __init__(self, core, in_sock: zmq.Socket, out_socks: list[zmq.Socket], parent_pid: int | None):
        self.core = core
        self.in_sock = in_sock
        # One per API server process, in client-index order.
        self.out_socks = out_socks
        self.parent_pid = parent_pid
        self.encoder = make_encoder()
        self.decoder = make_decoder(ToCore)
        self.running = True
        self._client_of: dict[str, int] = {}  # request id -> the client that sent it (several clients only)
        self._last_parent_check = time.monotonic()
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)

    def send(self, message) -> None:
        """To every client: start-up, failure and idle-stats messages."""
        frame = self.encoder.encode(message)
        for sock in self.out_socks:
            sock.send(frame, copy=False)

    def publish(self, outputs: EngineCoreOutputs) -> None:
        """A step's outputs: each request's to the client that sent it, the stats to every client."""
        if len(self.out_socks) == 1:
            self.out_socks[0].send(self.encoder.encode(outputs), copy=False)
            return
        by_client: list[list] = [[] for _ in self.out_socks]
        for output in outputs.outputs:
            client = (self._client_of.pop(output.request_id, 0) if output.finish_reason is not None
                      else self._client_of.get(output.request_id, 0))
            by_client[client].append(output)
        for sock, mine in zip(self.out_socks, by_client):
            if mine or outputs.stats is not None:
                sock.send(self.encoder.encode(EngineCoreOutputs(outputs=mine, stats=outputs.stats)), copy=False)

    def _refuse(self, refused: EngineCoreError, client: int | None = None) -> None:
        if client is None:
            client = self._client_of.pop(refused.request_id, 0)
        self.out_socks[client].send(self.encoder.encode(refused), copy=False)

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _handle(self, frame: bytes) -> None:
        try:
            message = self.decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("undecodable message dropped: %s", e)
            return
        match message:
            case EngineCoreRequest():
                self._add(message)
            case AbortRequest():
                request_ids = message.request_ids
                if len(self.out_socks) > 1:  # a client stops its own requests, never another's of the same id
                    request_ids = [r for r in request_ids if self._client_of.get(r) == message.client_index]
                    for request_id in request_ids:
                        del self._client_of[request_id]
                try:
                    self.core.abort_requests(request_ids)
                except Exception:
                    logger.exception("abort failed")
            case ShutdownRequest():
                self.running = False
            case StartDPWave():
                pass  # its arrival ended the wait for input: the next agreement starts the wave
            case ProfileRequest():
                self._profile(message)
            case LoRAUpdate():
                self._update_lora(message)

    def _update_lora(self, message: LoRAUpdate) -> None:
        """Load or unload a LoRA adapter between two steps; the reply goes to the client that asked."""
        if not 0 <= message.client_index < len(self.out_socks):
            logger.error("LoRA update from unknown client %d dropped", message.client_index)
            return
        try:
            if message.unload is not None:
                reply = LoRAUpdateReply(missing=not self.core.remove_lora(message.unload))
            else:
                self.core.add_lora(message.lora)
                reply = LoRAUpdateReply()
        except (ValueError, InvalidRequestError) as e:  # LoRAAdapterError is a ValueError
            reply = LoRAUpdateReply(error=str(e))
        self.out_socks[message.client_index].send(self.encoder.encode(reply), copy=False)

    def _profile(self, message: ProfileRequest) -> None:
        """Start or stop profiling between two steps; the reply goes to the client that asked."""
        if not 0 <= message.client_index < len(self.out_socks):
            logger.error("profile request from unknown client %d dropped", message.client_index)
            return
        try:
            if message.start:
                self.core.start_profile(message.tag)
                reply = ProfileReply()
            else:
                reply = ProfileReply(paths=self.core.stop_profile())
        except ProfilerStateError as e:
            reply = ProfileReply(error=str(e), already=isinstance(e, ProfilerAlreadyError))
        self.out_socks[message.client_index].send(self.encoder.encode(reply), copy=False)

    def _add(self, req: EngineCoreRequest) -> None:
        client = req.client_index
        if not 0 <= client < len(self.out_socks):
            logger.error("request %s from unknown client %d dropped", req.request_id, client)
            return
        try:
            self.core.add_request(req)
        except Exception as e:  # any refusal, typed or not, is this request's alone
            param = getattr(e, "param", None)
            message = getattr(e, "message", None) or str(e) or type(e).__name__
            if not hasattr(e, "param"):
                logger.exception("core refused request %s with an unexpected error", req.request_id)
            self._refuse(EngineCoreError(request_id=req.request_id, message=message, param=param), client)
            return
        if len(self.out_socks) > 1:
            self._client_of[req.request_id] = client

    def _drain_input(self, timeout_ms: int) -> bool:
        """Handle every message waiting (after waiting up to timeout_ms for the first).
        Returns whether anything came in."""
        got = False
        if not self.poller.poll(timeout_ms):
            return False
        while True:
            try:
                frame = self.in_sock.recv(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got
            got = True
            self._handle(frame.buffer)

    def _parent_gone_since_last_check(self) -> bool:
        """While stepping: at most once a second, whether the parent has gone (then log it)."""
        now = time.monotonic()
        if now - self._last_parent_check <= _PARENT_CHECK_S:
            return False
        self._last_parent_check = now
        if self._parent_alive():
            return False
        logger.error("parent process is gone; engine core exiting")
        return True

    def run(self) -> None:
        if getattr(self.core, "in_lockstep", False):
            self.run_lockstep()
            return
        publish_early = getattr(self.core, "publish_early", None)
        if publish_early is not None:
            publish_early(self.publish)  # a step's tokens leave as soon as it has ended on the device
        while self.running:
            if self.core.has_unfinished_requests():
                self._drain_input(0)
                while self.running and (delay := self.core.launch_delay()) >= 0.001:
                    self._drain_input(int(delay * 1000))  # arrivals join the step about to be scheduled
                if not self.running:
                    break
                if self.core.has_unfinished_requests():
                    self.publish(self.core.step())
                    for refused in self.core.take_refused():
                        self._refuse(refused)
                    if not self.core.has_unfinished_requests():
                        # Gone idle: the last step's stats were taken before its requests left.
                        self.send(EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))
                else:
                    self.send(EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))
                if self._parent_gone_since_last_check():
                    return
            else:
                if self._drain_input(int(_PARENT_CHECK_S * 1000)):
                    if not self.core.has_unfinished_requests():
                        # Aborts (or refusals) only: publish the idle state for /metrics.
                        self.send(EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))
                elif not self._parent_alive():
                    logger.error("parent process is gone; engine core exiting")
                    return
                else:
                    self.core.check_alive()  # a rank that died while idle fails the core now, not at the next request
                    if getattr(self.core, "release_expired", bool)():  # pages held for remote decode
                        self.send(EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))

    def run_lockstep(self) -> None:
        """The loop of a core whose experts span the pod's cores (see the module docstring)."""
        core = self.core
        wave = False  # some core had work at the last agreement
        while True:
            busy_here = core.has_unfinished_requests()
            got = self._drain_input(0 if wave or busy_here else int(_PARENT_CHECK_S * 1000))
            # The API server stops every core; they leave together, so none waits for another
            # in a collective that core has left.
            busy, stopping = core.agree_with_cores(stopping=not self.running)
            if stopping:
                return
            if busy == 0:
                if wave or got:  # the wave ended, or aborts only: publish the idle state for /metrics
                    self.send(EngineCoreOutputs(outputs=[], stats=core.get_stats()))
                wave = False
                core.check_alive()
            else:
                wave = True
                core.lockstep_forward(self._publish_lockstep)
            if self._parent_gone_since_last_check():
                return

    def _publish_lockstep(self, outputs: EngineCoreOutputs) -> None:
        """A lockstep turn's outputs, and the idle state once they were the core's last (as `run`)."""
        self.publish(outputs)
        if not self.core.has_unfinished_requests():
            self.send(EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))


def run_engine_core(config: EngineConfig, input_addrs: list[str], output_addrs: list[str], parent_pid: int,
                    log_level: int = logging.INFO) -> None:
    """Process entry point (multiprocessing target). Exits 0 after a ShutdownRequest, 1 on failure.
    The input socket connects to every address of `input_addrs`; output_addrs[i] is client i's."""
    die_with_parent(parent_pid)
    # The API process owns shutdown: Ctrl-C in a terminal reaches the whole process group, and
    # the core must keep serving while the API process drains. The parent stops us explicitly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s core %(name)s: %(message)s")

    ctx = zmq.Context(io_threads=1)
    in_sock = ctx.socket(zmq.PULL)
    for addr in input_addrs:
        in_sock.connect(addr)
    out_socks = []
    for addr in output_addrs:
        out_socks.append(ctx.socket(zmq.PUSH))
        out_socks[-1].setsockopt(zmq.LINGER, 5000)
        out_socks[-1].connect(addr)
    loop = CoreLoop(None, in_sock, out_socks, parent_pid)
    code = 0
    try:
        try:
            pause_collections_for_start_up()  # back on at the end of EngineCore's start (`resume_collections`)
            # Before torch is imported: the executor's own decision comes later (`create_executor`).
            from pagoda_engine.worker.compile_ahead import start_compile_pool_early

            start_compile_pool_early(config)
            from pagoda_engine.core.engine_core import EngineCore

            core = EngineCore(config)
            # This process and its worker ranks serve this engine alone: what start-up made
            # stays, out of the collector's reach (the offline LLM leaves its user's process alone).
            core.executor.collective_rpc("freeze_gc_heap")
        except Exception as e:
            logger.error("engine core failed to start: %s", e)
            loop.send(CoreFailed(error_type=type(e).__name__, message=str(e)))
            code = 1
            return
        loop.send(CoreReady(
            kv_capacity_tokens=int(core.kv_capacity_tokens), max_model_len=int(core.max_model_len),
            vocab_size=int(core.vocab_size), model_dir=str(core.model_dir),
            served_model_name=str(core.served_model_name), num_kv_pages=int(core.num_kv_pages),
            block_size=int(config.cache.block_size)))
        loop.core = core
        try:
            loop.run()
            core.wait_for_offload()  # pages on their way to disk or Redis get there (bounded: the stores time out)
        except Exception as e:
            logger.error("engine core step failed:\n%s", traceback.format_exc())
            loop.send(CoreFailed(error_type=type(e).__name__, message=f"engine core failed: {e}"))
            code = 1
    finally:
        in_sock.close(linger=0)
        # After a ShutdownRequest from a launcher its API processes are gone: nothing left to deliver.
        linger = 0 if code == 0 and len(out_socks) > 1 else None
        for sock in out_socks:
            sock.close(linger=linger)
        ctx.term()
        # Skip interpreter teardown (torch, worker threads): the parent is waiting on our exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

"""The engine core process: loads an `EngineCore`, then runs its busy loop between two ZMQ sockets.

Wire protocol (both directions are two-frame multipart messages: a one-byte kind, then a msgpack
body encoded by msgspec):

  API -> core (PUSH/PULL, `input_addr`):
    ADD      EngineCoreRequest
    ABORT    AbortRequest
    SHUTDOWN (empty body): finish the loop and exit 0
  core -> API (PUSH/PULL, `output_addr`):
    READY    CoreReady            once, after the model and KV pool are up
    FAILED   CoreFailed           once, instead of READY, when start-up fails (then exit 1)
    OUTPUTS  EngineCoreOutputs    after every step, and once more when it goes idle (fresh stats)
    REFUSED  EngineCoreError      a request the core would not take (the core keeps serving)
    QUEUED   QueueTimes           seconds each newly scheduled request waited (for /metrics)
    FATAL    CoreFailed           `step()` raised: the core cannot continue and exits 1

The loop never spins: with nothing to run it blocks on the input socket (waking once a second to
check that its parent is still alive, so it never outlives the API process). A bad request is
refused on its own; only a failure inside `step()` ends the process.
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
from pagoda_engine.messages import AbortRequest, EngineCoreError, EngineCoreOutputs, EngineCoreRequest
from pagoda_engine.processes import die_with_parent

logger = logging.getLogger(__name__)

# Frame kinds.
ADD, ABORT, SHUTDOWN = b"A", b"X", b"S"
READY, FAILED, OUTPUTS, REFUSED, QUEUED, FATAL = b"R", b"F", b"O", b"E", b"Q", b"D"

_PARENT_CHECK_S = 1.0


class CoreReady(msgspec.Struct, kw_only=True, array_like=True):
    kv_capacity_tokens: int
    max_model_len: int
    vocab_size: int
    model_dir: str
    served_model_name: str
    num_kv_pages: int
    block_size: int


class QueueTimes(msgspec.Struct, array_like=True):
    seconds: list[float]


class CoreFailed(msgspec.Struct, kw_only=True, array_like=True):
    error_type: str  # the exception's class name, e.g. ModelLoadError
    message: str


class CoreLoop:
    """The busy loop around one EngineCore. Separate from process start-up so it can be driven
    by anything that owns the sockets."""

    def __init__(self, core, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int | None):
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_pid = parent_pid
        self.encoder = msgspec.msgpack.Encoder()
        self.request_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.abort_decoder = msgspec.msgpack.Decoder(AbortRequest)
        self.running = True
        # Requests not yet scheduled -> when they arrived here (queue time is measured in the core,
        # the only place that knows when a request was first scheduled).
        self._queued_since: dict[str, float] = {}
        self.poller = zmq.Poller()
        self.poller.register(in_sock, zmq.POLLIN)

    def send(self, kind: bytes, body) -> None:
        self.out_sock.send_multipart([kind, self.encoder.encode(body)], copy=False)

    def _parent_alive(self) -> bool:
        return self.parent_pid is None or os.getppid() == self.parent_pid

    def _handle(self, kind: bytes, body: bytes) -> None:
        if kind == ADD:
            try:
                req = self.request_decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("undecodable request dropped: %s", e)
                return
            try:
                self.core.add_request(req)
                self._queued_since[req.request_id] = time.monotonic()
            except Exception as e:  # any refusal, typed or not, is this request's alone
                param = getattr(e, "param", None)
                message = getattr(e, "message", None) or str(e) or type(e).__name__
                if not hasattr(e, "param"):
                    logger.exception("core refused request %s with an unexpected error", req.request_id)
                self.send(REFUSED, EngineCoreError(request_id=req.request_id, message=message, param=param))
        elif kind == ABORT:
            try:
                self.core.abort_requests(self.abort_decoder.decode(body).request_ids)
            except Exception:
                logger.exception("abort failed")
        elif kind == SHUTDOWN:
            self.running = False
        else:
            logger.error("unknown message kind %r dropped", kind)

    def _drain_input(self, timeout_ms: int) -> bool:
        """Handle every message waiting (after waiting up to timeout_ms for the first).
        Returns whether anything came in."""
        got = False
        if not self.poller.poll(timeout_ms):
            return False
        while True:
            try:
                kind, body = self.in_sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return got
            got = True
            self._handle(kind, body)

    def _report_queue_times(self, step_start: float, outputs: EngineCoreOutputs) -> None:
        produced = {o.request_id for o in outputs.outputs}
        live = getattr(getattr(self.core, "scheduler", None), "requests", {})
        waited = []
        for rid, since in list(self._queued_since.items()):
            req = live.get(rid)
            if rid in produced or (req is not None and req.num_computed_tokens > 0):
                waited.append(max(0.0, step_start - since))
                del self._queued_since[rid]
            elif req is None:  # aborted before it ever ran
                del self._queued_since[rid]
        if waited:
            self.send(QUEUED, QueueTimes(waited))

    def run(self) -> None:
        last_parent_check = time.monotonic()
        while self.running:
            if self.core.has_unfinished_requests():
                self._drain_input(0)
                if not self.running:
                    break
                if self.core.has_unfinished_requests():
                    step_start = time.monotonic()
                    outputs: EngineCoreOutputs = self.core.step()
                    self.send(OUTPUTS, outputs)
                    if self._queued_since:
                        self._report_queue_times(step_start, outputs)
                    if not self.core.has_unfinished_requests():
                        # Gone idle: the last step's stats were taken before its requests left.
                        self.send(OUTPUTS, EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))
                else:
                    self.send(OUTPUTS, EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))
                now = time.monotonic()
                if now - last_parent_check > _PARENT_CHECK_S:
                    last_parent_check = now
                    if not self._parent_alive():
                        logger.error("parent process is gone; engine core exiting")
                        return
            else:
                if self._drain_input(int(_PARENT_CHECK_S * 1000)):
                    if not self.core.has_unfinished_requests():
                        # Aborts (or refusals) only: publish the idle state for /metrics.
                        self.send(OUTPUTS, EngineCoreOutputs(outputs=[], stats=self.core.get_stats()))
                elif not self._parent_alive():
                    logger.error("parent process is gone; engine core exiting")
                    return


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: int = logging.INFO) -> None:
    """Process entry point (multiprocessing target). Exits 0 after SHUTDOWN, 1 on failure."""
    die_with_parent(parent_pid)
    # The API process owns shutdown: Ctrl-C in a terminal reaches the whole process group, and
    # the core must keep serving while the API process drains. The parent stops us explicitly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s core %(name)s: %(message)s")

    ctx = zmq.Context(io_threads=1)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 5000)
    out_sock.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        try:
            from pagoda_engine.core.engine_core import EngineCore

            core = EngineCore(config)
        except Exception as e:
            logger.error("engine core failed to start: %s", e)
            out_sock.send_multipart([FAILED, encoder.encode(CoreFailed(error_type=type(e).__name__, message=str(e)))])
            code = 1
            return
        out_sock.send_multipart([READY, encoder.encode(CoreReady(
            kv_capacity_tokens=int(core.kv_capacity_tokens), max_model_len=int(core.max_model_len),
            vocab_size=int(core.vocab_size), model_dir=str(core.model_dir),
            served_model_name=str(core.served_model_name), num_kv_pages=int(core.num_kv_pages),
            block_size=int(config.cache.block_size)))])
        loop = CoreLoop(core, in_sock, out_sock, parent_pid)
        try:
            loop.run()
        except Exception as e:
            logger.error("engine core step failed:\n%s", traceback.format_exc())
            out_sock.send_multipart([FATAL, encoder.encode(CoreFailed(error_type=type(e).__name__,
                                                                      message=f"engine core failed: {e}"))])
            code = 1
    finally:
        in_sock.close(linger=0)
        out_sock.close()
        ctx.term()
        # Skip interpreter teardown (torch, worker threads): the parent is waiting on our exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

"""The engine core's KV-event publisher: vLLM's `ZmqEventPublisher` (wire format in `kv_events`).

A thread owns the sockets (ZMQ sockets are not thread-safe): the core's step loop only puts a
batch on a bounded queue, so a slow subscriber or a full queue never stalls a step (a batch that
does not fit is dropped and logged, as a PUB socket past its high-water mark drops too; the
sequence numbers let a subscriber see the gap and ask the replay endpoint for it).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from itertools import count

import msgspec
import zmq

from pagoda_engine.kv_event_wire import END_SEQ, KVCacheEvent, KVEventBatch
from pagoda_engine.kv_events import KVEventsConfig, endpoint_for_rank

logger = logging.getLogger(__name__)

_POLL_S = 0.05


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address or a local transport binds (the stable side); else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.data_parallel_rank = data_parallel_rank
        self.endpoint = endpoint_for_rank(config.endpoint, data_parallel_rank)
        self.replay_endpoint = endpoint_for_rank(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"--kv-events-config: cannot open {self.endpoint} / {self.replay_endpoint}: {e}") from None
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s", self.endpoint,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One step's events as one batch (nothing when there are none)."""
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("KV events: the publisher's queue is full; %d batches dropped", self._dropped)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seqs = count()
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = next(seqs), encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:
                logger.warning("KV events: sending batch %d failed: %s", seq, e)
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """A subscriber's `(identity, b"", start_seq)`: every buffered batch from there, then the end mark."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

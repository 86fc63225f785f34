"""The connections between the leader's API server and engine cores on other nodes
(`dp_nodes`): the ports the leader binds for each remote core, ZMQ heartbeats that bound how long a
vanished host goes unnoticed, watching a socket's one peer come and go, and the leader's port that
every other node keeps a connection to."""

from __future__ import annotations

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagoda_engine.config import EngineConfig

HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 10000


def core_ports(config: EngineConfig, rank: int) -> tuple[int, int]:
    """The leader's (requests, outputs) ports for core `rank`."""
    base = config.parallel.data_parallel_rpc_port
    return base + 1 + 2 * rank, base + 2 + 2 * rank


def with_heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


async def watch_connection(sock: zmq.asyncio.Socket, on_up, on_down) -> None:
    """Call `on_up()` when `sock` gains a peer connection and `on_down()` when one drops (after
    which the socket has none: each of these sockets has one peer). Runs until cancelled."""
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                on_down()
            else:
                on_up()
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


class LeaderListener:
    """The leader's port P, to which every other node keeps a connection: its dropping tells that
    node the leader is gone."""

    def __init__(self, config: EngineConfig):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        with_heartbeats(self.sock)
        self.sock.bind(f"tcp://*:{config.parallel.data_parallel_rpc_port}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

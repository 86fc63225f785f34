"""Data-parallel engine cores on several nodes (`--data-parallel-size D --nnodes N`, vLLM's
multi-node data parallelism): each node runs D / N whole engine cores, each core's tensor ×
pipeline parallel ranks on its own node, and the leader's API server (`--node-rank 0`) reaches
them all.

    leader: API server ──ipc──► its own cores 0 .. D/N - 1 (spawned as on one node)
       │  binds tcp://*:P             (liveness: every other node keeps a connection here)
       │  binds tcp://*:P+1+2r, P+2+2r (core r's requests and outputs, r ≥ D/N)
       ▼
    node k (`--headless --node-rank k`): spawns cores k·D/N .. (k+1)·D/N - 1, which connect to
       the leader at --data-parallel-address (default --master-addr) and port P
       (--data-parallel-rpc-port)

A core on another node is an `EngineCoreClient` of the leader like any other, over TCP. With
experts across the cores (`--enable-expert-parallel`) they meet in core 0's store at the leader's
address on --master-port (default 29501) and step in lockstep as on one node.

Failures, both ways, bounded by ZMQ heartbeats (a host that vanishes without closing its
connections is noticed within `HEARTBEAT_TIMEOUT_MS`):
- a remote core that exits or whose node goes away drops its connection: the leader marks it dead
  and /health answers 503, as for a local core; a core that never connects fails the start after
  PAGODA_DIST_TIMEOUT_S, naming it;
- a headless node whose leader goes away (its connection to port P drops), or never comes, stops
  its cores and exits 1; after the leader's ShutdownRequest its cores exit 0 and so does it (the
  leader's connection may drop first: the cores get `_SHUTDOWN_GRACE_S` to finish).
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pagoda_engine.api.server.core_client import CoreAddresses, CoreProcess
from pagoda_engine.api.server.dp_client import lockstep_config, rank_config
from pagoda_engine.api.server.dp_links import core_ports, watch_connection, with_heartbeats
from pagoda_engine.config import EngineConfig

logger = logging.getLogger("pagoda_engine.api.server")

_SHUTDOWN_GRACE_S = 10.0  # the leader's connection dropped: how long its ShutdownRequest may take to stop the cores


def serve_data_parallel_headless(config: EngineConfig) -> int:
    """`pagoda serve --headless --node-rank k` with engine cores on several nodes: run this
    node's cores until the leader shuts them down (0), or one fails or the leader goes away (1)."""
    return asyncio.run(_HeadlessNode(config).run())


class _HeadlessNode:
    def __init__(self, config: EngineConfig):
        self.config = lockstep_config(config)
        self.pc = self.config.parallel
        self.leader = f"{self.pc.dp_address}:{self.pc.data_parallel_rpc_port}"
        self.processes = {}
        self.exits: asyncio.Queue = asyncio.Queue()

    async def run(self) -> int:
        from pagoda_engine.envs import dist_timeout_s

        cores = list(self.pc.local_cores)
        logger.info("node-rank %d of %d: starting data-parallel engine cores %s for the leader at %s",
                    self.pc.node_rank, self.pc.nnodes, cores, self.leader)
        ctx = zmq.asyncio.Context()
        link = ctx.socket(zmq.DEALER)
        link.setsockopt(zmq.LINGER, 0)
        with_heartbeats(link)
        connected, gone = asyncio.Event(), asyncio.Event()
        watcher = asyncio.create_task(watch_connection(link, connected.set, gone.set))
        link.connect(f"tcp://{self.leader}")
        for rank in cores:
            requests, outputs = core_ports(self.config, rank)
            addresses = CoreAddresses(inputs=(f"tcp://{self.pc.dp_address}:{requests}",),
                                      outputs=(f"tcp://{self.pc.dp_address}:{outputs}",))
            process = CoreProcess(rank_config(self.config, rank), addresses,
                                  on_exit=lambda code, rank=rank: self.exits.put_nowait((rank, code)))
            process.start()
            self.processes[rank] = process
        try:
            return await self._supervise(connected, gone, dist_timeout_s())
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)  # its monitor socket closes before ctx.term()
            for process in self.processes.values():
                process.kill()
            link.close(linger=0)
            ctx.term()

    async def _supervise(self, connected: asyncio.Event, gone: asyncio.Event, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        leader_gone = asyncio.ensure_future(gone.wait())
        try:
            while self.processes:
                exited = asyncio.ensure_future(self.exits.get())
                wait = None if connected.is_set() else max(0.0, deadline - time.monotonic())
                done, _ = await asyncio.wait({exited, leader_gone}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if exited not in done:
                    exited.cancel()
                if exited in done:
                    rank, code = exited.result()
                    del self.processes[rank]
                    if code != 0:
                        logger.error("node-rank %d: data-parallel engine core %d exited with code %s (its log is "
                                     "above); stopping this node", self.pc.node_rank, rank, code)
                        return 1
                elif leader_gone in done:
                    # A leader that stopped gracefully sent every core ShutdownRequest first: they
                    # are on their way out (a loaded machine may take a moment).
                    if await self._all_exit_cleanly(_SHUTDOWN_GRACE_S):
                        return 0
                    logger.error("node-rank %d: the leader at %s went away; stopping this node's engine cores",
                                 self.pc.node_rank, self.leader)
                    return 1
                elif not connected.is_set():
                    logger.error("node-rank %d: the leader at %s did not come within %.0f s (PAGODA_DIST_TIMEOUT_S); "
                                 "stopping this node's engine cores", self.pc.node_rank, self.leader, timeout_s)
                    return 1
            return 0
        finally:
            leader_gone.cancel()

    async def _all_exit_cleanly(self, timeout_s: float) -> bool:
        """Whether every core still running exits with 0 within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.processes:
            try:
                rank, code = await asyncio.wait_for(self.exits.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return False
            del self.processes[rank]
            if code != 0:
                return False
        return True

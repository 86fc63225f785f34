"""The API process's side of the pod's data-parallel engine cores (`--data-parallel-size N`).

N `EngineCoreClient`s, one per core process; core i is data-parallel rank i, with its own
scheduler, KV pool and ranks (on CUDA, devices [i × TP, (i + 1) × TP)). Each user request goes
to the least-loaded core, all of its sequences (n > 1) to the same one so they share the prompt's
prefix pages; aborts go to the core that holds the request. With one core this is that core's
client and nothing more, so the server has one path.

Load is vLLM's picture of it (DPLBAsyncMPClient): waiting + running from each core's latest
stats, but never fewer than the requests this process has sent it and not seen finish (the stats
lag a burst of arrivals by a step), plus its KV usage, so that of two cores with as many requests
the emptier pool wins. Ties go round-robin.

With several API server processes (`--api-server-count N`) each one makes this choice on its own,
as vLLM's do: every core sends its stats after each step to every API process, so all of them see
the same waiting + running; between two steps each process knows only its own requests in flight,
and counts them N times (vLLM's `client_count × inflight`), as if the other processes had sent as
many. Sharing the in-flight counts would cost a message between the API processes per request for
a correction that lasts one step.

When the MoE layers' experts span the cores (`--enable-expert-parallel`), the cores step in
lockstep (`core.process.CoreLoop.run_lockstep`) and meet in a store core 0 hosts, on a port this
process picks for the pod; every request sent to one core wakes the others (`StartDPWave`), so
that an idle core joins the wave at once instead of at its next once-a-second check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from typing import Callable

import msgspec

from pagoda_engine.api.server.core_client import CoreAddresses, EngineCoreClient
from pagoda_engine.api.server.dp_links import LeaderListener, core_ports
from pagoda_engine.config import EngineConfig
from pagoda_engine.messages import (CoreReady, EngineCoreError, EngineCoreOutputs, EngineCoreRequest, LoRAUpdate,
                                    LoRAUpdateReply, SchedulerStats)
from pagoda_engine.profiler import ProfilerStateError


class DPEngineCoreClient:
    """The pod's engine cores behind one client.

    Callbacks (all called on the event loop): `on_outputs(rank, EngineCoreOutputs)`,
    `on_refused(EngineCoreError)`, `on_dead(message)` (once, for the first core that dies: the
    pod is then dead, as vLLM's engine is).
    """

    def __init__(self, config: EngineConfig, *, on_outputs: Callable[[int, EngineCoreOutputs], None],
                 on_refused: Callable[[EngineCoreError], None], on_dead: Callable[[str], None],
                 attach: list[CoreAddresses] | None = None, client_index: int = 0):
        """`attach`: join the cores the launcher spawned (one entry per rank), as API process
        `client_index` of `config.server.api_server_count`; None: spawn the cores."""
        self.size = config.parallel.data_parallel_size
        self.attached = attach is not None
        self.num_clients = config.server.api_server_count
        self.lockstep = config.parallel.expert_parallel_across_cores
        if not self.attached:
            config = lockstep_config(config)
        self.on_outputs = on_outputs
        self.on_refused = on_refused
        self.on_dead = on_dead
        self.config = config

        def addresses(rank: int) -> CoreAddresses | None:
            """A launcher's core's, a core on another node's (TCP), or None: `start()` makes its own."""
            if attach:
                return attach[rank]
            return None if rank in config.parallel.local_cores else _remote_addresses(config, rank)

        self.cores = [
            EngineCoreClient(rank_config(config, rank), on_outputs=lambda out, rank=rank: self._on_outputs(rank, out),
                             on_refused=lambda err, rank=rank: self._on_refused(rank, err),
                             on_dead=lambda reason, rank=rank: self._on_dead(rank, reason),
                             addresses=addresses(rank), client_index=client_index)
            for rank in range(self.size)
        ]
        self._listener = None  # cores on several nodes: the port the other nodes watch (`dp_nodes`)
        self.stats = [SchedulerStats() for _ in range(self.size)]
        self.dead_reason: str | None = None
        self._core_of: dict[str, int] = {}  # core request id → the rank holding it
        self._num_held = [0] * self.size  # requests sent to each core and not seen finish
        self._next_start = 0

    # --- life cycle ---------------------------------------------------------------------------
    async def start(self) -> CoreReady:
        """Start (or attach to) every core at once; the first core's ready message (they load the same model).
        When one fails, the others are stopped at once (not after their model load) and its
        error raised."""
        starts = [asyncio.ensure_future(self._start_core(rank)) for rank in range(self.size)]
        try:
            done, _ = await asyncio.wait(starts, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t.exception() for t in done if t.exception() is not None), None)
            if failed is not None:
                raise failed
        except BaseException:  # a core failed, or Ctrl-C while the models load: leave nothing behind
            for start in starts:
                start.cancel()
            await asyncio.shield(asyncio.gather(*starts, return_exceptions=True))
            await asyncio.shield(self.shutdown())
            raise
        return starts[0].result()

    async def _start_core(self, rank: int) -> CoreReady:
        core = self.cores[rank]
        if self.attached:
            return await core.attach()
        if rank in self.config.parallel.local_cores:
            return await core.start()
        from pagoda_engine.envs import dist_timeout_s

        if self._listener is None:
            self._listener = LeaderListener(self.config)
        node = rank // len(self.config.parallel.local_cores)
        return await core.attach_remote(f"the engine core on node-rank {node}", dist_timeout_s())

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(core.shutdown(timeout) for core in self.cores))
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def profile(self, start: bool, tag: str = "") -> list[str]:
        """Start or stop torch.profiler on every core at once; the paths the cores wrote (a stop).
        ProfilerStateError with the first core's reason when one refused. Except: a core that
        already was as asked, while another core did what this call asked, was reached first by
        another API process's start or stop (`--api-server-count`): every core is then as asked,
        and this call stands for the cores it moved (a stop lists only their paths)."""
        replies = await asyncio.gather(*(core.profile(start, tag) for core in self.cores))
        moved = any(reply.error is None for reply in replies)
        for rank, reply in enumerate(replies):
            if reply.error is not None and not (reply.already and moved):
                raise ProfilerStateError(reply.error if self.size == 1 else f"engine core {rank}: {reply.error}")
        return [path for reply in replies for path in reply.paths]

    async def update_lora(self, update: LoRAUpdate) -> list[LoRAUpdateReply]:
        """Load or unload a LoRA adapter on every core at once; each core's answer, in rank order."""
        return list(await asyncio.gather(*(core.update_lora(msgspec.structs.replace(update)) for core in self.cores)))

    # --- routing ------------------------------------------------------------------------------
    def load(self, rank: int) -> float:
        stats = self.stats[rank]
        return max(self.num_clients * self._num_held[rank], stats.num_waiting + stats.num_running) + stats.kv_cache_usage

    def least_loaded(self) -> int:
        """The rank the next request goes to."""
        order = [(self._next_start + i) % self.size for i in range(self.size)]
        rank = min(order, key=self.load)
        self._next_start = (rank + 1) % self.size
        return rank

    def add_requests(self, requests: list[EngineCoreRequest], rank: int) -> None:
        """Send these requests (the sequences of one prompt) to core `rank`."""
        core = self.cores[rank]
        core.check_alive()
        for request in requests:
            core.add_request(request)
            self._core_of[request.request_id] = rank
            self._num_held[rank] += 1
        if self.lockstep:
            for other, sibling in enumerate(self.cores):
                if other != rank:
                    sibling.start_dp_wave()

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._forget(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            self.cores[rank].abort_requests(ids)

    def _forget(self, request_id: str) -> int | None:
        rank = self._core_of.pop(request_id, None)
        if rank is not None:
            self._num_held[rank] -= 1
        return rank

    # --- callbacks from the cores -------------------------------------------------------------
    def _on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        if outputs.stats is not None:
            self.stats[rank] = outputs.stats
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self._forget(output.request_id)
        self.on_outputs(rank, outputs)

    def _on_refused(self, rank: int, err: EngineCoreError) -> None:
        self._forget(err.request_id)
        self.on_refused(err)

    def _on_dead(self, rank: int, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason if self.size == 1 else f"data-parallel engine core {rank}: {reason}"
            self.on_dead(self.dead_reason)


def _free_port(host: str) -> int:
    """A port free on `host` now (core 0 binds it moments later, as vLLM's get_open_port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lockstep_config(config: EngineConfig) -> EngineConfig:
    """With experts across the cores, the pod's: where the cores meet, a port picked now (on one
    node) or the leader's --master-port (cores on several nodes, which must all know it)."""
    pc = config.parallel
    if pc.expert_parallel_across_cores and pc.data_parallel_master_port is None:
        port = pc.store_port() if pc.data_parallel_across_nodes else _free_port(pc.master_addr)
        return dataclasses.replace(config, parallel=dataclasses.replace(pc, data_parallel_master_port=port))
    return config


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Core `rank`'s configuration: the pod's, with its data-parallel rank. A core of cores on
    several nodes is an engine of its node alone (its ranks meet on this host), which finds its
    siblings at the leader's address."""
    pc = config.parallel
    changes: dict = dict(data_parallel_rank=rank)
    if pc.data_parallel_across_nodes:
        changes.update(nnodes=1, node_rank=0, headless=False, master_addr="127.0.0.1", master_port=None,
                       data_parallel_address=pc.dp_address, data_parallel_local_start=pc.local_cores.start,
                       data_parallel_size_local=len(pc.local_cores))
    return dataclasses.replace(config, parallel=dataclasses.replace(pc, **changes))


def _remote_addresses(config: EngineConfig, rank: int) -> CoreAddresses:
    """The leader's TCP sockets for core `rank` on another node (`dp_links.core_ports`)."""
    requests, outputs = core_ports(config, rank)
    return CoreAddresses(inputs=(f"tcp://*:{requests}",), outputs=(f"tcp://*:{outputs}",))

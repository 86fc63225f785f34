"""A Worker with methods of its own for the collective_rpc tests; worker processes import it by
name (`probe_worker:ProbeWorker`), so it lives in a module of its own."""

import os
import socket
import time
from dataclasses import dataclass

import torch

from pagoda_engine.worker.worker import Worker


@dataclass
class Payload:
    label: str
    weights: torch.Tensor


class ProbeWorker(Worker):
    def whoami(self) -> dict:
        return {"rank": self.rank, "tp_rank": self.coordinates.tp_rank, "pid": os.getpid(),
                "host": socket.gethostname(), "group": self.tp_group.ranks if self.tp_group else None}

    def weighted_sum(self, ids: torch.Tensor, payload: Payload, scale: torch.Tensor) -> dict:
        """What this rank received, and a sum over the group that only agrees if every rank did."""
        total = self.tp_group.all_reduce((payload.weights * (self.rank + 1)).clone())
        return {"ids": ids.tolist(), "label": payload.label, "scale": scale.item(), "total": total.tolist()}

    def received(self, *tensors: torch.Tensor) -> list[tuple[list, int]]:
        """Each tensor's values and its data pointer modulo 16."""
        return [(t.tolist(), t.data_ptr() % 16) for t in tensors]

    def fail_on(self, rank: int) -> str:
        if self.rank == rank:
            raise ValueError(f"rank {rank} was told to fail")
        return "fine"

    def sleep(self, seconds: float, on_rank: int) -> None:
        if self.rank == on_rank:
            time.sleep(seconds)

    def compile_pool_processes(self) -> list[int]:
        """The pids of this rank's Triton compile pool (`start_compile_pool`), [] without one."""
        from pagoda_engine.worker import compile_ahead

        return [proc.pid for proc in compile_ahead._pool.procs] if compile_ahead._pool is not None else []

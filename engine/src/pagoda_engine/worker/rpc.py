"""The wire between the executor (rank 0, in the engine core's process) and its worker ranks:
method calls over ZMQ on TCP, their tensors over the ranks' own process group.

Rendezvous: rank 0 hosts a torch.distributed `TCPStore` at the master address and port (port 0:
a free one) and binds a ZMQ ROUTER socket on that address; it publishes the socket's endpoint and
the run's settings in the store (`publish_run`). A worker, told only the master address, port
and its rank, reads them from the store (`read_run`), connects a DEALER socket named by its rank
and says `Hello`. Nothing here assumes one host: the same store later carries the process
groups' rendezvous (gloo on CPU, NCCL on GPU).

A call is one pickled `Call` (method name, arguments, whether to reply). Tensors anywhere in the
top-level arguments or in the fields of a dataclass argument travel separately: they are replaced
by `TensorRef`s in the pickle and broadcast from rank 0 over the group, packed into one flat
tensor per dtype (a step's token ids, positions and slots are one broadcast), so the hot path
moves no tensor through pickle. Replies (`Reply`) carry a method's result or its error.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from dataclasses import dataclass
from typing import Any

import torch

from pagoda_engine.executor_types import aligned_numel

_RUN_KEY = "pagoda/run"


@dataclass
class Hello:
    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class TensorRef:
    """Stands for the `index`-th tensor of a call in its pickle."""

    index: int


@dataclass
class Call:
    seq: int
    method: str
    args: tuple
    kwargs: dict
    tensors: list[tuple[tuple[int, ...], torch.dtype]]  # shape and dtype of each TensorRef
    reply: bool


@dataclass
class Reply:
    seq: int
    rank: int
    method: str
    value: Any = None
    error: tuple[str, str, str] | None = None  # (type name, message, traceback)


# --- rendezvous ---------------------------------------------------------------------------------


def publish_run(store, settings: dict) -> None:
    """What every worker needs to join (the layout, the device type, the RPC endpoint)."""
    store.set(_RUN_KEY, json.dumps(settings))


def read_run(store) -> dict:
    return json.loads(store.get(_RUN_KEY))


def store_alive(store) -> bool:
    """Whether rank 0's store still answers (a rank on another host has no parent to die with)."""
    try:
        store.check([_RUN_KEY])
        return True
    except Exception:  # the connection is gone: torch raises DistNetworkError or another RuntimeError
        return False


def bind_address(master_addr: str) -> str:
    """ZMQ binds to an interface's address, not a host name."""
    return socket.gethostbyname(master_addr)


# --- tensors out of band ------------------------------------------------------------------------


def split_tensors(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.Tensor]]:
    """`args` and `kwargs` with every tensor (top level, or a field of a dataclass argument)
    replaced by a `TensorRef`, and the tensors in the order of their refs."""
    tensors: list[torch.Tensor] = []

    def ref(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return TensorRef(len(tensors) - 1)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changed = {f.name: ref(getattr(value, f.name)) for f in dataclasses.fields(value)
                       if f.init and isinstance(getattr(value, f.name), torch.Tensor)}
            return dataclasses.replace(value, **changed) if changed else value
        return value

    return tuple(ref(a) for a in args), {k: ref(v) for k, v in kwargs.items()}, tensors


def restore_tensors(args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
    """The inverse of `split_tensors`, given the received tensors."""

    def fill(value):
        if isinstance(value, TensorRef):
            return tensors[value.index]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changed = {f.name: tensors[getattr(value, f.name).index] for f in dataclasses.fields(value)
                       if f.init and isinstance(getattr(value, f.name), TensorRef)}
            return dataclasses.replace(value, **changed) if changed else value
        return value

    return tuple(fill(a) for a in args), {k: fill(v) for k, v in kwargs.items()}


def _by_dtype(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, (_, dtype) in enumerate(specs):
        groups.setdefault(dtype, []).append(i)
    return groups


def broadcast_tensors(group, tensors: list[torch.Tensor], device: torch.device) -> None:
    """Rank 0's side: one broadcast per dtype of the call's tensors, flattened end to end (each
    padded to `ALIGN_BYTES`)."""
    specs = [(tuple(t.shape), t.dtype) for t in tensors]
    for dtype, indices in _by_dtype(specs).items():
        parts = []
        for i in indices:
            flat = tensors[i].to(device).reshape(-1)
            parts.append(flat)
            pad = aligned_numel(flat.numel(), dtype) - flat.numel()
            if pad and len(indices) > 1:
                parts.append(flat.new_zeros(pad))
        group.broadcast(parts[0] if len(parts) == 1 else torch.cat(parts))


def receive_tensors(group, specs: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
                    ) -> list[torch.Tensor]:
    """A worker's side of `broadcast_tensors`: the call's tensors, on this rank's device, each
    starting `ALIGN_BYTES`-aligned."""
    tensors: list[torch.Tensor | None] = [None] * len(specs)
    for dtype, indices in _by_dtype(specs).items():
        sizes = [torch.Size(specs[i][0]).numel() for i in indices]
        spans = [aligned_numel(n, dtype) for n in sizes] if len(indices) > 1 else sizes
        flat = group.broadcast(torch.empty(sum(spans), dtype=dtype, device=device))
        for i, n, piece in zip(indices, sizes, flat.split(spans)):
            tensors[i] = piece[:n].view(specs[i][0])
    return tensors

"""KV-cache events as vLLM publishes them (`--kv-events-config`), so a subscriber written for
vLLM (llm-d's KV-cache indexer, the Gateway API Endpoint Picker's precise prefix scorer) reads a
Pagoda engine unchanged.

    pagoda serve --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                                       "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

The wire format is vLLM's (`vllm/distributed/kv_events.py`, since vLLM PR 42892): each ZMQ
message is three frames, `(topic, seq as 8 bytes big-endian, payload)`; the payload is a msgpack
`KVEventBatch`, an array `[ts, events, data_parallel_rank]`; each event is a map tagged by its
`type` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) whose fields come in vLLM's declaration
order, required ones always present (nil when unset), defaulted ones left out at their default.
A block hash is vLLM's integer form (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, its default): the
low 64 bits of the page's chained hash, unsigned. The replay endpoint is a ROUTER: a subscriber
sends `(b"", start_seq as 8 bytes)` and gets every buffered batch from there as
`(b"", seq, payload)`, then `(b"", -1 as 8 signed bytes, b"")`.

Torch- and msgspec-free (the operator reads the config's flag): the wire structs are in
`kv_event_wire`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagoda_engine.errors import PagodaError
from pagoda_engine.json_config import json_object

class InvalidKVEventsConfigError(PagodaError, ValueError):
    """A KV events config that names an unknown field or a value Pagoda cannot honour."""


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig`: its fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" or "null"; "zmq" is taken when events are enabled and none is named
    endpoint: str = "tcp://*:5557"  # "*" (or ipc://, inproc://): bind; else connect
    replay_endpoint: str | None = None  # a ROUTER bound there answers replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_FIELDS = {f.name: f for f in fields(KVEventsConfig)}


def parse_kv_events_config(value: Any) -> KVEventsConfig:
    """A checked KVEventsConfig from JSON text, a dict or a KVEventsConfig (None: off). Raises
    InvalidKVEventsConfigError (a ValueError) naming the field that is wrong."""
    if value is None:
        return KVEventsConfig()
    if not isinstance(value, KVEventsConfig):
        value = json_object(value, InvalidKVEventsConfigError, flag="--kv-events-config", name="--kv-events-config",
                            known=_FIELDS)
        if value.get("enable_kv_cache_events") is True and "publisher" not in value:
            value = {**value, "publisher": "zmq"}  # vLLM's choice when events are on and no publisher is named
        value = KVEventsConfig(**value)
    return _checked(value)


def _checked(config: KVEventsConfig) -> KVEventsConfig:
    def fault(name: str, what: str) -> InvalidKVEventsConfigError:
        return InvalidKVEventsConfigError(f"--kv-events-config: {name} must be {what}, got {getattr(config, name)!r}")

    if not isinstance(config.enable_kv_cache_events, bool):
        raise fault("enable_kv_cache_events", "true or false")
    if config.publisher not in ("zmq", "null"):
        raise fault("publisher", '"zmq" or "null"')
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise fault(name, "a whole number >= 1")
    if not isinstance(config.topic, str):
        raise fault("topic", "a string")
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(config, name)
        if value is None and name == "replay_endpoint":
            continue
        if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise fault(name, "a ZMQ address: tcp://host:port, ipc://path or inproc://name")
        if value.startswith("tcp://") and not value.rpartition(":")[2].isdigit():
            raise fault(name, "tcp://host:port with a port number")
    if config.publisher == "zmq" and not config.enable_kv_cache_events:
        raise InvalidKVEventsConfigError('--kv-events-config: publisher "zmq" publishes nothing without '
                                         '"enable_kv_cache_events": true')
    return config


def endpoint_for_rank(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's `offset_endpoint_port`: data-parallel rank r publishes on the TCP port + r
    (inproc: the name with `_dp<r>`), so each core of a pod has its own stream."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}"
    return endpoint

"""vLLM's KV-event wire structs (`vllm/distributed/kv_events.py`, field for field; the format is
described in `kv_events`): what the engine core publishes and the router's index reads."""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM's media (`vllm/distributed/kv_events.py`): the device pool, host memory, and storage below
# it (its OffloadingConnector's file-system tier; llm-d's indexer lowercases any medium into a tier).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message


def block_hash_int(page_hash: bytes) -> int:
    """vLLM's integer form of a block hash: the low 64 bits, unsigned."""
    return int.from_bytes(page_hash[-8:], "big")



class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """An event: a msgpack map, its `type` the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: the keys its hash took besides tokens
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None

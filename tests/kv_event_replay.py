"""Replaying an engine's KV events (`kv_event_wire`'s objects, as the core's publisher gets them)
in order: what a subscriber such as llm-d's KV-cache indexer believes one medium holds."""

from __future__ import annotations

from pagoda_engine.kv_event_wire import block_hash_int


def replayed(events: list, medium: str) -> set[int]:
    """The block hashes `events` leave stored in `medium`."""
    held: set[int] = set()
    for e in events:
        if e.medium == medium:
            held = held | set(e.block_hashes) if type(e).__name__ == "BlockStored" else held - set(e.block_hashes)
    return held


def held_hashes(keys) -> set[int]:
    """The integer form of a tier's or the pool's page keys, as the events carry them."""
    return {block_hash_int(key) for key in keys}

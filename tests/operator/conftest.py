"""Fixtures shared by the operator tests."""

from __future__ import annotations

import dataclasses

import pytest

from pagoda_operator import engine_capabilities


@pytest.fixture
def engine_with_multi_node(monkeypatch):
    """The operator as it will be once the engine implements multi-node serving (the capability
    table's entry flipped): for tests of the LeaderWorkerSet mechanics, which are ready before
    the engine feature is."""
    feature = dataclasses.replace(engine_capabilities.BY_KEY["multi-node"], implemented=True)
    monkeypatch.setitem(engine_capabilities.BY_KEY, "multi-node", feature)


@pytest.fixture
def engine_with_kv_tiers(monkeypatch):
    """The operator as it is once the engine implements the KV offload tiers (the capability
    table's entries flipped; a no-op when the engine's table already has them)."""
    for key in engine_capabilities.TIER_FEATURES.values():
        feature = dataclasses.replace(engine_capabilities.BY_KEY[key], implemented=True)
        monkeypatch.setitem(engine_capabilities.BY_KEY, key, feature)

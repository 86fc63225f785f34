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


@pytest.fixture
def apiserver_missing_crds():
    """An emulated API server without the optional CRDs (the inference extension's, Gateway API's,
    LeaderWorkerSet), and an operator that rechecks missing CRDs every second, so a test installs
    one and sees it noticed without a spec change."""
    from tests.operator.apiserver import BackgroundApiServer
    from tests.operator.test_operator_kmock import Operator

    apiserver = BackgroundApiServer()
    operator = Operator(apiserver, recheck_crds_seconds=1)
    operator.start()
    yield apiserver
    operator.stop()
    apiserver.close()

"""`worker/compile_ahead.py` off CUDA: the block is told not to run its compile-only pass, and
Triton's launch is left as it was; the engine core's question, whether Triton's cache is empty
(the GPU side: tests/gpu/test_compile_ahead_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from pagoda_engine.worker.compile_ahead import compile_ahead, triton_cache_is_empty


def test_off_cuda_the_block_is_skipped_and_launches_stay_launches():
    from triton.runtime.jit import JITFunction

    launch, do_compile = JITFunction.run, JITFunction._do_compile
    with compile_ahead(torch.device("cpu"), "a CPU forward") as ahead:
        assert ahead is False
        assert JITFunction.run is launch and JITFunction._do_compile is do_compile
    assert JITFunction.run is launch and JITFunction._do_compile is do_compile


def test_a_block_not_enabled_is_skipped_on_cuda_too():
    with compile_ahead(torch.device("cuda", 0), "a warm cache's forward", enabled=False) as ahead:
        assert ahead is False


@pytest.fixture
def cache_env(monkeypatch, tmp_path):
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch, tmp_path


def test_a_missing_or_empty_cache_directory_is_empty(cache_env):
    monkeypatch, tmp_path = cache_env
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "not-made-yet"))
    assert triton_cache_is_empty()
    (tmp_path / "not-made-yet").mkdir()
    assert triton_cache_is_empty()


def test_a_cache_holding_one_kernel_is_not_empty(cache_env):
    monkeypatch, tmp_path = cache_env
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    (tmp_path / "Q3PYZ2ABCDEF").mkdir()
    assert not triton_cache_is_empty()


def test_triton_home_places_the_cache_under_it(cache_env):
    monkeypatch, tmp_path = cache_env
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert triton_cache_is_empty()
    (tmp_path / ".triton" / "cache" / "Q3PYZ2ABCDEF").mkdir(parents=True)
    assert not triton_cache_is_empty()


def test_a_cache_manager_of_its_own_is_never_taken_for_empty(cache_env):
    monkeypatch, tmp_path = cache_env
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_is_empty()
    monkeypatch.setenv("TRITON_REMOTE_CACHE_BACKEND", "triton.runtime.cache:RedisRemoteCacheBackend")
    assert not triton_cache_is_empty()

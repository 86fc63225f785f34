"""`worker/compile_ahead.py` off CUDA: the block is told not to run its compile-only pass, and
Triton's launch is left as it was; the engine core's question, whether Triton's cache is empty;
the pool of compile processes, which compiles for a GPU without one (the GPU side:
tests/gpu/test_compile_ahead_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from pagoda_engine.worker.compile_ahead import compile_ahead, triton_cache_is_empty
from pagoda_engine.worker.compile_worker import CompileJob


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
    (tmp_path / "Q3PYZ2ABCDEF" / "_fill_kernel.json").write_text("{}")
    assert not triton_cache_is_empty()


def test_the_driver_module_alone_or_a_key_not_written_yet_is_no_kernel(cache_env):
    """The pool's processes build Triton's driver module (`cuda_utils`) as they start, and Triton
    makes a key's directory when it first looks it up: neither is a compiled kernel."""
    monkeypatch, tmp_path = cache_env
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    (tmp_path / "DRIVERKEY").mkdir()
    (tmp_path / "DRIVERKEY" / "cuda_utils.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (tmp_path / "LOOKEDUPKEY").mkdir()
    (tmp_path / "WRITINGKEY" / "tmp.pid_7_abc").mkdir(parents=True)
    assert triton_cache_is_empty()
    (tmp_path / "KERNELKEY").mkdir()
    (tmp_path / "KERNELKEY" / "_silu_and_mul_kernel.cubin").write_bytes(b"")
    assert not triton_cache_is_empty()


def test_triton_home_places_the_cache_under_it(cache_env):
    monkeypatch, tmp_path = cache_env
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert triton_cache_is_empty()
    (tmp_path / ".triton" / "cache" / "Q3PYZ2ABCDEF").mkdir(parents=True)
    (tmp_path / ".triton" / "cache" / "Q3PYZ2ABCDEF" / "_fill_kernel.cubin").write_bytes(b"")
    assert not triton_cache_is_empty()


def test_a_cache_manager_of_its_own_is_never_taken_for_empty(cache_env):
    monkeypatch, tmp_path = cache_env
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_is_empty()
    monkeypatch.setenv("TRITON_REMOTE_CACHE_BACKEND", "triton.runtime.cache:RedisRemoteCacheBackend")
    assert not triton_cache_is_empty()


def _silu_and_mul_job(block: int) -> CompileJob:
    from triton.backends.compiler import GPUTarget

    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "d": "i32", "x_stride": "i32", "out_stride": "i32",
                 "BLOCK": "constexpr", "PDL": "constexpr"}
    return CompileJob("pagoda_engine.worker.model.silu_and_mul_triton", "_silu_and_mul_kernel", signature,
                      {"BLOCK": block, "PDL": False}, {}, {}, GPUTarget("cuda", 90, 32))


_COMPILE_AND_REPORT = """
import pickle, sys, triton
from pagoda_engine.worker.compile_worker import compile_job
hits = []
triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
compile_job(pickle.load(sys.stdin.buffer))
print(hits)
"""


def test_the_pool_compiles_into_the_cache_that_a_launch_then_loads(monkeypatch, tmp_path):
    """No GPU is needed to compile for one: the pool's processes compile variants of a shipped
    kernel for Hopper into Triton's cache, and the same variant compiled again by another process
    is then a cache hit (what the engine's own launch does after `compile_ahead`). Another process:
    tests run this one's kernels under Triton's interpreter."""
    import pickle
    import subprocess
    import sys

    from pagoda_engine.worker.compile_ahead import CompilePool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = CompilePool(2)
    try:
        assert pool.compile([_silu_and_mul_job(256), _silu_and_mul_job(512), _silu_and_mul_job(1024)]) == []
    finally:
        pool.close()
    assert all(proc.returncode == 0 for proc in pool.procs)
    assert len(list(tmp_path.iterdir())) == 3
    again = subprocess.run([sys.executable, "-c", _COMPILE_AND_REPORT], input=pickle.dumps(_silu_and_mul_job(512)),
                           capture_output=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    assert again.stdout.decode().split() == ["[True]"]


def test_a_variant_the_pool_cannot_compile_is_reported_not_raised(monkeypatch, tmp_path):
    from dataclasses import replace

    from pagoda_engine.worker.compile_ahead import CompilePool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = CompilePool(1)
    try:
        errors = pool.compile([replace(_silu_and_mul_job(256), qualname="_no_such_kernel"), _silu_and_mul_job(256)])
    finally:
        pool.close()
    assert len(errors) == 1 and "_no_such_kernel" in errors[0] and "AttributeError" in errors[0]
    assert len(list(tmp_path.iterdir())) == 1  # the good variant still compiled


def test_an_engine_core_process_without_a_gpu_starts_no_pool_early(monkeypatch, tmp_path):
    """`core.process` starts the pool before its imports only where the CUDA driver shows a GPU
    (asked through the driver library, without torch): not on this machine, nor with --device cpu."""
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core.process import _start_compile_pool_early
    from pagoda_engine.worker import compile_ahead
    from pagoda_engine.worker.compile_worker import cuda_capability

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # empty
    if cuda_capability() is not None:
        pytest.skip("this machine has a GPU")
    for device in ("auto", "cpu"):
        _start_compile_pool_early(EngineConfig.from_kwargs(model="pagoda-tiny", device=device))
        assert compile_ahead._pool is None

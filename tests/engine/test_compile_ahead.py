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
    """The engine core process starts the pool before its imports (`start_compile_pool_early`)
    only where the CUDA driver shows a GPU (asked through the driver library, without torch): not
    on this machine, nor with --device cpu."""
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.worker import compile_ahead
    from pagoda_engine.worker.compile_ahead import start_compile_pool_early
    from pagoda_engine.worker.compile_worker import cuda_capability

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # empty
    if cuda_capability() is not None:
        pytest.skip("this machine has a GPU")
    for device in ("auto", "cpu"):
        start_compile_pool_early(EngineConfig.from_kwargs(model="pagoda-tiny", device=device))
        assert compile_ahead._pool is None


def test_submitted_jobs_compile_before_the_pool_is_waited_for(monkeypatch, tmp_path):
    """`compile_ahead` submits each variant as its launch notes it: the processes compile it while
    the block goes on, not only once it has ended."""
    import time

    from pagoda_engine.worker.compile_ahead import CompilePool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = CompilePool(2)
    try:
        pool.submit(_silu_and_mul_job(256))
        pool.submit(_silu_and_mul_job(512))
        deadline = time.monotonic() + 120
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(list(tmp_path.iterdir())) == 2, "nothing compiled before wait()"
        assert pool.wait() == []
        pool.submit(_silu_and_mul_job(1024))  # a second round on the same processes
        assert pool.wait() == []
    finally:
        pool.close()
    assert len(list(tmp_path.iterdir())) == 3


def test_the_jobs_of_a_dead_worker_go_to_the_others_or_fail_where_none_is_left(monkeypatch, tmp_path, caplog):
    """A worker's end is logged, not counted as a failed job: its jobs still compile elsewhere."""
    import logging

    from pagoda_engine.worker.compile_ahead import CompilePool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pool = CompilePool(2)
    try:
        pool.procs[0].kill()
        pool.procs[0].wait()
        with caplog.at_level(logging.WARNING, logger="pagoda_engine.worker.compile_ahead"):
            errors = pool.compile([_silu_and_mul_job(256), _silu_and_mul_job(512)])
        assert errors == []
        assert f"compile worker {pool.procs[0].pid} ended" in caplog.text
        assert len(list(tmp_path.iterdir())) == 2  # the other process compiled both
        pool.procs[1].kill()
        pool.procs[1].wait()
        errors = pool.compile([_silu_and_mul_job(1024)])
        assert any("_silu_and_mul_kernel: no compile worker left" in e for e in errors), errors
    finally:
        pool.close()


_NOTE_IN_A_BLOCK = """
import logging, os, sys, time, types
import torch
from triton.backends.compiler import GPUTarget
from pagoda_engine.worker.compile_ahead import compile_ahead, stop_compile_pool
from pagoda_engine.worker.compile_worker import jit_function
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
fn = jit_function("pagoda_engine.worker.model.silu_and_mul_triton", "_silu_and_mul_kernel")
fn.device_caches[0] = ({}, {}, GPUTarget("cuda", 90, 32), None, None)  # what a GPU's first launch sets up
signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "d": "i32", "x_stride": "i32", "out_stride": "i32",
             "BLOCK": "constexpr", "PDL": "constexpr"}
cache = os.environ["TRITON_CACHE_DIR"]
try:
    with compile_ahead(torch.device("cuda", 0), "a test", workers=1) as ahead:
        assert ahead
        for _ in range(2):  # what two launches of one variant call: noted once
            assert fn._do_compile("k", signature, 0, {"BLOCK": 256, "PDL": False}, types.SimpleNamespace(), {}, False) is None
        deadline = time.monotonic() + 120
        while not os.listdir(cache) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("in the block:", len(os.listdir(cache)))
finally:
    stop_compile_pool()
print("after:", len(os.listdir(cache)))
"""


def test_a_noted_variant_compiles_once_while_the_block_goes_on(tmp_path):
    """Inside `compile_ahead`, Triton's compile step (`JITFunction._do_compile`, which a launch
    calls on a miss) only notes the variant and hands it to the pool, once per variant; the pool
    compiles it before the block ends. What a GPU's launch would call, called here (another
    process: tests run this one's kernels under Triton's interpreter)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", _NOTE_IN_A_BLOCK], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "in the block: 1" in done.stdout, done.stdout
    assert "compiled 1 Triton kernel variant(s) ahead of a test" in done.stdout, done.stdout
    assert "after: 1" in done.stdout


@pytest.mark.parametrize("flags, ranks_here", [
    (dict(), 1),
    (dict(tensor_parallel_size=2, data_parallel_size=4), 8),  # four cores of two ranks on one node
    (dict(tensor_parallel_size=4, nnodes=2), 2),  # one engine's ranks over two nodes
    (dict(tensor_parallel_size=2, data_parallel_size=4, nnodes=2), 4),  # two whole cores a node
])
def test_each_rank_s_pool_is_sized_for_the_ranks_on_its_node(monkeypatch, flags, ranks_here):
    """Every rank of every core on a node starts a pool: half the node's CPUs shared among them."""
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.worker import compile_ahead

    monkeypatch.setattr(compile_ahead.os, "sched_getaffinity", lambda pid: set(range(32)))
    config = EngineConfig.from_kwargs(model="pagoda-tiny", **flags)
    assert compile_ahead.ranks_on_node(config) == ranks_here
    assert compile_ahead.engine_compile_workers(config) == min(8, 32 // (2 * ranks_here))

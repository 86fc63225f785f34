"""What `processes` sets up in a process that runs a model: how many CPU threads torch runs
(`set_torch_threads`: one on a GPU unless OMP_NUM_THREADS or PAGODA_CPU_THREADS says otherwise; on
CPU, one for small models only), and its heap frozen once started (`freeze_gc_heap`)."""

from __future__ import annotations

import pytest
import torch
from pagoda_engine.processes import SMALL_CPU_MODEL_PARAMS, set_torch_threads


@pytest.fixture
def threads(monkeypatch):
    """A clean environment, torch at 2 threads before each call, the process's count restored after."""
    before = torch.get_num_threads()
    monkeypatch.delenv("PAGODA_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def after(device_type: str, num_params: int | None = None) -> int:
        torch.set_num_threads(2)
        set_torch_threads(device_type, num_params)
        return torch.get_num_threads()

    yield after
    torch.set_num_threads(before)


def test_a_gpu_process_runs_one_thread_unless_told(threads, monkeypatch):
    assert threads("cuda") == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads("cuda") == 2  # the user's OpenMP setting stands
    monkeypatch.setenv("PAGODA_CPU_THREADS", "3")
    assert threads("cuda") == 3


def test_on_cpu_only_small_models_run_one_thread(threads, monkeypatch):
    assert threads("cpu", SMALL_CPU_MODEL_PARAMS - 1) == 1
    assert threads("cpu", SMALL_CPU_MODEL_PARAMS) == 2
    monkeypatch.setenv("PAGODA_CPU_THREADS", "3")
    assert threads("cpu", 1000) == 3


def test_freezing_the_heap_collects_garbage_first_and_freezes_the_rest():
    """`processes.freeze_gc_heap` (an engine core process and its workers, once started): cycles
    already garbage are collected, not frozen for good; what lives moves out of the collector's
    reach. In a child process: freezing this one would keep every later test's cycles."""
    import subprocess
    import sys

    code = """
import gc, weakref
from pagoda_engine.processes import freeze_gc_heap
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
dead = weakref.ref(a)
del a, b
kept = [Node() for _ in range(100)]
before = gc.get_freeze_count()
freeze_gc_heap()
assert dead() is None, "the garbage cycle was frozen instead of collected"
assert gc.get_freeze_count() >= before + 100, (before, gc.get_freeze_count())
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr

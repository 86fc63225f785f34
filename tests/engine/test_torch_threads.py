"""How many CPU threads torch runs in a process that runs a model (`processes.set_torch_threads`):
one on a GPU unless OMP_NUM_THREADS or PAGODA_CPU_THREADS says otherwise; on CPU, one for small
models only."""

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

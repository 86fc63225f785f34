"""The executor's RPC over real worker processes (gloo on CPU): a method's result from every rank,
tensors in the arguments reaching every rank, a worker's exception becoming a clear error in the
core, a killed worker reported instead of waited for, a start-up wait that names the rank that
never joined, and a rank started by hand (as on another host) joining over TCP and leaving when
rank 0 dies."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pagoda_engine.errors import EngineDeadError, ModelLoadError
from pagoda_engine.worker.executor import Executor, WorkerError
from pagoda_engine.worker.parallel_state import ParallelLayout
from probe_worker import Payload
from test_tensor_parallel import _child_pids, _wait_gone

PROBE = "probe_worker:ProbeWorker"
CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def probe_importable():
    """Worker processes import the probe worker from this directory."""
    here = str(Path(__file__).parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
        yield


def start(tp: int, **kwargs) -> Executor:
    executor = Executor(ParallelLayout(tp=tp), CPU, worker_cls=PROBE, **kwargs)
    try:
        executor.collective_rpc("init_distributed")
    except BaseException:
        executor.close()
        raise
    return executor


@pytest.fixture(scope="module")
def three_ranks():
    executor = start(3)
    yield executor
    executor.close()


def test_collective_rpc_returns_every_ranks_result(three_ranks):
    results = three_ranks.collective_rpc("whoami")
    assert [r["rank"] for r in results] == [0, 1, 2] == [r["tp_rank"] for r in results]
    assert [r["pid"] for r in results] == [os.getpid(), *three_ranks.worker_pids]
    assert all(r["group"] == (0, 1, 2) for r in results)


def test_tensor_arguments_reach_every_rank(three_ranks):
    ids = torch.tensor([3, 1, 4, 1, 5])
    payload = Payload(label="w", weights=torch.tensor([0.5, 2.0]))
    results = three_ranks.collective_rpc("weighted_sum", ids, payload, scale=torch.tensor(7.0))
    # Each rank adds its (rank + 1) × weights: 1 + 2 + 3 = 6 times them, on every rank.
    assert results == [{"ids": [3, 1, 4, 1, 5], "label": "w", "scale": 7.0, "total": [3.0, 12.0]}] * 3
    # `call`: the same, in lockstep; rank 0's result only.
    assert three_ranks.call("weighted_sum", ids, payload, scale=torch.tensor(7.0))["total"] == [3.0, 12.0]


def test_tensors_arrive_16_byte_aligned_whatever_their_lengths(three_ranks):
    # A step's input ids, positions and slots (int64, as many as its tokens) travel in one
    # broadcast; packed end to end, an odd token count put the positions 8 bytes off 16 on the
    # workers, where Triton compiled a second variant of a kernel on a live step.
    sent = [torch.arange(5), torch.arange(10, 15), torch.arange(20, 23), torch.tensor([1.5, 2.5, 3.5]),
            torch.tensor([True]), torch.tensor([False, True])]
    expected = [(t.tolist(), 0) for t in sent]
    assert three_ranks.collective_rpc("received", *sent) == [expected] * 3


def test_an_exception_on_one_rank_is_a_clear_error_and_the_ranks_go_on(three_ranks):
    with pytest.raises(WorkerError, match=r"tensor-parallel worker 2 failed in fail_on: ValueError: "
                                          r"rank 2 was told to fail") as raised:
        three_ranks.collective_rpc("fail_on", 2)
    assert "Traceback" in raised.value.traceback
    with pytest.raises(ValueError, match="rank 0 was told to fail"):  # rank 0's own error, as it is
        three_ranks.collective_rpc("fail_on", 0)
    with pytest.raises(AttributeError, match="ProbeWorker has no method 'no_such_method'"):
        three_ranks.collective_rpc("no_such_method")  # refused before anything is sent
    assert three_ranks.collective_rpc("fail_on", 5) == ["fine"] * 3


def test_a_worker_killed_during_a_call_is_reported_not_waited_for():
    executor = start(2)
    try:
        (pid,) = executor.worker_pids
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel worker 1 died \(exit code -9\) during sleep"):
            executor.collective_rpc("sleep", 120, on_rank=1)
        assert time.monotonic() - started < 30
        with pytest.raises(EngineDeadError, match=r"tensor-parallel worker 1 (died|is gone)"):
            executor.call("weighted_sum", torch.tensor([1]), Payload("w", torch.ones(2)), torch.tensor(1.0))
    finally:
        executor.close()


def test_a_worker_that_fails_a_lockstep_call_is_reported_by_the_next_call():
    executor = start(2)
    try:
        (pid,) = executor.worker_pids
        assert executor.call("fail_on", 1) == "fine"  # rank 0 is fine; rank 1 reports and exits
        assert _wait_gone([pid])
        with pytest.raises(EngineDeadError, match=r"tensor-parallel worker 1 failed in fail_on: ValueError: "
                                                  r"rank 1 was told to fail"):
            executor.collective_rpc("whoami")
    finally:
        executor.close()


def test_start_up_names_the_rank_that_never_joined():
    children_before = _child_pids()
    started = time.monotonic()
    # Rank 2 is nobody's to start (as if its host never came up); rank 1 starts here and joins.
    with pytest.raises(ModelLoadError, match=r"tensor-parallel rank 2 of 3 did not join within 20s \(joined: 0, 1\); "
                                             r"a rank started elsewhere joins with --master-addr/--master-port "
                                             r"127\.0\.0\.1:\d+"):
        Executor(ParallelLayout(tp=3), CPU, worker_cls=PROBE, spawn_ranks=[1], join_timeout_s=20)
    assert time.monotonic() - started < 40
    assert _wait_gone(list(_child_pids() - children_before), timeout_s=5)  # rank 1 is stopped


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def test_a_rank_started_by_hand_joins_over_tcp():
    """What a second host does: run the worker entry point pointed at rank 0's address and port."""
    host = socket.gethostbyname(socket.gethostname())
    port = _free_port(host)
    worker = subprocess.Popen([sys.executable, "-m", "pagoda_engine.worker.worker", "--master-addr", host,
                               "--master-port", str(port), "--rank", "1"], stdin=subprocess.DEVNULL)
    try:
        executor = Executor(ParallelLayout(tp=2), CPU, worker_cls=PROBE, master_addr=host, master_port=port,
                            spawn_ranks=[], join_timeout_s=60)
        try:
            assert executor.worker_pids == [worker.pid]
            executor.collective_rpc("init_distributed")
            assert [r["rank"] for r in executor.collective_rpc("whoami")] == [0, 1]
        finally:
            executor.close()
        assert worker.wait(10) == 0  # told to shut down, it exits cleanly
    finally:
        worker.kill()
        worker.wait()


_RANK_0 = """
import sys, torch
from pagoda_engine.worker.executor import Executor
from pagoda_engine.worker.parallel_state import ParallelLayout
executor = Executor(ParallelLayout(tp=2), torch.device("cpu"), worker_cls="probe_worker:ProbeWorker",
                    master_addr=sys.argv[1], master_port=int(sys.argv[2]), spawn_ranks=[], join_timeout_s=60)
print("joined", flush=True)
sys.stdin.read()
"""


def test_a_rank_started_elsewhere_exits_when_rank_0_dies():
    """Such a rank is nobody's child: it notices rank 0's store is gone rather than wait forever."""
    host = "127.0.0.1"
    port = _free_port(host)
    rank_0 = subprocess.Popen([sys.executable, "-c", _RANK_0, host, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    worker = subprocess.Popen([sys.executable, "-m", "pagoda_engine.worker.worker", "--master-addr", host,
                               "--master-port", str(port), "--rank", "1"], stdin=subprocess.DEVNULL)
    try:
        assert rank_0.stdout.readline() == "joined\n"
        rank_0.kill()
        rank_0.wait()
        assert worker.wait(30) == 1
    finally:
        for process in (rank_0, worker):
            process.kill()
            process.wait()


def test_one_rank_runs_the_same_worker_in_process():
    executor = Executor(ParallelLayout(), CPU, worker_cls=PROBE)
    assert executor.collective_rpc("whoami") == [{"rank": 0, "tp_rank": 0, "pid": os.getpid(),
                                                  "host": socket.gethostname(), "group": None}]
    with pytest.raises(ValueError, match="rank 0 was told to fail"):
        executor.call("fail_on", 0)
    assert executor.worker_pids == []
    executor.close()


def test_worker_ranks_start_without_automatic_collections_until_told():
    """A worker rank's process pauses Python's collector for its start-up (`processes.pause_collections_for_start_up`)
    until `resume_collections`; rank 0, in this process, is left as it is."""
    executor = start(2)
    try:
        assert executor.collective_rpc("collector_enabled") == [True, False]
        executor.collective_rpc("resume_collections")
        assert executor.collective_rpc("collector_enabled") == [True, True]
    finally:
        executor.close()


def test_every_rank_starts_and_stops_its_compile_pool_when_told(three_ranks):
    """What `create_executor` sends before the weights load on a fresh GPU node (`compile_ahead`):
    each rank starts compile processes of its own, its share of its node's CPUs among the ranks on
    the node (`compile_ahead.ranks_on_node`; here so many that the share is the least, one)."""
    try:
        three_ranks.collective_rpc("start_compile_pool", 10_000)
        pools = three_ranks.collective_rpc("compile_pool_processes")
        assert [len(p) for p in pools] == [1, 1, 1]
        assert len({pid for p in pools for pid in p}) == 3  # one each, not one shared
    finally:
        three_ranks.collective_rpc("stop_compile_pool")
    assert three_ranks.collective_rpc("compile_pool_processes") == [[], [], []]

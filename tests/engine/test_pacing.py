"""Step launch pacing (`core.pacing`, `EngineCore.launch_delay`): under async scheduling the core's
loop schedules the next step when the decode step in flight is about to end, so that a request
arriving meanwhile joins the next step, not the one after it.

The pacer's model is tested on its own. The whole loop runs on CPU against a simulated device
(`simulated_device`: every step takes a fixed device time), given a pacer as a GPU core gets one
from the flag (which a CPU core refuses), driven through the real `CoreLoop` on ZMQ sockets."""

import time

import pytest

from pagoda_engine import LLM
from pagoda_engine.config import EngineConfig
from pagoda_engine.core.engine_core import EngineCore
from pagoda_engine.core.pacing import LaunchPacer
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.messages import EngineCoreOutputs, ShutdownRequest
from pagoda_engine.tiny import build_tiny_model

from core_loop_sockets import core_loop_sockets
from simulated_device import simulate_device


def test_no_lead_before_three_decode_steps_of_that_size():
    pacer = LaunchPacer()
    pacer.observe_host(0.001)
    for _ in range(2):
        pacer.observe_decode(8, 0.010)
    assert pacer.lead(8) is None
    pacer.observe_decode(8, 0.010)
    assert pacer.lead(8) == pytest.approx(0.010 - 0.001 - pacer.slack)
    assert pacer.lead(9) is None  # another row count is another step


def test_the_averages_follow_the_device_and_the_host():
    pacer = LaunchPacer()
    for _ in range(3):
        pacer.observe_decode(4, 0.006)
    for _ in range(40):
        pacer.observe_decode(4, 0.008)  # the contexts grew
        pacer.observe_host(0.0005)
    assert pacer.host_s == pytest.approx(0.0005) and pacer.host_dev_s == pytest.approx(0.0, abs=1e-9)
    assert pacer.lead(4) == pytest.approx(0.008 - 0.0005 - pacer.slack, abs=1e-6)


def test_a_host_that_varies_is_given_more_time():
    steady, varying = LaunchPacer(), LaunchPacer()
    for pacer in (steady, varying):
        for _ in range(3):
            pacer.observe_decode(4, 0.008)
    for i in range(40):
        steady.observe_host(0.001)
        varying.observe_host(0.0005 if i % 2 else 0.0015)  # the same mean
    assert varying.host_s == pytest.approx(steady.host_s, abs=1e-4)
    assert varying.host_dev_s == pytest.approx(0.0005, rel=0.2)
    assert varying.lead(4) == pytest.approx(0.008 - varying.host_s - 3 * varying.host_dev_s - varying.slack, abs=1e-9)
    assert varying.lead(4) < steady.lead(4) - 0.001


def test_the_slack_grows_after_a_late_launch_and_shrinks_back():
    pacer = LaunchPacer()
    first = pacer.slack
    pacer.launched(late=True)
    assert pacer.slack == pytest.approx(2 * first) and pacer.late_launches == 1
    for _ in range(10):
        pacer.launched(late=True)
    assert pacer.slack == pytest.approx(0.004)  # capped
    for _ in range(1000):
        pacer.launched(late=False)
    assert pacer.slack == pytest.approx(0.0002)  # floored
    assert pacer.paced_launches == 1011


# --- the loop, against a simulated device ------------------------------------------------------
DEVICE_STEP_S = 0.080  # every step's device time: far above a tiny model's host work, even on a busy CI machine
SEND_AFTER_S = 0.025  # into a step: an unpaced core has scheduled the next one long before, a paced one not yet


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def _steps_to_join(model_dir, pacing: bool) -> tuple[list[int], EngineCore]:
    """A long request decodes; at every other output, a new one-token request is sent SEND_AFTER_S
    later. For each, how many steps after the one on the device when it was sent it was first
    scheduled in (1: the next step)."""
    core = EngineCore(EngineConfig.from_kwargs(model=str(model_dir), num_kv_pages=64, async_scheduling=True))
    if pacing:
        core.in_flight.pacer = LaunchPacer()
    log: list = []
    simulate_device(core, log, DEVICE_STEP_S)
    sent: dict[str, float] = {}
    with core_loop_sockets(core, f"pacing-{pacing}") as sockets:
        sockets.send_request("long", [5, 6, 7], max_tokens=40)
        sockets.thread.start()
        outputs = 0
        while True:
            message = sockets.receive()
            if not isinstance(message, EngineCoreOutputs) or not message.outputs:
                continue
            if any(o.request_id == "long" and o.finish_reason for o in message.outputs):
                break
            outputs += 1
            # From the 8th output on (the pacer has seen enough decode steps), every other output.
            if outputs >= 8 and outputs % 2 == 0 and len(sent) < 8:
                time.sleep(SEND_AFTER_S)
                rid = f"short-{len(sent)}"
                sent[rid] = time.monotonic()
                sockets.send_request(rid, [9, 10, 11, 12], max_tokens=1)
        sockets.send(ShutdownRequest())
        sockets.thread.join(10)
    waits = []
    for rid, at in sent.items():
        on_device = next(i for i, step in enumerate(log) if step["start"] <= at < step["end"])
        first = next(i for i, step in enumerate(log) if rid in step["request_ids"])
        waits.append(first - on_device)
    return waits, core


def test_with_pacing_an_arrival_joins_the_next_step(model_dir):
    waits, core = _steps_to_join(model_dir, pacing=True)
    try:
        assert len(waits) == 8
        assert waits.count(1) >= 6, waits  # a loaded machine may miss a deadline now and then
        assert core.in_flight.pacer.paced_launches > 0
    finally:
        core.close()


def test_without_pacing_an_arrival_waits_a_step_more(model_dir):
    waits, core = _steps_to_join(model_dir, pacing=False)
    try:
        assert len(waits) == 8 and set(waits) == {2}, waits
        assert core.in_flight.pacer is None
    finally:
        core.close()


def test_pacing_is_off_by_default_and_never_delays_then(model_dir):
    core = EngineCore(EngineConfig.from_kwargs(model=str(model_dir), num_kv_pages=64, async_scheduling=True))
    try:
        assert core.in_flight.pacer is None and core.launch_delay() == 0.0
    finally:
        core.close()


def test_a_servers_default_paces_only_where_a_step_runs_on_a_gpu(model_dir):
    """`pagoda serve` leaves the flag unset (None): a CUDA core with async scheduling paces (the GPU
    tests run it); a CPU core is not refused, it just does not pace; the offline LLM never paces."""
    config = EngineConfig.from_kwargs(model=str(model_dir), num_kv_pages=64, async_scheduling=True,
                                      step_launch_pacing=None)
    core = EngineCore(config)
    try:
        assert core.config.scheduler.step_launch_pacing is False and core.in_flight.pacer is None
        assert config.scheduler.step_launch_pacing is None  # resolved into the core's copy, not the caller's
    finally:
        core.close()
    llm = LLM(str(model_dir), num_kv_pages=64, async_scheduling=True, step_launch_pacing=None)
    try:
        assert llm.core.config.scheduler.step_launch_pacing is False and llm.core.in_flight.pacer is None
    finally:
        llm.close()


@pytest.mark.parametrize("async_scheduling", [None, True])
def test_pacing_on_cpu_is_refused_by_name(model_dir, async_scheduling):
    # A CPU step has ended when launch() returns: there is never a step in flight to time.
    with pytest.raises(ModelLoadError, match=r"--step-launch-pacing times steps running on a GPU; on cpu a step "
                                             r"has ended by the time it is launched"):
        EngineCore(EngineConfig.from_kwargs(model=str(model_dir), num_kv_pages=64, async_scheduling=async_scheduling,
                                            step_launch_pacing=True))


def test_pacing_in_the_offline_llm_is_refused_by_name(model_dir):
    with pytest.raises(ValueError, match=r"the offline LLM is handed its requests up front"):
        LLM(str(model_dir), num_kv_pages=64, async_scheduling=True, step_launch_pacing=True)

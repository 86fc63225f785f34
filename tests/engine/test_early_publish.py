"""Early publishing (`EngineCore.publish_early`): under async scheduling the core launches step N+1
before it reads step N's tokens, and an eager step of a long prompt takes 10-25 ms of host time to
launch on a GPU. Step N's tokens used to wait for that whole launch. Now the attention backend's
layer hook resolves, applies and publishes step N between two layers of N+1's launch, as soon as
N has ended on the device.

The real `CoreLoop` on ZMQ sockets drives a CPU core against a simulated device
(`simulated_device`): 40 ms a step, and a step with prompt tokens takes 15 ms of host time per
layer to launch (8 layers: 120 ms), so the decode step before it ends a third of the way in."""

import time

import pytest

from pagoda_engine.config import EngineConfig
from pagoda_engine.core.engine_core import EngineCore
from pagoda_engine.messages import ShutdownRequest
from pagoda_engine.tiny import build_tiny_model

from core_loop_sockets import core_loop_sockets
from simulated_device import simulate_device

DEVICE_STEP_S = 0.040
PROMPT_LAYER_HOST_S = 0.015
NUM_LAYERS = 8
SEND_AT = (5, 12, 19)  # after these tokens of the long request, a new prompt arrives


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama8",
                            config_overrides={"num_hidden_layers": NUM_LAYERS})


def _run(model_dir, early: bool, tensor_parallel_size: int = 1):
    """Per slow launch: (when the token of the step before it reached the client, when the slow
    launch ended); and every request's tokens."""
    core = EngineCore(EngineConfig.from_kwargs(model=str(model_dir), num_kv_pages=64, async_scheduling=True,
                                               tensor_parallel_size=tensor_parallel_size))
    if not early:
        core.publish_early = lambda sink: None  # the loop attaches its publisher through this
    log: list = []
    simulate_device(core, log, DEVICE_STEP_S, prompt_layer_host_s=PROMPT_LAYER_HOST_S)
    received: list[float] = []  # when each token of the long request arrived
    tokens: dict[str, list[int]] = {}
    with core_loop_sockets(core, f"early-{early}") as sockets:
        sockets.send_request("long", [5, 6, 7], max_tokens=26)
        sockets.thread.start()
        done = False
        while not done:
            for output in getattr(sockets.receive(), "outputs", []):
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.request_id != "long":
                    continue
                received.append(time.monotonic())
                done = output.finish_reason is not None
                if len(received) in SEND_AT:
                    sockets.send_request(f"short-{len(received)}", [9, 10, 11, 12, len(received)], max_tokens=2)
        deadline = time.monotonic() + 10
        while sum(len(tokens.get(f"short-{n}", [])) for n in SEND_AT) < 2 * len(SEND_AT):
            assert time.monotonic() < deadline, "a short request's tokens never came"
            for output in getattr(sockets.receive(timeout_ms=10_000), "outputs", []):
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        sockets.send(ShutdownRequest())
        sockets.thread.join(10)
    core.close()
    with_long = [i for i, step in enumerate(log) if "long" in step["request_ids"]]
    pairs = []
    for j, step in enumerate(log):
        # The slow launches are the short prompts' own: matched by what they hold, not by how long they
        # took, since under a loaded machine a decode step's launch can take as long.
        if j and step["slow"] and any(r.startswith("short-") for r in step["request_ids"]):
            token_of_prev = with_long.index(j - 1)  # the long request's token the step before sampled
            pairs.append((received[token_of_prev], step["launch_end"]))
    return pairs, tokens


def test_a_steps_tokens_leave_during_the_next_steps_launch(model_dir):
    pairs, tokens = _run(model_dir, early=True)
    assert len(pairs) == len(SEND_AT), pairs
    for got, launch_end in pairs:
        # The step before ended about 40 ms into a 120 ms launch; its token left at the next layer.
        assert got < launch_end - 0.03, (got, launch_end)
    _, late_tokens = _run(model_dir, early=False)
    assert tokens == late_tokens  # the same tokens, none lost


def test_with_tensor_parallel_workers_rank_0_publishes_mid_launch(model_dir):
    """Two ranks (gloo): the hook runs in rank 0's forward, which the engine core process runs
    while the worker runs its own; the publish does not stall the worker's collectives."""
    pairs, tokens = _run(model_dir, early=True, tensor_parallel_size=2)
    assert len(pairs) == len(SEND_AT), pairs
    for got, launch_end in pairs:
        assert got < launch_end - 0.03, (got, launch_end)
    _, one_rank = _run(model_dir, early=True)
    assert tokens == one_rank


def test_without_early_publishing_they_wait_for_the_whole_launch(model_dir):
    pairs, _ = _run(model_dir, early=False)
    assert len(pairs) == len(SEND_AT), pairs
    for got, launch_end in pairs:
        assert got >= launch_end, (got, launch_end)

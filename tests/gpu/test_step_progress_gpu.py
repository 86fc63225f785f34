"""`runner.StepProgress` on a real device: timing events recorded between the "layers" of a queued
chain of kernels tell the host, while the chain runs, about how long its rest will take (step
launch pacing after a step with prompt tokens reads this)."""

from __future__ import annotations

import time

import pytest
import torch

from gpu_support import requires_gpu
from pagoda_engine.worker.runner import StepProgress

pytestmark = [pytest.mark.gpu, requires_gpu]

LAYERS = 24


def _layer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    for _ in range(4):
        a = a @ b
    return a


def test_the_rest_of_a_running_chain_is_read_from_its_layers():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) / 64
    _layer(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _layer(a, b)
    end.record()
    end.synchronize()
    layer_s = start.elapsed_time(end) / 1e3

    gate = torch.cuda._sleep  # hold the device back until the whole chain is queued
    gate(int(2e7))
    progress = StepProgress()
    x = a
    for i in range(LAYERS):
        progress.mark(i)
        x = _layer(x, b)
    done = torch.cuda.Event()
    done.record()
    readings = []
    while not done.query():
        left = progress.remaining_s()
        if left is not None:
            readings.append((time.monotonic(), left))
        time.sleep(layer_s / 4)
    assert progress.remaining_s() < 2 * layer_s  # all begun: at most the last layer's worth
    assert len(readings) >= LAYERS // 2, readings
    ended_at = time.monotonic()
    # Each reading, made while the chain ran, is close to what was actually left.
    for at, left in readings[: len(readings) // 2]:
        assert left == pytest.approx(ended_at - at, abs=3 * layer_s + 0.002)
    assert readings[0][1] > readings[-1][1]

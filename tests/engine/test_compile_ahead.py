"""`worker/compile_ahead.py` off CUDA: the block is told not to run its compile-only pass, and
Triton's launch is left as it was (the GPU side: tests/gpu/test_compile_ahead_gpu.py)."""

from __future__ import annotations

import torch

from pagoda_engine.worker.compile_ahead import compile_ahead


def test_off_cuda_the_block_is_skipped_and_launches_stay_launches():
    from triton.runtime.jit import JITFunction

    launch = JITFunction.run
    with compile_ahead(torch.device("cpu"), "a CPU forward") as ahead:
        assert ahead is False
        assert JITFunction.run is launch
    assert JITFunction.run is launch

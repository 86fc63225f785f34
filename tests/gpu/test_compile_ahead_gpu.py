"""`worker/compile_ahead.py`: inside the block, Triton launches compile (on a thread pool) and do
not run; after it, the real launches find every variant compiled and run it; a variant whose
compile fails is left for its real launch, which raises."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from gpu_support import CUDA, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


@triton.jit
def _fill_kernel(out_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    tl.static_assert(VALUE < 100, "VALUE must stay under 100")
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full((BLOCK,), VALUE, tl.float32), mask=offs < n)


def _compiled_variants() -> int:
    device = torch.cuda.current_device()
    caches = _fill_kernel.device_caches.get(device)
    return 0 if caches is None else len(caches[0])


def test_launches_inside_compile_and_do_not_run_then_run_compiled():
    from pagoda_engine.worker.compile_ahead import compile_ahead

    out = torch.full((3, 1000), -1.0, device=CUDA)
    before = _compiled_variants()
    with compile_ahead(torch.device(CUDA), "the test") as ahead:
        assert ahead
        for i, value in enumerate((1, 2, 3)):
            _fill_kernel[(4,)](out[i], 1000, VALUE=value, BLOCK=256)
    torch.cuda.synchronize()
    assert bool((out == -1).all()), "a kernel ran inside the block"
    assert _compiled_variants() == before + 3
    for i, value in enumerate((1, 2, 3)):
        _fill_kernel[(4,)](out[i], 1000, VALUE=value, BLOCK=256)
    torch.cuda.synchronize()
    assert _compiled_variants() == before + 3, "a real launch compiled again"
    assert torch.equal(out, torch.tensor([1.0, 2.0, 3.0], device=CUDA)[:, None].expand(3, 1000))


def test_a_failed_compile_is_raised_by_the_real_launch():
    from pagoda_engine.worker.compile_ahead import compile_ahead

    out = torch.zeros(256, device=CUDA)
    with compile_ahead(torch.device(CUDA), "the test"):
        _fill_kernel[(1,)](out, 256, VALUE=500, BLOCK=256)  # fails its static assert: no error here
    with pytest.raises(Exception, match="VALUE must stay under 100"):
        _fill_kernel[(1,)](out, 256, VALUE=500, BLOCK=256)

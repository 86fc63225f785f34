"""The small-batch SiLU-and-mul kernel (`model/silu_and_mul_triton.py`) under Triton's CPU
interpreter against torch's silu(gate) * up in float32, rounded once. Skips without Triton."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import import_kernels

kernels = import_kernels("pagoda_engine.worker.model.silu_and_mul_triton")


@pytest.mark.parametrize("rows,d", [(1, 3000), (5, 1024), (3, 40)], ids=["partial-block", "whole-blocks", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_equals_torch(rows, d, dtype):
    x = (torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).to(dtype)
    got = kernels.silu_and_mul(x)
    assert got.shape == (rows, d) and got.dtype == dtype
    # float32: exp's last bits may differ; bf16: one rounding step (the interpreter may round the
    # other way than the GPU).
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tolerance)

"""The small-batch SiLU-and-mul kernel (`model/silu_and_mul_triton.py`) against FlashInfer's, which
serves larger batches, at Llama-3.1-8B's MLP width in bf16; and `SiluAndMul` is right on both sides of the switch."""

from __future__ import annotations

import pytest
import torch

from gpu_support import CUDA, LLAMA_SIZED_CONFIG, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_small_batch_kernel_matches_flashinfer(rows):
    import flashinfer

    from pagoda_engine.worker.model.silu_and_mul_triton import silu_and_mul

    d = LLAMA_SIZED_CONFIG["intermediate_size"]
    x = torch.randn(rows, 2 * d, device=CUDA).bfloat16() * 4
    torch.testing.assert_close(silu_and_mul(x), flashinfer.silu_and_mul(x))


def test_silu_and_mul_layer_is_right_on_both_sides_of_max_rows():
    from pagoda_engine.worker.model import silu_and_mul_triton
    from pagoda_engine.worker.model.layers import SiluAndMul

    d = 1024
    for rows in (1, silu_and_mul_triton.MAX_ROWS, silu_and_mul_triton.MAX_ROWS + 1, 300):
        x = torch.randn(rows, 2 * d, device=CUDA).bfloat16()
        gate, up = x.float().chunk(2, dim=-1)
        torch.testing.assert_close(SiluAndMul()(x), (torch.nn.functional.silu(gate) * up).bfloat16())

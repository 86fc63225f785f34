"""The FP8 × FP8 MoE experts (`fused_moe_triton._fused_experts_fp8`: per-token e4m3 inputs, the
gate+up grouped GEMM quantizing its SiLU-and-mul output per row and 128-column group, down taking
those group scales on each K step) under Triton's CPU interpreter, on small shapes: against the
reference loop running the same quantized numbers (`fused_experts_reference(..., fp8_act_group=)`),
and within FP8's error of the weight-only numbers. The interpreter's float32 → e4m3 conversion
is the GPU's here (`convert_to_e4m3_as_the_gpu`). At Qwen3-30B-A3B's shapes on a GPU:
tests/gpu/test_fp8_gpu.py. Skips where Triton does not import (CPU CI)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import convert_to_e4m3_as_the_gpu, import_kernels

from pagoda_engine.worker.model.fp8_math import FP8_DTYPE, dequantize_groups, quantize_groups, quantize_rows
from pagoda_engine.worker.model.moe import fused_experts_reference

import_kernels("pagoda_engine.worker.model.fp8_quant_triton")  # the module the experts call, interpreted too
kernels = import_kernels("pagoda_engine.worker.model.fused_moe_triton")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="without a GPU these kernels run only with TRITON_INTERPRET=1 set")

HIDDEN, EXPERTS, TOP_K = 256, 4, 2


@pytest.fixture(autouse=True)
def _gpu_rounding(monkeypatch):
    if not torch.cuda.is_available():
        convert_to_e4m3_as_the_gpu(monkeypatch)


def _experts(inter: int, gen: torch.Generator):
    w13, s13 = quantize_rows(torch.randn(EXPERTS, 2 * inter, HIDDEN, generator=gen) * HIDDEN ** -0.5)
    w2, s2 = quantize_rows(torch.randn(EXPERTS, HIDDEN, inter, generator=gen) * inter ** -0.5)
    return w13, w2, s13, s2


def _routing(num_tokens: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    ids[0, 1] = EXPERTS  # an expert another rank holds: left out
    weights = torch.softmax(torch.randn(num_tokens, TOP_K, generator=gen), dim=-1).bfloat16()
    return weights, ids


# Each tier of tiles (`_fp8_configs`: 16-row ones with 128-column groups up to 128 tokens, 32-
# and 64-row ones with 64-column groups past it) on a few tokens, the interpreter being slow; an
# intermediate size of 192 leaves the last 128-column group half full.
@pytest.mark.parametrize("num_tokens,tiles_of,inter", [(6, 6, 256), (6, 6, 192), (12, 300, 256), (12, 1000, 192)])
def test_fp8_experts_give_the_reference_loops_quantized_numbers(num_tokens, tiles_of, inter):
    gen = torch.Generator().manual_seed(num_tokens + inter)
    w13, w2, s13, s2 = _experts(inter, gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16()
    weights, ids = _routing(num_tokens, gen)
    local = ids < EXPERTS
    ref_weights, ref_ids = (weights * local).float(), torch.where(local, ids, 0)
    configs = kernels._fp8_configs(tiles_of)
    got = kernels._fused_experts_fp8(x, w13, w2, weights, ids, s13, s2, configs).float()
    group = configs[0]["BLOCK_N"] // 2
    expected = fused_experts_reference(x.float(), w13, w2, ref_weights, ref_ids, s13, s2, fp8_act_group=group)
    # The sums' order differs (the K tiles'), and with it, now and then, an activation's rounding
    # to e4m3 (one e4m3 step of one of the terms of an output); each pair's share and the sum are
    # rounded to bf16 (the interpreter truncates: 0.4 % at most, each time).
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    assert (got - expected).abs().mean() < 1e-2 * expected.abs().mean()
    # And FP8's own error against the weight-only product (activations unquantized): per-token
    # and per-group e4m3 rounding, relative error about 2.5 % each (a uniform error of half a
    # step, 2^-4 at most), well under 8 % of the output's norm.
    weight_only = fused_experts_reference(x.float(), w13, w2, ref_weights, ref_ids, s13, s2)
    assert (got - weight_only).norm() < 0.08 * weight_only.norm()


@pytest.mark.parametrize("inter", [256, 192])
def test_gate_up_epilogue_writes_e4m3_activations_with_a_scale_per_row_and_group(inter):
    """The gate+up kernel's output on its own: silu(gate) × up of the quantized input, quantized
    per row and 128 columns: the group scales of `quantize_groups` to float32 rounding, the
    values (dequantized) within one e4m3 step. The pair routed to another rank's expert: zeros."""
    gen = torch.Generator().manual_seed(inter)
    w13, _, s13, _ = _experts(inter, gen)
    num_tokens = 10
    x = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16()
    _, ids = _routing(num_tokens, gen)
    cfg = kernels._fp8_configs(num_tokens)[0]
    group = cfg["BLOCK_N"] // 2
    from pagoda_engine.worker.model import fp8_math, fp8_quant_triton

    xq, xs = fp8_quant_triton.quantize_tokens(x, FP8_DTYPE, fp8_math.FP8_MAX, fp8_math.MIN_AMAX)
    aligned = kernels.align_by_expert(ids, EXPERTS + 1, cfg["BLOCK_M"])
    pairs = num_tokens * TOP_K
    act = torch.empty(pairs, inter, dtype=FP8_DTYPE)
    act_scale = torch.empty(pairs, -(-inter // group))
    kernels._grouped_gemm(xq, w13, act, None, aligned, TOP_K, pairs, cfg, silu_and_mul=True, b_scale=s13,
                          a_scale=xs, out_scale=act_scale)
    assert torch.equal(act[1].float(), torch.zeros(inter))  # pair 1: token 0's second slot, held elsewhere
    tokens, experts = torch.arange(pairs) // TOP_K, ids.flatten()
    held = experts < EXPERTS
    dense = w13[experts[held]].float() * s13[experts[held]].unsqueeze(-1)
    gate_up = torch.einsum("pk,pnk->pn", xq[tokens[held]].float() * xs[tokens[held]], dense)
    gate, up = gate_up.chunk(2, dim=-1)
    want_q, want_scale = quantize_groups(torch.nn.functional.silu(gate) * up, group)
    torch.testing.assert_close(act_scale[held], want_scale, rtol=1e-5, atol=0)
    # The same e4m3 codes but where a float32 rounding of the sums tips a value across a rounding
    # boundary: then one step apart (e4m3's largest below 448 is 32).
    assert (act[held].float() == want_q.float()).float().mean() > 0.99
    got, want = dequantize_groups(act[held], act_scale[held], group), dequantize_groups(want_q, want_scale, group)
    step = want_scale.repeat_interleave(group, dim=1)[:, :inter] * 32
    assert ((got - want).abs() <= step * 1.001).all()


def test_a_down_tile_that_does_not_take_the_activations_groups_is_refused():
    gen = torch.Generator().manual_seed(1)
    w13, w2, s13, s2 = _experts(256, gen)
    x = torch.randn(8, HIDDEN, generator=gen).bfloat16()
    weights, ids = _routing(8, gen)
    gate_up, down = kernels._fp8_configs(8)
    with pytest.raises(ValueError, match="BLOCK_K must be the activation's group"):
        kernels._fused_experts_fp8(x, w13, w2, weights, ids, s13, s2, configs=(gate_up, dict(down, BLOCK_K=64)))

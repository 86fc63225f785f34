"""The one-row matrix-vector kernels (`model/gemv_triton.py`) under Triton's CPU interpreter,
against float32 products, on small shapes: even and uneven K, a bias, the gated form.

Skips where Triton does not import (CPU CI); the kernels at Llama-3.1-8B's and Qwen3-30B-A3B's
shapes on a GPU, and the layers' switch, are tests/gpu/test_gemv_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from triton_interpreter import import_kernels

kernels = import_kernels("pagoda_engine.worker.model.gemv_triton")

# Without a GPU, `tl.sum` is interpreted only when the switch was on as Triton was imported: run
# with TRITON_INTERPRET=1 set for the whole process (as tests/engine/test_rope_kv_kernel.py's norm).
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="without a GPU these kernels run only with TRITON_INTERPRET=1 set")


@pytest.mark.parametrize("n,k", [(6, 64), (5, 40), (1, 2048), (3, 4104)])
def test_gemv_matches_a_float32_product(n, k):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(1, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    expected = x.float() @ w.float().T
    torch.testing.assert_close(kernels.gemv(x, w).float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.gemv(x, w, b).float(), expected + b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("inter,k", [(4, 64), (7, 40)])
def test_gated_gemv_is_silu_of_gate_times_up(inter, k):
    gen = torch.Generator().manual_seed(inter)
    w = torch.randn(2 * inter, k, generator=gen).bfloat16()
    x = torch.randn(1, k, generator=gen).bfloat16()
    gate, up = (x.float() @ w.float().T).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gemv_silu_and_mul(x, w).float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (40, 24)])
def test_experts_gemv_matches_the_reference_loop(num_tokens, hidden, inter, fp8):
    """The MoE's one- and two-token path (`fused_moe_triton._experts_gemv`), with one slot routed to
    an expert held by another rank (id = the local count): its share is left out. FP8 experts:
    e4m3 weights with a scale per expert and row, against the reference's widened weights."""
    from pagoda_engine.worker.model.fp8_math import quantize_rows
    from pagoda_engine.worker.model.moe import fused_experts_reference

    moe = import_kernels("pagoda_engine.worker.model.fused_moe_triton")
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    experts, top_k = 6, 3
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).bfloat16()
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[0, 1] = experts  # held elsewhere
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1).bfloat16()
    local = ids < experts
    scales = (None, None)
    if fp8:
        (w13, s13), (w2, s2) = quantize_rows(w13), quantize_rows(w2)
        scales = (s13, s2)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), (weights * local).float(),
                                       torch.where(local, ids, 0), *scales)
    got = moe._experts_gemv(x, w13, w2, weights, ids, *scales)
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("rows", [2, 5, 16])
@pytest.mark.parametrize("n,k", [(64, 128), (70, 136), (33, 512)])
def test_few_row_kernel_matches_a_float32_product(rows, n, k):
    """`_rows_kernel` (two to MAX_ROWS rows), plain with a bias and gated, with K tiles that do and
    do not divide K, a column block cut short, and the rows a strided view (every other row of a
    wider tensor, as a sliced activation is). float16: the interpreter multiplies bfloat16 tiles
    as their raw bits (the GPU tests cover bfloat16)."""
    gen = torch.Generator().manual_seed(rows * n + k)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).half()
    wide = torch.randn(rows, 2 * k, generator=gen).half()
    x = wide[:, :k]  # rows 2k apart
    b = torch.randn(n, generator=gen).half()
    expected = x.float() @ w.float().T
    torch.testing.assert_close(kernels.gemv(x, w).float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.gemv(x, w, b).float(), expected + b.float(), rtol=1e-2, atol=1e-2)
    w13 = torch.cat([w, w.flip(0)])  # gate rows over up rows
    gate, up = (x.float() @ w13.float().T).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gemv_silu_and_mul(x, w13).float(), F.silu(gate) * up, rtol=1e-2, atol=1e-2)



def _fp8_rows(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [n, k] with its float32 row scales, and the weight they stand for."""
    from pagoda_engine.worker.model.fp8_math import quantize_rows

    return quantize_rows(torch.randn(n, k, generator=gen) * k ** -0.5)


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("n,k", [(6, 64), (70, 136)])
def test_fp8_weights_are_read_as_weight_times_row_scale(rows, n, k):
    """An FP8 projection's decode rows (`LinearBase.matmul`): the one-row and few-row kernels read
    e4m3 weights widened and times their row scales, plain with a bias and gated, against the
    float32 product of x and the dequantized weight. float16 rows for the few-row kernel's
    interpreted tensor-core products (see above)."""
    gen = torch.Generator().manual_seed(rows * n + k)
    wq, s = _fp8_rows(n, k, gen)
    dense = wq.float() * s[:, None]
    x = torch.randn(rows, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half()
    expected = x.float() @ dense.T
    torch.testing.assert_close(kernels.gemv(x, wq, scale=s).float(), expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(kernels.gemv(x, wq, b, scale=s).float(), expected + b.float(), rtol=1e-2, atol=1e-2)
    (w13q, s13) = _fp8_rows(2 * n, k, gen)
    gate, up = (x.float() @ (w13q.float() * s13[:, None]).T).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.gemv_silu_and_mul(x, w13q, s13).float(), F.silu(gate) * up,
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("cut", [None, (2, 4, 3), (8, 2, 2)], ids=["default", "3-blocks", "2-blocks"])
@pytest.mark.parametrize("gated", [False, True])
def test_fp8_weights_behind_the_folded_norm(gated, cut):
    """`gemv_rmsnorm` with an FP8 weight: the normalised row (x + residual) times the dequantized
    weight, and the new residual stream, as the bf16 kernel gives them; under the default cut and
    under programs that take several blocks of columns (`NormConfig`, as the sweep times them),
    the last cut short."""
    gen = torch.Generator().manual_seed(7 + gated)
    k, n = 96, 10
    wq, s = _fp8_rows(2 * n if gated else n, k, gen)
    x, res = (torch.randn(1, k, generator=gen).half() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).half()
    h = x.float() + res.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()).half().float()
    y = normed @ (wq.float() * s[:, None]).T
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    config = kernels.NormConfig(*cut) if cut else None
    got, new_res = kernels.gemv_rmsnorm(x, res, nw, 1e-6, wq, gated=gated, scale=s, config=config)
    torch.testing.assert_close(got.float(), y, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(new_res.float(), h, rtol=1e-3, atol=1e-3)


def test_an_fp8_weight_without_its_scales_is_refused():
    gen = torch.Generator().manual_seed(3)
    wq, s = _fp8_rows(8, 64, gen)
    x = torch.randn(1, 64, generator=gen).half()
    with pytest.raises(ValueError, match="row scales"):
        kernels.gemv(x, wq)
    with pytest.raises(ValueError, match="row scales"):
        kernels.gemv(x, wq.half(), scale=s)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("split_k,block_n,block_k", [(2, 2, 32), (4, 4, 64), (3, 1, 16)])
def test_one_row_cuts_and_split_k_give_the_product(split_k, block_n, block_k, fp8):
    """The one-row kernel under other cuts than the default (`OneRowConfig`, as the sweep
    `pagoda_engine.bench.gemv_sweep` times them): more columns a program, K tiles that do and do
    not divide the slices, and K split over programs whose float32 sums the last to arrive adds in
    order; twice, so the arrival counters are back at zero after a launch. Plain, with a bias,
    gated; bf16 (float16 here) and FP8 weights."""
    gen = torch.Generator().manual_seed(split_k * 10 + block_n)
    n, k = 11, 96 * split_k
    x = torch.randn(1, k, generator=gen).half()
    b = torch.randn(n, generator=gen).half()
    if fp8:
        wq, s = _fp8_rows(n, k, gen)
        w13q, s13 = _fp8_rows(2 * n, k, gen)
        dense, dense13 = wq.float() * s[:, None], w13q.float() * s13[:, None]
    else:
        wq, w13q = (torch.randn(rows, k, generator=gen).mul(k ** -0.5).half() for rows in (n, 2 * n))
        s = s13 = None
        dense, dense13 = wq.float(), w13q.float()
    cfg = kernels.OneRowConfig(block_n, block_k, 4, split_k)
    expected = x.float() @ dense.T
    gate, up = (x.float() @ dense13.T).chunk(2, dim=-1)
    for _ in range(2):
        torch.testing.assert_close(kernels._launch_one(x, wq, s, b, n, False, cfg).float(), expected + b.float(),
                                   rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(kernels._launch_one(x, w13q, s13, None, n, True, cfg).float(),
                                   F.silu(gate) * up, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="split-K 5"):
        kernels._launch_one(x, wq, s, b, n, False, kernels.OneRowConfig(block_n, block_k, 4, 5))


@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_few_rows_in_float16_products(rows):
    """`_rows_kernel`'s float16 products for FP8 weights (`RowsConfig.f16`): the rows scaled into
    float16's range and back, so that magnitudes a float16 cannot hold (1e5) and small ones come
    out as in the float32 product; plain and gated. float32 rows here, which can hold such
    magnitudes (and the interpreter multiplies bfloat16 tiles as their raw bits; the GPU sweep
    checks bfloat16 rows)."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 136
    wq, s = _fp8_rows(n, k, gen)
    w13q, s13 = _fp8_rows(2 * n, k, gen)
    x = torch.randn(rows, k, generator=gen)
    cfg = kernels.RowsConfig(32, 64, 2, 4, True)
    gate, up = (x @ (w13q.float() * s13[:, None]).T).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    torch.testing.assert_close(kernels._launch_rows(x, w13q, s13, None, n, True, cfg), expected, rtol=1e-2, atol=1e-2)
    x[0, :8] = torch.tensor([1e5, -2e5, 3e4, 6e5, -6e4, 1e-3, -1e-4, 0.5])
    expected = x @ (wq.float() * s[:, None]).T
    torch.testing.assert_close(kernels._launch_rows(x, wq, s, None, n, False, cfg), expected,
                               rtol=1e-2, atol=1e-2 * expected.abs().max().item())


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_the_sweep_checks_each_cut_against_the_float32_product(dtype, monkeypatch):
    """`pagoda_engine.bench.gemv_sweep` times only cuts whose output is the float32 product: its
    check passes the one-row and folded-norm cuts it would time (at tiny shapes here) and fails a
    cut held against other weights' product."""
    from pagoda_engine.bench import gemv_sweep as sweep

    monkeypatch.setattr(sweep, "SHAPES", {"qkv": (24, 64, "norm"), "o": (16, 64, "plain"),
                                          "gate_up": (12, 64, "gated_norm"), "down": (16, 128, "plain")})
    cands = sweep.candidates(["qkv", "o", "gate_up", "down"], [dtype], [1])
    picked = [c for c in cands if c.kernel == "norm" and c.config[2] == 2][:2] + \
        [c for c in cands if c.kernel == "one" and c.config[3] > 1][:2]
    assert {c.kernel for c in picked} == {"norm", "one"}
    cpu = torch.device("cpu")
    for c in picked:
        w = sweep.make_weights(c.shape, c.dtype, cpu)
        assert len(w.copies) >= 2
        assert sweep.check(c, 1, w, cpu)[0] == "ok", c
    w.dense = w.dense * 1.1
    assert sweep.check(picked[-1], 1, w, cpu)[0].startswith("WRONG")


def test_the_tensor_core_row_takes_only_what_its_fragments_fit():
    """`_launch_mma` (inline PTX, which the interpreter does not run; tests/gpu runs the kernel)
    refuses what its fragments cannot hold before launching: bf16 weights, K not a multiple of
    64, more than one row, rows a program not a multiple of 8 × warps."""
    gen = torch.Generator().manual_seed(5)
    wq, s = _fp8_rows(16, 128, gen)
    x = torch.randn(1, 128, generator=gen).half()
    ok = kernels.MmaConfig(16, 2)
    for bad in [(x, wq.half(), s, ok), (x[:, :96], wq[:, :96], s, ok), (torch.cat([x, x]), wq, s, ok),
                (x, wq, s, kernels.MmaConfig(24, 2))]:
        with pytest.raises(ValueError, match="tensor-core one-row kernel"):
            kernels._launch_mma(bad[0], bad[1], bad[2], 16, bad[3])

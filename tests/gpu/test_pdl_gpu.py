"""Programmatic dependent launch (`worker/pdl.py`): on a Hopper GPU the engine's Triton kernels are
launched with it, and chains of dependent kernels captured in a CUDA graph (each kernel reading
what the one before it wrote, as a decode step's layers do) give the same bits with it as without
it: the kernels that load weights before their wait (the one-row projections, the folded norm and
projection) and the MoE
layer's chain of routing, alignment, grouped GEMMs or matrix-vector experts, and combine."""

from __future__ import annotations

import pytest
import torch

from gpu_support import CUDA, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def _with_pdl(monkeypatch, on: bool):
    from pagoda_engine.worker import pdl

    monkeypatch.setenv("PAGODA_PDL", "1" if on else "0")
    pdl._keywords.cache_clear()
    return pdl


@pytest.fixture(autouse=True)
def _fresh_switch():
    from pagoda_engine.worker import pdl

    yield
    pdl._keywords.cache_clear()


def test_kernels_launch_with_pdl_on_hopper_and_without_it_when_turned_off(monkeypatch):
    pdl = _with_pdl(monkeypatch, True)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.launch(CUDA) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}
    pdl = _with_pdl(monkeypatch, False)
    assert pdl.launch(CUDA) == {"PDL": False}


def _replayed(fn, replays: int = 5):
    """fn's outputs after capturing it in a CUDA graph and replaying it `replays` times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return [t.clone() for t in out]


def _norm_projection_chain():
    from pagoda_engine.worker.model.gemv_triton import gemv_rmsnorm

    gen = torch.Generator(device=CUDA).manual_seed(0)
    k = 2048
    layers = [((1 + 0.1 * torch.randn(k, device=CUDA, generator=gen)).bfloat16(),
               (torch.randn(k, k, device=CUDA, generator=gen) * k ** -0.5).bfloat16()) for _ in range(48)]
    x = torch.randn(1, k, device=CUDA, generator=gen).bfloat16()
    residual = torch.randn(1, k, device=CUDA, generator=gen).bfloat16()

    def chain():
        h, res = x, residual
        for norm_weight, weight in layers:
            h, res = gemv_rmsnorm(h, res, norm_weight, 1e-5, weight)
        return h, res

    return chain


def _projection_chain(k: int, gated: bool):
    """One-row projections (`gemv`, which loads its first weight tile before the wait), each reading
    the row the one before wrote: K = 1,032 (one tile, masked) and 4,104 (three, the last masked)."""
    from pagoda_engine.worker.model.gemv_triton import gemv, gemv_silu_and_mul

    gen = torch.Generator(device=CUDA).manual_seed(k)
    rows = 2 * k if gated else k
    weights = [(torch.randn(rows, k, device=CUDA, generator=gen) * k ** -0.5).bfloat16() for _ in range(32)]
    x = torch.randn(1, k, device=CUDA, generator=gen).bfloat16()

    def chain():
        h = x
        for weight in weights:
            h = gemv_silu_and_mul(h, weight) if gated else gemv(h, weight)
            h = h / h.float().square().mean().sqrt().to(h.dtype)  # each layer's row at unit scale
        return (h,)

    return chain


def _few_rows_chain(m: int, k: int, gated: bool):
    """The few-row kernel (2-16 rows; its first weight tile is loaded before the wait), chained."""
    from pagoda_engine.worker.model.gemv_triton import gemv, gemv_silu_and_mul, linear_applies

    gen = torch.Generator(device=CUDA).manual_seed(m * k)
    rows = 2 * k if gated else k
    weights = [(torch.randn(rows, k, device=CUDA, generator=gen) * k ** -0.5).bfloat16() for _ in range(32)]
    x = torch.randn(m, k, device=CUDA, generator=gen).bfloat16()
    assert linear_applies(x, weights[0])

    def chain():
        h = x
        for weight in weights:
            h = gemv_silu_and_mul(h, weight) if gated else gemv(h, weight)
            h = h / h.float().square().mean().sqrt().to(h.dtype)
        return (h,)

    return chain


def _moe_chain(num_tokens: int):
    from pagoda_engine.worker.model.fused_moe_triton import fused_experts, route

    gen = torch.Generator(device=CUDA).manual_seed(num_tokens)
    hidden, inter, experts, layers = 1024, 256, 32, 12
    weights = [((torch.randn(hidden, experts, device=CUDA, generator=gen) * hidden ** -0.5).bfloat16(),
                (torch.randn(experts, 2 * inter, hidden, device=CUDA, generator=gen) * hidden ** -0.5).bfloat16(),
                (torch.randn(experts, hidden, inter, device=CUDA, generator=gen) * inter ** -0.5).bfloat16())
               for _ in range(layers)]
    x = torch.randn(num_tokens, hidden, device=CUDA, generator=gen).bfloat16()

    def chain():
        h = x
        for router, w13, w2 in weights:
            topk_weights, topk_ids = route(h @ router, 4, True)
            h = h + fused_experts(h, w13, w2, topk_weights, topk_ids)
        return (h,)

    return chain


CHAINS = ["norm+projection", "projection 1032", "projection 4104", "gated projection 1032", "6 rows 2048",
          "16 rows 1032", "gated 6 rows 2048", "moe, 3 tokens", "moe, 64 tokens", "moe, 300 tokens"]


@pytest.mark.parametrize("chain", CHAINS)
def test_dependent_chains_in_a_graph_give_the_same_bits_with_and_without_pdl(monkeypatch, chain):
    make = {"norm+projection": _norm_projection_chain, "projection 1032": lambda: _projection_chain(1032, False),
            "projection 4104": lambda: _projection_chain(4104, False),
            "gated projection 1032": lambda: _projection_chain(1032, True),
            "6 rows 2048": lambda: _few_rows_chain(6, 2048, False), "16 rows 1032": lambda: _few_rows_chain(16, 1032, False),
            "gated 6 rows 2048": lambda: _few_rows_chain(6, 2048, True), "moe, 3 tokens": lambda: _moe_chain(3),
            "moe, 64 tokens": lambda: _moe_chain(64), "moe, 300 tokens": lambda: _moe_chain(300)}[chain]
    _with_pdl(monkeypatch, False)
    expected = _replayed(make())
    _with_pdl(monkeypatch, True)
    got = _replayed(make())
    assert all(g.isfinite().all() for g in got)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)

"""`python -m pagoda_engine.bench.moe_kernels`: one MoE layer's experts on the GPU, step by step
(routing, alignment by expert, the two grouped GEMMs) at Qwen3-30B-A3B's shapes, each timed as a
CUDA-graph replay, beside the time it takes to read the weights of the experts that were hit.

`--fp8`: FP8 experts (e4m3 weights, a scale per row), the weight-only path (bf16 activations,
weights widened in the kernels) against FP8 × FP8 (`_fused_experts_fp8`), whole and step by step.
`--fp8 --sweep`: the FP8 × FP8 GEMMs' tiles (`_fp8_configs`), the best per token count; the
variants compile ahead in a pool of processes first."""

from __future__ import annotations

import argparse
import itertools

import torch

from pagoda_engine.bench.graph_timing import replay_us

from pagoda_engine.worker.compile_ahead import compile_ahead
from pagoda_engine.worker.model import fp8_math, fp8_quant_triton
from pagoda_engine.worker.model import fused_moe_triton as kernels
from pagoda_engine.worker.model.moe import select_experts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,8,64,256,4096,16384")
    p.add_argument("--bandwidth-tbs", type=float, default=4.0, help="for the weight-read floor (H200 copy: 4.27)")
    p.add_argument("--fp8", action="store_true", help="FP8 experts: weight-only against FP8 x FP8")
    p.add_argument("--sweep", action="store_true", help="with --fp8: sweep the FP8 x FP8 GEMMs' tiles")
    a = p.parse_args(argv)
    if a.fp8:
        (_sweep_fp8 if a.sweep else _compare_fp8)(a)
        return
    h, i, e, k = a.hidden, a.intermediate, a.experts, a.top_k
    w13 = (torch.randn(e, 2 * i, h, device="cuda") * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda") * i ** -0.5).bfloat16()
    print(f"{torch.cuda.get_device_name()}: hidden {h}, {e} experts of {i}, top {k}; µs per call")
    print("tokens  hit  all(SiLU in gate+up)  all(SiLU after)  routing  alignment  gate+up  SiLU-and-mul  "
          "gate+up+SiLU  down  weight-read floor")
    for t in (int(n) for n in a.tokens.split(",")):
        x = torch.randn(t, h, device="cuda").bfloat16()
        logits = torch.randn(t, e, device="cuda").bfloat16()
        weights, ids = select_experts(logits, k, True)
        gate_up_cfg, down_cfg = kernels._configs(t)
        aligned = kernels.align_by_expert(ids, e + 1, gate_up_cfg["BLOCK_M"])
        gate_up = torch.empty(t * k, 2 * i, device="cuda", dtype=torch.bfloat16)
        act = torch.empty(t * k, i, device="cuda", dtype=torch.bfloat16)
        down = torch.empty(t * k, h, device="cuda", dtype=torch.bfloat16)
        w = weights.flatten().float()
        default = kernels.SILU_IN_GATE_UP_MAX_TOKENS
        times = []
        for fused_max in (t, 0):  # the SiLU-and-mul in the gate+up GEMM, then after it
            kernels.SILU_IN_GATE_UP_MAX_TOKENS = fused_max
            times.append(replay_us(lambda: kernels.fused_experts(x, w13, w2, weights, ids)))
        kernels.SILU_IN_GATE_UP_MAX_TOKENS = default
        times += [
            replay_us(lambda: select_experts(logits, k, True)),
            replay_us(lambda: kernels.align_by_expert(ids, e + 1, gate_up_cfg["BLOCK_M"])),
            replay_us(lambda: kernels._grouped_gemm(x, w13, gate_up, None, aligned, k, t * k, gate_up_cfg)),
            replay_us(lambda: kernels._SILU_AND_MUL(gate_up)),
            replay_us(lambda: kernels._grouped_gemm(x, w13, act, None, aligned, k, t * k, gate_up_cfg,
                                                     silu_and_mul=True)),
            replay_us(lambda: kernels._grouped_gemm(act, w2, down, w, aligned, 1, t * k, down_cfg)),
        ]
        hit = ids.unique().numel()
        floor = hit * 3 * h * i * 2 / (a.bandwidth_tbs * 1e12) * 1e6
        print(f"{t:6d} {hit:4d} " + " ".join(f"{v:8.1f}" for v in times) + f" {floor:8.1f}")


def _fp8_experts(a) -> tuple:
    h, i, e = a.hidden, a.intermediate, a.experts
    w13, s13 = fp8_math.quantize_rows(torch.randn(e, 2 * i, h, device="cuda") * h ** -0.5)
    w2, s2 = fp8_math.quantize_rows(torch.randn(e, h, i, device="cuda") * i ** -0.5)
    return w13, w2, s13, s2


def _fp8_steps(x, w13, s13, w2, s2, weights, ids, configs):
    """The FP8 × FP8 path's steps as separate callables (quantize, align, gate+up, down) over
    buffers of their own, for timing each."""
    t, k = ids.shape
    gate_up_cfg, down_cfg = configs
    group = gate_up_cfg["BLOCK_N"] // 2
    i = w13.shape[1] // 2
    xq, xs = fp8_quant_triton.quantize_tokens(x, fp8_math.FP8_DTYPE, fp8_math.FP8_MAX, fp8_math.MIN_AMAX)
    aligned = kernels.align_by_expert(ids, w13.shape[0] + 1, gate_up_cfg["BLOCK_M"])
    act = torch.empty(t * k, i, device="cuda", dtype=fp8_math.FP8_DTYPE)
    act_scale = torch.empty(t * k, -(-i // group), device="cuda")
    down = torch.empty(t * k, w2.shape[1], device="cuda", dtype=torch.bfloat16)
    w = weights.flatten()
    return (
        lambda: fp8_quant_triton.quantize_tokens(x, fp8_math.FP8_DTYPE, fp8_math.FP8_MAX, fp8_math.MIN_AMAX),
        lambda: kernels.align_by_expert(ids, w13.shape[0] + 1, gate_up_cfg["BLOCK_M"]),
        lambda: kernels._grouped_gemm(xq, w13, act, None, aligned, k, t * k, gate_up_cfg, silu_and_mul=True,
                                      b_scale=s13, a_scale=xs, out_scale=act_scale),
        lambda: kernels._grouped_gemm(act, w2, down, w, aligned, 1, t * k, down_cfg, b_scale=s2, a_scale=act_scale),
    )


def _compare_fp8(a) -> None:
    h, i, e, k = a.hidden, a.intermediate, a.experts, a.top_k
    w13, w2, s13, s2 = _fp8_experts(a)
    print(f"{torch.cuda.get_device_name()}: FP8 experts, hidden {h}, {e} experts of {i}, top {k}; µs per call; "
          "TFLOP/s of the two FP8 x FP8 GEMMs")
    print("tokens  weight-only  fp8xfp8  | quantize  align  gate+up  down  (fp8xfp8 steps)  TFLOP/s")
    default = kernels.FP8_MMA_MIN_TOKENS
    for t in (int(n) for n in a.tokens.split(",")):
        x = torch.randn(t, h, device="cuda").bfloat16()
        weights, ids = select_experts(torch.randn(t, e, device="cuda").bfloat16(), k, True)
        times = []
        for threshold in (t + 1, 0):  # weight-only, then FP8 x FP8
            kernels.FP8_MMA_MIN_TOKENS = threshold
            times.append(replay_us(lambda: kernels.fused_experts(x, w13, w2, weights, ids, s13, s2)))
        kernels.FP8_MMA_MIN_TOKENS = default
        steps = [replay_us(f) for f in _fp8_steps(x, w13, s13, w2, s2, weights, ids, kernels._fp8_configs(t))]
        flops = 2 * t * k * 3 * h * i
        print(f"{t:6d} {times[0]:10.1f} {times[1]:8.1f}  | " + " ".join(f"{v:7.1f}" for v in steps)
              + f"  {flops / (steps[2] + steps[3]) / 1e6:7.0f}")


def _sweep_candidates(t: int) -> list[tuple[dict, dict]]:
    """(gate+up, down) tile pairs worth timing at `t` tokens: row tiles near the pairs per expert,
    the activation's column group 64 or 128."""
    block_ms = [16, 32] if t <= 128 else [32, 64] if t <= 768 else [64, 128]
    shapes = [(4, 3), (4, 4), (8, 3)]  # (num_warps, num_stages)
    pairs = []
    for bm, group in itertools.product(block_ms, (64, 128)):
        gm = 1 if bm == 16 else 8
        for (gw, gs), (dw, ds), dn in itertools.product(shapes, shapes, (128, 256)):
            pairs.append((dict(BLOCK_M=bm, BLOCK_N=2 * group, BLOCK_K=128, GROUP_M=gm, num_warps=gw, num_stages=gs),
                          dict(BLOCK_M=bm, BLOCK_N=dn, BLOCK_K=group, GROUP_M=gm, num_warps=dw, num_stages=ds)))
    return pairs


def _sweep_fp8(a) -> None:
    """Each gate+up tile and each down tile timed once per row tile and group (the two GEMMs are
    independent given those), then the best pair: quantize + align + gate+up + down."""
    h, e, k = a.hidden, a.experts, a.top_k
    w13, w2, s13, s2 = _fp8_experts(a)
    tokens = [int(n) for n in a.tokens.split(",")]
    inputs = {}
    for t in tokens:
        x = torch.randn(t, h, device="cuda").bfloat16()
        inputs[t] = (x, *select_experts(torch.randn(t, e, device="cuda").bfloat16(), k, True))
    with compile_ahead(torch.device("cuda"), "the sweep's variants", workers=16) as ahead:
        if ahead:
            for t in tokens:
                x, weights, ids = inputs[t]
                for configs in _sweep_candidates(t):
                    for f in _fp8_steps(x, w13, s13, w2, s2, weights, ids, configs):
                        f()
    print(f"{torch.cuda.get_device_name()}: FP8 x FP8 tiles, hidden {h}, {e} experts of {a.intermediate}, top {k}")
    for t in tokens:
        x, weights, ids = inputs[t]
        gate_up_times, down_times, fixed = {}, {}, {}
        for gate_up_cfg, down_cfg in _sweep_candidates(t):
            steps = _fp8_steps(x, w13, s13, w2, s2, weights, ids, (gate_up_cfg, down_cfg))
            key = (gate_up_cfg["BLOCK_M"], gate_up_cfg["BLOCK_N"] // 2)
            if key not in fixed:
                fixed[key] = replay_us(steps[0]) + replay_us(steps[1])
            name = tuple(sorted(gate_up_cfg.items()))
            if name not in gate_up_times:
                gate_up_times[name] = (replay_us(steps[2]), key, gate_up_cfg)
            name = tuple(sorted(down_cfg.items()))
            if name not in down_times:
                down_times[name] = (replay_us(steps[3]), key, down_cfg)
        best = None
        for key in fixed:
            gu = min((v for v in gate_up_times.values() if v[1] == key), key=lambda v: v[0])
            dn = min((v for v in down_times.values() if v[1] == key), key=lambda v: v[0])
            total = fixed[key] + gu[0] + dn[0]
            print(f"  {t:6d} tokens, BLOCK_M {key[0]:3d}, group {key[1]:3d}: {total:8.1f} µs = quantize+align "
                  f"{fixed[key]:.1f} + gate+up {gu[0]:.1f} {_short(gu[2])} + down {dn[0]:.1f} {_short(dn[2])}")
            if best is None or total < best[0]:
                best = (total, key)
        current = sum(replay_us(f) for f in _fp8_steps(x, w13, s13, w2, s2, weights, ids, kernels._fp8_configs(t)))
        print(f"{t:6d} tokens: best {best[0]:.1f} µs (BLOCK_M {best[1][0]}, group {best[1][1]}); "
              f"the tiles in use: {current:.1f}")


def _short(cfg: dict) -> str:
    return f"[N{cfg['BLOCK_N']} K{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']}]"


if __name__ == "__main__":
    main()

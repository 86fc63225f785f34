"""`python -m pagoda_engine.bench.moe_kernels`: one MoE layer's experts on the GPU, step by step
(routing, alignment by expert, the two grouped GEMMs) at Qwen3-30B-A3B's shapes, each timed as a
CUDA-graph replay, beside the time it takes to read the weights of the experts that were hit."""

from __future__ import annotations

import argparse

import torch

from pagoda_engine.worker.model import fused_moe_triton as kernels
from pagoda_engine.worker.model.moe import select_experts


def _replay_us(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,8,64,256,4096,16384")
    p.add_argument("--bandwidth-tbs", type=float, default=4.0, help="for the weight-read floor (H200 copy: 4.27)")
    a = p.parse_args(argv)
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
            times.append(_replay_us(lambda: kernels.fused_experts(x, w13, w2, weights, ids)))
        kernels.SILU_IN_GATE_UP_MAX_TOKENS = default
        times += [
            _replay_us(lambda: select_experts(logits, k, True)),
            _replay_us(lambda: kernels.align_by_expert(ids, e + 1, gate_up_cfg["BLOCK_M"])),
            _replay_us(lambda: kernels._grouped_gemm(x, w13, gate_up, None, aligned, k, t * k, gate_up_cfg)),
            _replay_us(lambda: kernels._SILU_AND_MUL(gate_up)),
            _replay_us(lambda: kernels._grouped_gemm(x, w13, act, None, aligned, k, t * k, gate_up_cfg,
                                                     silu_and_mul=True)),
            _replay_us(lambda: kernels._grouped_gemm(act, w2, down, w, aligned, 1, t * k, down_cfg)),
        ]
        hit = ids.unique().numel()
        floor = hit * 3 * h * i * 2 / (a.bandwidth_tbs * 1e12) * 1e6
        print(f"{t:6d} {hit:4d} " + " ".join(f"{v:8.1f}" for v in times) + f" {floor:8.1f}")


if __name__ == "__main__":
    main()

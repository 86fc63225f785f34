"""The mixture-of-experts layer: one `FusedMoE` owns routing (softmax over the experts, top-k,
optional renormalisation), the experts (SiLU-gated MLPs) and the weighted combine; MoE models only
declare it (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE).

Expert weights are stacked at load time, whatever the checkpoint's layout: `experts.w13`
[experts, 2 × intermediate, hidden] (gate rows, then up rows) and `experts.w2`
[experts, hidden, intermediate]. The Hub stores one tensor per expert and projection
(`experts.<e>.w1|w3|w2.weight` in Mixtral, `experts.<e>.gate_proj|up_proj|down_proj.weight` in
Qwen-MoE); `expert_checkpoint_piece` maps those names onto the stacked parameters.

Tensor parallelism splits each expert's intermediate dimension (like the dense MLP: gate/up
column-parallel, down row-parallel) and all-reduces the combined output once per layer. Expert
parallelism (`enable_expert_parallel`) instead gives each rank whole experts, E / ranks of them;
every rank routes every token (the tokens are the same on all ranks of a tensor-parallel group),
computes the pairs whose expert it holds, and the same one all-reduce combines them.

Expert ids reaching the expert kernels are local: `0 .. E_local - 1` for the experts this rank
holds, `E_local` for a pair whose expert lives elsewhere (it contributes nothing here).

`fused_experts_reference` is a plain loop over the experts that were hit, in the same order of
operations as transformers: exact on CPU, and the reference the GPU kernels are tested against.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from pagoda_engine.worker.model.layers import (
    GatedMLP,
    LinearBase,
    TPGroup,
    _check_shape,
    _divide,
    _group,
    _set_weight_loader,
    default_weight_loader,
)

# Checkpoint projection name → (stacked parameter, piece): piece 0/1 are w13's gate/up halves.
_PROJECTIONS = {
    "w1": ("w13", 0), "gate_proj": ("w13", 0),
    "w3": ("w13", 1), "up_proj": ("w13", 1),
    "w2": ("w2", None), "down_proj": ("w2", None),
}
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[a-z0-9_]+)\.weight$")


def expert_checkpoint_piece(name: str) -> tuple[str, tuple[int, int | None]] | None:
    """For a per-expert checkpoint tensor name, the stacked parameter it fills and its piece
    `(expert, half)`; None for any other name."""
    match = _EXPERT_NAME.match(name)
    if match is None or match["proj"] not in _PROJECTIONS:
        return None
    stacked, half = _PROJECTIONS[match["proj"]]
    return f"{match['prefix']}.{stacked}", (int(match["expert"]), half)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [tokens, top_k]: softmax over all experts in float32, the top k,
    optionally renormalised to sum to one, weights cast back to the logits' dtype (as transformers).
    One Triton launch for half-precision CUDA logits, torch operations otherwise."""
    if _triton_kernels_apply(router_logits):
        from pagoda_engine.worker.model.fused_moe_triton import route

        return route(router_logits, top_k, renormalize)
    return select_experts_reference(router_logits, top_k, renormalize)


def select_experts_reference(router_logits: torch.Tensor, top_k: int, renormalize: bool
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
    """sum over each token's chosen experts of weight × down(silu(gate(x)) × up(x)); a loop over the
    experts that were hit."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    hit = torch.bincount(topk_ids.flatten(), minlength=num_experts + 1)[:num_experts].nonzero().flatten().tolist()
    for expert in hit:
        token_idx, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(x[token_idx], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def _triton_kernels_apply(x: torch.Tensor) -> bool:
    """The Triton kernels serve half-precision CUDA tensors; everything else takes the torch path."""
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def _experts_kernel(x: torch.Tensor):
    """The Triton grouped GEMMs for half-precision CUDA tensors, the exact loop otherwise."""
    if _triton_kernels_apply(x):
        from pagoda_engine.worker.model.fused_moe_triton import fused_experts

        return fused_experts
    return fused_experts_reference


class _StackedExperts(nn.Module):
    """This rank's experts, stacked: `w13` [E_local, 2 × I_shard, H] and `w2` [E_local, H, I_shard].
    Tensor parallelism shards I (every expert local); expert parallelism keeps I whole and holds
    experts [first, first + E_local)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp_size: int, tp_rank: int,
                 expert_parallel: bool):
        super().__init__()
        if expert_parallel:
            self.num_local = _divide(num_experts, tp_size, "number of experts")
            self.first = tp_rank * self.num_local
            self.shards, self.shard_rank = 1, 0
        else:
            self.num_local, self.first = num_experts, 0
            self.shards, self.shard_rank = tp_size, tp_rank
        self.shard = _divide(intermediate_size, self.shards, "moe intermediate size")
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.shard, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.shard))
        experts = range(self.first, self.first + self.num_local)
        _set_weight_loader(self.w13, self._load_w13, [(e, half) for e in experts for half in (0, 1)])
        _set_weight_loader(self.w2, self._load_w2, [(e, None) for e in experts])

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids → this rank's numbering, `num_local` for experts held elsewhere."""
        local = topk_ids - self.first
        return local.masked_fill((local < 0) | (local >= self.num_local), self.num_local)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, piece: tuple[int, int]) -> None:
        expert, half = piece
        if not self.first <= expert < self.first + self.num_local:
            return  # another rank's expert
        n = self.shard
        _check_shape(loaded, (n * self.shards, param.shape[2]))
        default_weight_loader(param[expert - self.first].narrow(0, half * n, n),
                              loaded.narrow(0, self.shard_rank * n, n))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, piece: tuple[int, None]) -> None:
        expert = piece[0]
        if not self.first <= expert < self.first + self.num_local:
            return
        n = self.shard
        _check_shape(loaded, (param.shape[1], n * self.shards))
        default_weight_loader(param[expert - self.first], loaded.narrow(1, self.shard_rank * n, n))


class FusedMoE(nn.Module):
    """Routing, experts and combine of one MoE block. Parameter names follow the checkpoints:
    `gate` (the router), `experts.w13` / `experts.w2` (stacked), and with a shared expert
    `shared_expert.*` and `shared_expert_gate`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 shared_expert_intermediate_size: int = 0, tp_size: int = 1, tp_rank: int = 0,
                 expert_parallel: bool = False):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.tp_group: TPGroup | None = None
        self.gate = LinearBase(hidden_size, num_experts)
        _set_weight_loader(self.gate.weight, default_weight_loader)
        self.experts = _StackedExperts(num_experts, hidden_size, intermediate_size, tp_size, tp_rank, expert_parallel)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            # Qwen2-MoE's dense expert every token takes, scaled by sigmoid of its own gate; the
            # layer all-reduces once, for the routed and the shared experts together.
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, tp_size=tp_size,
                                          tp_rank=tp_rank, reduce_results=False)
            self.shared_expert_gate = LinearBase(hidden_size, 1)
            _set_weight_loader(self.shared_expert_gate.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.experts.num_local < self.num_experts:
            ids = self.experts.local_ids(ids)
        out = _experts_kernel(x)(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp_size > 1:
            _group(self).all_reduce(out)
        return out

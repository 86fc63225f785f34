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

Expert parallelism across data-parallel engine cores (`--data-parallel-size` with EP) spreads the
experts over every rank of every core (`expert_ranks`: the EP group is TP × DP, ep_rank =
dp_rank × tp + tp_rank), while each core runs its own batch. `DataParallelDispatch` moves the
tokens: before the experts an all-gather over the DP group (the ranks of the same TP position in
every core) gives each rank every core's tokens, padded to the largest core's count; each rank
routes them all and computes its own experts' share; a reduce-scatter returns each core its own
rows, summed over the cores, and the TP all-reduce then sums over the core's TP ranks. This is
vLLM's "allgather_reducescatter" backend, the default (`--all2all-backend`): its pieces are
equal-sized (what NCCL's all-gather and reduce-scatter take, and what CUDA graphs of padded
decode steps capture: `worker/dp_padding.py`), and the host needs no per-layer counts (a device
sync per layer on CUDA). `--all2all-backend alltoallv` sends each token only to the ranks that
hold its experts, with counts exchanged first (`moe_all_to_all.py`), in eager steps; steps
replayed in CUDA graphs keep the all-gather. Measured on CPU (gloo, hidden 2048, top-8 of 128, dispatch and combine, medians; a
shared 2-core machine): with 2 processes the all-to-all won up to 8 tokens per core (0.53 against
0.93 ms at 1, 0.90 against 1.15 ms at 8) and lost from 32 (4.6 against 2.4 ms; 13.2 against
7.3 ms at 128); with 4 processes on those 2 cores it won throughout (2.3 against 28.7 ms at 1,
31.7 against 40.7 ms at 128), the ring's extra rounds each waiting for a descheduled process
(that all-to-all sent a token once per chosen expert; `moe_all_to_all.py` sends it once per
rank). A core with nothing to run still joins, with a dummy batch (`Worker.execute_dummy_batch`).
Rows that are no request's token (padding to the largest core, padded decode steps, dummy
batches) go to no expert (`DataParallelDispatch.real_rows`), so each layer's `load` counts the
requests' tokens its experts took (`worker/eplb.py` reads them); under EPLB an `ExpertMap` sends
each pair to one copy of its logical expert, and the slots are physical.

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

from pagoda_engine.worker.model import fp8_math
from pagoda_engine.worker.model.layers import (
    GatedMLP,
    LinearBase,
    RMSNorm,
    TPGroup,
    _check_shape,
    _divide,
    _gemv_norm_kernels,
    _group,
    _set_weight_loader,
    default_weight_loader,
)
from pagoda_engine.worker.model.moe_all_to_all import dispatch_and_combine

# Checkpoint projection name → (stacked parameter, piece): piece 0/1 are w13's gate/up halves.
_PROJECTIONS = {
    "w1": ("w13", 0), "gate_proj": ("w13", 0),
    "w3": ("w13", 1), "up_proj": ("w13", 1),
    "w2": ("w2", None), "down_proj": ("w2", None),
}
_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>[a-z0-9_]+)\.(?P<kind>weight|weight_scale)$")


def expert_checkpoint_piece(name: str) -> tuple[str, tuple[int, int | None]] | None:
    """For a per-expert checkpoint tensor name, the stacked parameter it fills and its piece
    `(expert, half)`; None for any other name. An FP8 checkpoint's `weight_scale` fills the
    stacked scales (`w13_scale`, `w2_scale`)."""
    match = _EXPERT_NAME.match(name)
    if match is None or match["proj"] not in _PROJECTIONS:
        return None
    stacked, half = _PROJECTIONS[match["proj"]]
    suffix = "_scale" if match["kind"] == "weight_scale" else ""
    return f"{match['prefix']}.{stacked}{suffix}", (int(match["expert"]), half)


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


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight in `dtype`: an FP8 one times its row scales."""
    if scale is None:
        return w[expert]
    return (w[expert].float() * scale[expert].unsqueeze(-1)).to(dtype)


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                            w2_scale: torch.Tensor | None = None, fp8_act_group: int | None = None) -> torch.Tensor:
    """sum over each token's chosen experts of weight × down(silu(gate(x)) × up(x)); a loop over the
    experts that were hit. FP8 experts (`fp8.quantize_linear_layers`) come with float32 scales per
    expert and row, [E, 2I] and [E, H]: their weights are widened and scaled, the activations stay
    in x's dtype. With `fp8_act_group` the activations are quantized too, as the GPU's FP8 × FP8
    grouped GEMMs do (`fused_moe_triton._fused_experts_fp8`): x per token, the activation entering
    down per token and group of that many columns; products in float32, the result in x's dtype."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    hit = torch.bincount(topk_ids.flatten(), minlength=num_experts + 1)[:num_experts].nonzero().flatten().tolist()
    if fp8_act_group is not None:
        xq, x_scale = fp8_math.quantize_tokens(x)
        x = xq.float() * x_scale
    for expert in hit:
        token_idx, slot = torch.where(topk_ids == expert)
        if fp8_act_group is None:
            gate, up = F.linear(x[token_idx], _expert_weight(w13, w13_scale, expert, x.dtype)).chunk(2, dim=-1)
            act = F.silu(gate) * up
        else:
            gate, up = F.linear(x[token_idx], _expert_weight(w13, w13_scale, expert, torch.float32)).chunk(2, dim=-1)
            act = fp8_math.dequantize_groups(*fp8_math.quantize_groups(F.silu(gate) * up, fp8_act_group), fp8_act_group)
        y = F.linear(act, _expert_weight(w2, w2_scale, expert, act.dtype)) * topk_weights[token_idx, slot, None]
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


def expert_ranks(tp_size: int, tp_rank: int, data_parallel: tuple[int, int] = (1, 0)) -> tuple[int, int]:
    """(EP size, EP rank) of a rank: every TP rank of every data-parallel core (`data_parallel` =
    (size, this core's rank)), TP innermost, as vLLM lays them out."""
    dp_size, dp_rank = data_parallel
    return tp_size * dp_size, dp_rank * tp_size + tp_rank


class StackedExperts(nn.Module):
    """This rank's experts, stacked: `w13` [E_local, 2 × I_shard, H] and `w2` [E_local, H, I_shard].
    Tensor parallelism shards I (every expert local); expert parallelism keeps I whole and holds
    experts [first, first + E_local), E_local = E / EP size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp_size: int, tp_rank: int,
                 expert_parallel: bool, data_parallel: tuple[int, int] = (1, 0)):
        super().__init__()
        if expert_parallel:
            ep_size, ep_rank = expert_ranks(tp_size, tp_rank, data_parallel)
            self.num_local = _divide(num_experts, ep_size, "number of experts")
            self.first = ep_rank * self.num_local
            self.shards, self.shard_rank = 1, 0
        else:
            self.num_local, self.first = num_experts, 0
            self.shards, self.shard_rank = tp_size, tp_rank
        self.shard = _divide(intermediate_size, self.shards, "moe intermediate size")
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * self.shard, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, self.shard))
        # FP8 experts' float32 scales per expert and row (`fp8.quantize_linear_layers`).
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
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
                 expert_parallel: bool = False, data_parallel: tuple[int, int] = (1, 0)):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.tp_group: TPGroup | None = None
        self.dp_dispatch: DataParallelDispatch | None = None  # experts across cores: `attach_dp_dispatch`
        self.gate = LinearBase(hidden_size, num_experts)
        _set_weight_loader(self.gate.weight, default_weight_loader)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, tp_size, tp_rank, expert_parallel,
                                       data_parallel)
        self.across_cores = expert_parallel and data_parallel[0] > 1
        # Experts across cores: tokens each of this rank's experts took (its slots, then one for
        # pairs computed elsewhere), accumulated on the device (`expert_load`).
        self.load = torch.zeros(self.experts.num_local + 1, dtype=torch.int64) if self.across_cores else None
        self.expert_map: ExpertMap | None = None  # EPLB's logical → physical experts (`worker/eplb.py`)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            # Qwen2-MoE's dense expert every token takes, scaled by sigmoid of its own gate; the
            # layer all-reduces once, for the routed and the shared experts together.
            self.shared_expert = GatedMLP(hidden_size, shared_expert_intermediate_size, tp_size=tp_size,
                                          tp_rank=tp_rank, reduce_results=False)
            self.shared_expert_gate = LinearBase(hidden_size, 1)
            _set_weight_loader(self.shared_expert_gate.weight, default_weight_loader)

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for the tokens x; `logits`: the router's for them, when made already
        (by `normed`, which has the tokens' experts on this core)."""
        if self.across_cores and _dispatch(self).sends_pairs():
            weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
            if self.expert_map is not None:
                ids = self.expert_map.physical(ids)
            dispatch, experts = self.dp_dispatch, self.experts

            def local_experts(t: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
                self._count(i)
                return _experts_kernel(t)(t, experts.w13, experts.w2, w, i, experts.w13_scale, experts.w2_scale)

            out = dispatch_and_combine(x, weights, ids, dispatch.group, self.tp_size, self.tp_rank, experts.num_local,
                                       local_experts, dispatch.real_rows_here(x), dispatch.microbatches)
        elif self.across_cores:
            dispatch = _dispatch(self)
            tokens = dispatch.dispatch(x)
            out = dispatch.combine(self._routed_experts(tokens, dispatch.padding_rows(tokens)))
        else:
            out = self._routed_experts(x, logits=logits)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.tp_size > 1:
            _group(self).all_reduce(out)
        return out

    def normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(normalised), residual) after `norm(x, residual)`. At one row on CUDA, where the
        block has no shared expert and its experts are this core's, the norm and the router are
        one kernel, which also writes the normalised row the experts read."""
        gemv = None
        if not self.across_cores and self.shared_expert is None:
            gemv = _gemv_norm_kernels(norm, x, residual, self.gate.weight)
        if gemv is None:
            x, residual = norm(x, residual)
            return self(x), residual
        logits, residual, x = gemv.gemv_rmsnorm(x, residual, norm.weight, norm.eps, self.gate.weight, normed_out=True,
                                                scale=self.gate.weight_scale)
        return self(x, logits), residual

    def _count(self, local_ids: torch.Tensor) -> None:
        """Add a forward's pairs (ids local to this rank, `num_local` for none here) to `load`."""
        if self.load is not None:
            flat = local_ids.flatten()
            self.load.index_add_(0, flat, torch.ones_like(flat, dtype=self.load.dtype))

    def _routed_experts(self, x: torch.Tensor, padding: torch.Tensor | None = None,
                        logits: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's experts' share of the routed output for the tokens `x`; rows where
        `padding` is true (dispatch padding) go to no expert. `logits`: the router's, when made
        already."""
        weights, ids = select_experts(self.gate(x) if logits is None else logits, self.top_k, self.renormalize)
        if self.expert_map is not None:
            ids = self.expert_map.physical(ids)
        if self.experts.num_local < self.num_experts or self.expert_map is not None:
            ids = self.experts.local_ids(ids)
        if padding is not None:
            ids = ids.masked_fill(padding[:, None], self.experts.num_local)
            self._count(ids)
        experts = self.experts
        return _experts_kernel(x)(x, experts.w13, experts.w2, weights, ids, experts.w13_scale, experts.w2_scale)


ALLGATHER, ALLTOALLV = "allgather_reducescatter", "alltoallv"  # `config.ALL2ALL_BACKENDS`


class ExpertMap:
    """EPLB's logical → physical experts of one layer (`eplb.py`): `placement[slot]` is the
    logical expert physical slot `slot` holds (EP rank r holds slots [r × n, (r + 1) × n)). On
    the device, updated in place so that CUDA graphs read the current map: each logical expert's
    slots (`slots` [E, most copies], padded with its first) and how many (`copies` [E])."""

    def __init__(self, num_logical: int, placement: list[int], device: torch.device | None = None):
        self.num_logical = num_logical
        self.slots = torch.zeros(num_logical, len(placement) - num_logical + 1, dtype=torch.int64, device=device)
        self.copies = torch.ones(num_logical, dtype=torch.int64, device=device)
        self.placement: list[int] = []
        self.set(placement)

    def set(self, placement: list[int]) -> None:
        if sorted(set(placement)) != list(range(self.num_logical)):
            raise ValueError(f"a placement must hold every one of the {self.num_logical} experts, got {placement}")
        table: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, expert in enumerate(placement):
            table[expert].append(slot)
        width = self.slots.shape[1]
        self.slots.copy_(torch.tensor([t + [t[0]] * (width - len(t)) for t in table], dtype=torch.int64))
        self.copies.copy_(torch.tensor([len(t) for t in table], dtype=torch.int64))
        self.placement = list(placement)

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [n, k] → physical slots: row i takes copy i mod the expert's copies,
        so that an expert's copies share its tokens."""
        row = torch.arange(ids.shape[0], device=ids.device)[:, None]
        return self.slots[ids, row % self.copies[ids]]


class DataParallelDispatch:
    """The MoE layers' token exchange with the other data-parallel engine cores, shared by every
    FusedMoE of one rank's model. Once per forward, before the first layer, either
    `begin_forward` learns every core's token count over `count_group` (gloo on CPU, so no device
    sync), or `set_counts` is told them (`dp_padding.CoreStepAgreement` agreed on them), or
    `begin_uniform` says every core runs as many rows as this one (padded decode steps, and the
    CUDA graphs captured for them). `dispatch` all-gathers the tokens over `group` (the device's),
    `combine` reduce-scatters the experts' output back; with `backend` alltoallv, eager forwards
    send each token only where its experts are instead (`moe_all_to_all.py`)."""

    def __init__(self, group: TPGroup, count_group: TPGroup, backend: str = ALLGATHER,
                 device: torch.device | None = None, microbatches: int = 1):
        if backend not in (ALLGATHER, ALLTOALLV):
            raise ValueError(f"all2all backend must be {ALLGATHER} or {ALLTOALLV}, got {backend!r}")
        self.group = group
        self.count_group = count_group
        self.backend = backend
        self.microbatches = microbatches  # the all-to-all's, overlapped with each other's experts (`--enable-dbo`)
        self.counts: list[int] = []
        self.uniform = False  # every core runs this core's row count: no counts were exchanged
        # Each core's rows that are its requests' tokens this forward (the rest: padding, or an
        # idle core's dummy token), on the device, updated in place: CUDA graphs read it at replay.
        self.real_rows = torch.zeros(group.size, dtype=torch.int64, device=device)

    def begin_forward(self, num_tokens: int, real_tokens: int | None = None) -> None:
        """Learn every core's row count (and of them its requests' tokens: `real_tokens`, default all)."""
        mine = torch.tensor([num_tokens, num_tokens if real_tokens is None else real_tokens], dtype=torch.int64)
        gathered = [g.tolist() for g in self.count_group.all_gather(mine)]
        self.set_counts([rows for rows, _ in gathered], [real for _, real in gathered])

    def set_counts(self, counts: list[int], real: list[int] | None = None) -> None:
        """Every core's rows this forward, and of them its requests' tokens (default: all)."""
        self.counts, self.uniform = list(counts), False
        self.real_rows.copy_(torch.tensor(counts if real is None else real, dtype=torch.int64))

    def begin_uniform(self, real: list[int] | None = None) -> None:
        """Every core runs this core's row count, `real` of them its requests' tokens (None: the
        real rows are set before each replay of the graphs being captured)."""
        self.counts, self.uniform = [], True
        if real is not None:
            self.real_rows.copy_(torch.tensor(real, dtype=torch.int64))

    def real_rows_here(self, x: torch.Tensor) -> torch.Tensor:
        """Which of this core's rows `x` are its requests' tokens."""
        return torch.arange(x.shape[0], device=x.device) < self.real_rows.to(x.device)[self.group.rank]

    def sends_pairs(self) -> bool:
        """Whether this layer's exchange is the all-to-all: asked for, and not inside a CUDA graph
        (whose collectives must be the same size at every replay)."""
        return self.backend == ALLTOALLV and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    @property
    def padded(self) -> int:
        """Tokens per core in the collectives: the largest core's count."""
        return max(self.counts)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """Every core's tokens, core after core, each padded to `padded` rows: [dp × padded, H]."""
        if self.uniform:
            self.counts = [x.shape[0]] * self.group.size
        if len(self.counts) != self.group.size or x.shape[0] != self.counts[self.group.rank]:
            raise RuntimeError(f"the MoE dispatch was told {self.counts} tokens per core, this core has "
                               f"{x.shape[0]}: begin_forward was not called for this forward")
        return torch.cat(self.group.all_gather(F.pad(x, (0, 0, 0, self.padded - x.shape[0]))))

    def padding_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Which rows of `dispatch`'s result are not requests' tokens (padding to the largest core,
        padded decode steps' dummy rows, an idle core's dummy token): they go to no expert. Made
        from `real_rows` by each layer, so that a graph's replay reads the step's own."""
        row = torch.arange(tokens.shape[0] // self.group.size, device=tokens.device)
        return (row[None, :] >= self.real_rows.to(tokens.device)[:, None]).flatten()

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """`out` [dp × padded, H] summed over the cores, this core's rows only: [its count, H]."""
        mine = self.group.reduce_scatter(out)
        return mine[:self.counts[self.group.rank]]


def attach_dp_dispatch(model: nn.Module, dispatch: DataParallelDispatch) -> None:
    """Give every MoE layer whose experts span the data-parallel cores the dispatch it uses."""
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.across_cores:
            module.dp_dispatch = dispatch


def _dispatch(layer: FusedMoE) -> DataParallelDispatch:
    if layer.dp_dispatch is None:
        raise RuntimeError("FusedMoE spans data-parallel cores but has no DataParallelDispatch "
                           "(attach one with attach_dp_dispatch)")
    return layer.dp_dispatch

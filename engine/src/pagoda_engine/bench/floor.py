"""A throughput run's floor: the least time its steps could take on this device.

The single-stream roofline (`offline._roofline`) bounds one request's decode step. A batched
workload's steps differ from each other (a prompt's chunks, decode batches that shrink as
requests finish, contexts that grow), so its floor is summed over the steps the scheduler
actually made (`StepRecorder`): each step takes at least the longer of
- its bytes over the device's measured copy bandwidth: the weights it reads (the dense layers
  and the LM head in full, one embedding row per token, and of an MoE layer the experts its
  tokens route to: E x (1 - (1 - k/E)^T) of E experts for T tokens routed to k each, the expected
  count under uniform routing, which dummy weights give; trained routers concentrate tokens on
  fewer experts, so their floor is lower), plus the K/V it reads (each row's context, once) and
  writes (its new tokens);
- its floating-point work over a measured bf16 matmul rate (`offline.measure_matmul_flops`): two per weight per token for the
  dense layers and the k experts, the LM head for each row that samples, and attention's QK and
  PV products over each new token's context.
`floor / measured` is then the share of the device's limits the run reached. Activations, norms,
routing and sampling are left out: they only make the floor lower.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

@dataclass
class ModelCosts:
    """What a step of this model reads and computes, per token and per step."""
    dense_bytes: int  # weights every step reads in full: attention, norms, routers, dense MLPs, the LM head
    embed_row_bytes: int  # one embedding row (read per token)
    lm_head_params: int  # multiplied once per sampling row
    dense_params_per_token: int  # the weights every token multiplies (not the LM head, not experts)
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_bytes: int = 0  # one expert of one layer
    expert_params: int = 0
    kv_bytes_per_token: int = 0  # K and V of one token, all layers
    attn_flops_per_pair: int = 0  # one query token against one context token, all layers (QK and PV)


def unique_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters, weights that share storage (tied embeddings) once."""
    return list({p.data_ptr(): p for p in model.parameters()}.values())


def model_costs(model: torch.nn.Module, num_layers: int, num_qo_heads: int, head_dim: int,
                kv_bytes_per_token: int) -> ModelCosts:
    """`model`'s costs from its parameters (tied weights once) and its attention's shape."""
    from pagoda_engine.worker.model.moe import FusedMoE

    params = unique_parameters(model)
    total_bytes = sum(p.numel() * p.element_size() for p in params)
    total_params = sum(p.numel() for p in params)
    moe = [m for m in model.modules() if isinstance(m, FusedMoE)]
    expert_bytes = expert_params = 0
    if moe:
        first = moe[0].experts
        expert_bytes = (first.w13.nbytes + first.w2.nbytes) // first.w13.shape[0]
        expert_params = (first.w13.numel() + first.w2.numel()) // first.w13.shape[0]
        total_bytes -= sum(m.experts.w13.nbytes + m.experts.w2.nbytes for m in moe)
        total_params -= sum(m.experts.w13.numel() + m.experts.w2.numel() for m in moe)
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    tied = embed.data_ptr() == lm_head.data_ptr()
    dense_bytes = total_bytes - (0 if tied else embed.nbytes)
    dense_params = total_params - lm_head.numel() - (0 if tied else embed.numel())
    return ModelCosts(
        dense_bytes=dense_bytes, embed_row_bytes=embed.nbytes // embed.shape[0], lm_head_params=lm_head.numel(),
        dense_params_per_token=dense_params, moe_layers=len(moe), num_experts=moe[0].num_experts if moe else 0,
        top_k=moe[0].top_k if moe else 0, expert_bytes=expert_bytes, expert_params=expert_params,
        kv_bytes_per_token=kv_bytes_per_token, attn_flops_per_pair=4 * num_layers * num_qo_heads * head_dim)


@dataclass
class StepShape:
    """One scheduled step: each row's (tokens computed before it, new tokens, samples)."""
    rows: list[tuple[int, int, bool]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.rows)


def expected_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    """Distinct experts `num_tokens` tokens reach, each routed to `top_k` of `num_experts` at random."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def step_bytes(c: ModelCosts, step: StepShape) -> float:
    tokens = step.num_tokens
    experts = c.moe_layers * expected_experts(c.num_experts, c.top_k, tokens) * c.expert_bytes if c.moe_layers else 0
    kv = sum(before + new for before, new, _ in step.rows) * c.kv_bytes_per_token  # read the context, write the new
    return c.dense_bytes + tokens * c.embed_row_bytes + experts + kv


def step_flops(c: ModelCosts, step: StepShape) -> float:
    tokens = step.num_tokens
    samples = sum(1 for _, _, s in step.rows if s)
    weights = 2 * (tokens * (c.dense_params_per_token + c.moe_layers * c.top_k * c.expert_params)
                   + samples * c.lm_head_params)
    # Token i of a row's new ones (0-based) attends to before + i + 1 positions.
    pairs = sum(new * before + new * (new + 1) // 2 for before, new, _ in step.rows)
    return weights + pairs * c.attn_flops_per_pair


def run_floor(c: ModelCosts, steps: list[StepShape], bandwidth_Bps: float, flops_per_s: float) -> dict:
    """The floor of a run of `steps` (seconds), and how much of it is bound by bytes."""
    total = bound_by_bytes = 0.0
    for step in steps:
        t_bytes, t_flops = step_bytes(c, step) / bandwidth_Bps, step_flops(c, step) / flops_per_s
        total += max(t_bytes, t_flops)
        bound_by_bytes += t_bytes if t_bytes >= t_flops else 0.0
    return {"floor_s": total, "memory_bound_s": bound_by_bytes, "steps": len(steps)}


class StepRecorder:
    """Records every step the scheduler makes (`Scheduler.schedule`), with each row's context
    before the step, its new tokens and whether it samples. Installed on an engine core's
    scheduler until `remove`."""

    def __init__(self, scheduler):
        self.scheduler, self.steps = scheduler, []
        self._schedule = scheduler.schedule

        def schedule(*args, **kwargs):
            out = self._schedule(*args, **kwargs)
            if out.scheduled:
                self.steps.append(StepShape([(x.request.num_computed_tokens, x.num_new_tokens, x.completes_sequence)
                                             for x in out.scheduled]))
            return out

        scheduler.schedule = schedule

    def remove(self) -> None:
        del self.scheduler.schedule  # the instance attribute goes; the class's method shows again

"""One rank's side of expert-parallel load balancing (`--enable-eplb`; the arithmetic and the
settings are `pagoda_engine/eplb.py`) and of the expert-load counters, for MoE layers whose
experts span the data-parallel cores.

Every MoE layer counts, on the device, the tokens each of this rank's expert slots took
(`FusedMoE.load`, real rows only: padding and dummy rows go to no expert). `ExpertLoad.read`
turns them into tokens per logical expert, per layer, for the metrics; reading is a device sync,
made at the metrics' cadence, not per step.

With EPLB each layer gets (E + R) / ranks slots per rank (`setup`, at start-up, before the CUDA
graphs are captured), and every `step_interval` forwards (the cores step in lockstep, so every
rank reaches the same forward) `after_forward` re-places them: every rank gathers the window's
per-slot counts over the EP group, computes the same placement from the same numbers
(`eplb.rebalance`), gathers the layer's expert weights and copies its new slots' in place, where
the graphs read them. Only where the EP group is the MoE dispatch's group (one rank per core,
`--tensor-parallel-size 1`): the one group that has every expert's holder.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagoda_engine import eplb
from pagoda_engine.worker.model.layers import TPGroup
from pagoda_engine.worker.model.moe import ExpertMap, FusedMoE

logger = logging.getLogger(__name__)


def moe_layers(model: nn.Module) -> list[FusedMoE]:
    """The model's MoE layers whose experts span the cores, in order."""
    return [m for m in model.modules() if isinstance(m, FusedMoE) and m.across_cores]


class ExpertLoad:
    """Tokens per logical expert and MoE layer that this rank's experts took since start-up: the
    device counters, plus what earlier placements counted (folded in at each re-placement)."""

    def __init__(self, layers: list[FusedMoE]):
        self.layers = layers
        self.folded = [[0] * layer.num_experts for layer in layers]

    def _slots(self, layer: FusedMoE) -> list[int]:
        """The logical expert of each of this rank's slots."""
        experts = layer.experts
        if layer.expert_map is None:
            return list(range(experts.first, experts.first + experts.num_local))
        return layer.expert_map.placement[experts.first:experts.first + experts.num_local]

    def fold(self, index: int) -> None:
        """Move layer `index`'s device counts into `folded` (before its slots change)."""
        layer = self.layers[index]
        for expert, count in zip(self._slots(layer), layer.load[:-1].tolist()):
            self.folded[index][expert] += count
        layer.load.zero_()

    def read(self) -> list[list[int]]:
        """[layer][logical expert] tokens this rank's experts took (a device sync)."""
        out = []
        for index, layer in enumerate(self.layers):
            counts = list(self.folded[index])
            for expert, count in zip(self._slots(layer), layer.load[:-1].tolist()):
                counts[expert] += count
            out.append(counts)
        return out


def _place(layer: FusedMoE, placement: list[int], group: TPGroup) -> None:
    """Give this rank's slots the experts `placement` names, from wherever they are now: every
    rank's slots gathered, this rank's new ones copied (in place when their number is unchanged,
    so that captured graphs read the new weights)."""
    experts = layer.experts
    old = layer.expert_map.placement if layer.expert_map is not None else list(range(layer.num_experts))
    source = {}
    for slot, expert in enumerate(old):
        source.setdefault(expert, slot)
    per_rank = len(placement) // group.size
    mine = placement[group.rank * per_rank:(group.rank + 1) * per_rank]
    index = torch.tensor([source[e] for e in mine], device=experts.w13.device)
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        param = getattr(experts, name)
        if param is None:
            continue
        every = torch.cat(group.all_gather(param.data))
        if param.shape[0] == per_rank:
            param.data.copy_(every[index])
        else:
            setattr(experts, name, nn.Parameter(every[index], requires_grad=False))
    experts.num_local, experts.first = per_rank, group.rank * per_rank
    if layer.expert_map is None:
        layer.expert_map = ExpertMap(layer.num_experts, placement, experts.w13.device)
    else:
        layer.expert_map.set(placement)
    if layer.load.shape[0] != per_rank + 1:
        layer.load = torch.zeros(per_rank + 1, dtype=torch.int64, device=experts.w13.device)


class ExpertBalancer:
    """EPLB on one rank: the layers' placements, re-made every `step_interval` forwards from the
    load of the last `window_size`."""

    def __init__(self, layers: list[FusedMoE], load: ExpertLoad, group: TPGroup, config: eplb.EPLBConfig):
        self.layers, self.load, self.group, self.config = layers, load, group, config
        self.forwards = 0
        self.window_start: list[torch.Tensor] = [layer.load.clone() for layer in layers]
        self.rebalances = 0

    @staticmethod
    def setup(layers: list[FusedMoE], load: ExpertLoad, group: TPGroup, config: eplb.EPLBConfig) -> ExpertBalancer:
        """Every layer re-placed with the redundant slots (`eplb.default_placement`), at start-up."""
        for layer in layers:
            num_physical = layer.num_experts + config.num_redundant_experts
            if num_physical % group.size:
                raise ValueError(f"EPLB: {layer.num_experts} experts + {config.num_redundant_experts} redundant cannot "
                                 f"be split evenly over {group.size} ranks")
            _place(layer, eplb.default_placement(layer.num_experts, num_physical), group)
        return ExpertBalancer(layers, load, group, config)

    def after_forward(self) -> None:
        """Count a forward; at the window's start remember the counts, at the interval's end re-place."""
        self.forwards += 1
        interval, window = self.config.step_interval, self.config.window_size
        if self.forwards % interval == (interval - window) % interval:
            self.window_start = [layer.load.clone() for layer in self.layers]
        if self.forwards % interval == 0:
            self.rebalance()

    def rebalance(self) -> None:
        """Every layer re-placed from its window's load (a collective of the EP group)."""
        before, after = [], []
        for index, layer in enumerate(self.layers):
            window = (layer.load - self.window_start[index])[:-1]
            per_slot = torch.cat(self.group.all_gather(window)).tolist()
            load = [0.0] * layer.num_experts
            for slot, expert in enumerate(layer.expert_map.placement):
                load[expert] += per_slot[slot]
            placement = eplb.rebalance(load, len(layer.expert_map.placement), self.group.size)
            if self.config.log_balancedness:
                before.append(eplb.balancedness(eplb.rank_loads(load, layer.expert_map.placement, self.group.size)))
                after.append(eplb.balancedness(eplb.rank_loads(load, placement, self.group.size)))
            self.load.fold(index)
            _place(layer, placement, self.group)
        self.window_start = [layer.load.clone() for layer in self.layers]
        self.rebalances += 1
        if before:
            logger.info("EPLB rebalance %d: balancedness (mean / max rank load) %.3f -> %.3f, averaged over %d "
                        "MoE layers", self.rebalances, sum(before) / len(before), sum(after) / len(after), len(before))


def start(model: nn.Module, group: TPGroup, config: eplb.EPLBConfig | None, tp_size: int
          ) -> tuple[ExpertLoad, ExpertBalancer | None]:
    """The expert-load counters of `model`'s MoE layers whose experts span the cores and, with
    `config` (`--enable-eplb`), their balancer, after the weights loaded (a collective of `group`,
    the MoE dispatch's)."""
    layers = moe_layers(model)
    load = ExpertLoad(layers)
    if config is None:
        return load, None
    if tp_size != 1:
        raise ValueError("--enable-eplb needs --tensor-parallel-size 1: the MoE dispatch's group, which it "
                         "balances over, then holds every expert")
    return load, ExpertBalancer.setup(layers, load, group, config)

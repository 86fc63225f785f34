"""Expert-parallel load balancing (vLLM's `--enable-eplb` and `--eplb-config`): the settings,
checked where they enter, and the placement arithmetic (pure, no torch).

Real routing is skewed: a few experts take most tokens, so the ranks holding them are the slowest
of every MoE layer's collective. EPLB gives each EP rank `(E + R) / ranks` physical expert slots
(R redundant ones), each a copy of one logical expert, and every `step_interval` forwards
re-places them from the tokens each expert took over the last `window_size` forwards: the
busiest experts get the redundant copies (`replicate`), and the copies are packed so that each
rank's share of the load is as even as a greedy packing makes it (`pack`). A token's pair is sent
to one copy of its expert, chosen by position so that the copies share the load
(`worker/model/moe.py`, `worker/eplb.py` moves the weights).

    pagoda serve --data-parallel-size 2 --enable-expert-parallel --enable-eplb \\
        --eplb-config '{"num_redundant_experts": 16, "window_size": 1000, "step_interval": 3000}'

The keys are vLLM's; one vLLM has that this engine does not honour is refused by name, as is any
other unknown key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagoda_engine.errors import PagodaError
from pagoda_engine.json_config import json_object


class InvalidEPLBConfigError(PagodaError, ValueError):
    """An EPLB config with an unknown key or a bad value."""


# vLLM's keys this engine cannot honour (another placement policy, asynchronous weight moves).
_UNSUPPORTED_KEYS = ("policy", "use_async")
_KEYS = ("window_size", "step_interval", "num_redundant_experts", "log_balancedness")


@dataclass(frozen=True)
class EPLBConfig:
    window_size: int = 1000  # forwards whose expert load a rebalance reads (vLLM's default)
    step_interval: int = 3000  # forwards between rebalances (vLLM's default)
    num_redundant_experts: int = 0  # extra physical slots per MoE layer, over all EP ranks
    log_balancedness: bool = False  # log each rebalance's balancedness (mean / max rank load), before and after


def parse_eplb_config(value) -> EPLBConfig:
    """A checked EPLBConfig from JSON text, a dict or an EPLBConfig (None: the defaults)."""
    if value is None:
        return EPLBConfig()
    if isinstance(value, EPLBConfig):
        return value
    value = json_object(value, InvalidEPLBConfigError, flag="--eplb-config", name="eplb config")
    for key in value:
        if key in _UNSUPPORTED_KEYS:
            raise InvalidEPLBConfigError(f"eplb config: {key!r} is vLLM's but not implemented in this engine")
        if key not in _KEYS:
            raise InvalidEPLBConfigError(f"eplb config: unknown key {key!r}; known: {', '.join(_KEYS)}")
    for key in ("window_size", "step_interval"):
        _whole(value, key, 1)
    _whole(value, "num_redundant_experts", 0)
    if not isinstance(value.get("log_balancedness", False), bool):
        raise InvalidEPLBConfigError(f"eplb config: log_balancedness must be true or false, got "
                                     f"{value['log_balancedness']!r}")
    config = EPLBConfig(**value)
    if config.window_size > config.step_interval:
        raise InvalidEPLBConfigError(f"eplb config: window_size ({config.window_size}) cannot exceed step_interval "
                                     f"({config.step_interval}): the window is read at each rebalance")
    return config


def _whole(value: dict, key: str, minimum: int) -> None:
    if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < minimum):
        raise InvalidEPLBConfigError(f"eplb config: {key} must be a whole number >= {minimum}, got {value[key]!r}")


def default_placement(num_logical: int, num_physical: int) -> list[int]:
    """Before any load is measured: logical experts in order, the redundant slots copies of the first ones."""
    return [slot % num_logical for slot in range(num_physical)]


def replicate(load: Sequence[float], num_physical: int) -> list[int]:
    """How many copies of each logical expert: one each, then each redundant slot to the expert
    whose load per copy is highest (ties: the lower id)."""
    copies = [1] * len(load)
    for _ in range(num_physical - len(load)):
        busiest = max(range(len(load)), key=lambda e: (load[e] / copies[e], -e))
        copies[busiest] += 1
    return copies


def pack(load: Sequence[float], copies: Sequence[int], num_ranks: int) -> list[int]:
    """Each physical slot's logical expert, rank after rank (`num_ranks` ranks of equal slots):
    the copies, heaviest first (each copy carrying its expert's load / copies), each to the rank
    with the least load so far that has a free slot and, where one has, no copy of that expert
    yet."""
    num_physical = sum(copies)
    if num_physical % num_ranks:
        raise ValueError(f"{num_physical} physical experts cannot be split evenly over {num_ranks} ranks")
    per_rank = num_physical // num_ranks
    items = sorted(((load[e] / copies[e], e) for e in range(len(load)) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for weight, expert in items:
        free = [r for r in range(num_ranks) if len(slots[r]) < per_rank]
        fresh = [r for r in free if expert not in slots[r]] or free
        rank = min(fresh, key=lambda r: (totals[r], r))
        slots[rank].append(expert)
        totals[rank] += weight
    return [expert for rank_slots in slots for expert in sorted(rank_slots)]


def rebalance(load: Sequence[float], num_physical: int, num_ranks: int) -> list[int]:
    """The placement (each physical slot's logical expert) for the measured per-expert `load`."""
    return pack(load, replicate(load, num_physical), num_ranks)


def rank_loads(load: Sequence[float], placement: Sequence[int], num_ranks: int) -> list[float]:
    """Each rank's share of `load` under `placement`, an expert's load split evenly over its copies."""
    copies = [0] * len(load)
    for expert in placement:
        copies[expert] += 1
    per_rank = len(placement) // num_ranks
    return [sum(load[e] / copies[e] for e in placement[r * per_rank:(r + 1) * per_rank]) for r in range(num_ranks)]


def balancedness(loads: Sequence[float]) -> float:
    """Mean over max of the ranks' loads: 1 when even (vLLM's figure)."""
    top = max(loads)
    return sum(loads) / len(loads) / top if top else 1.0

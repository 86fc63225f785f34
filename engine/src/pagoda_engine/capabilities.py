"""What this engine can run: one table of the features a configuration can ask for, the flags
(and environment) that ask for each, and whether this engine implements it.

Three readers, one table: the engine core refuses at start-up a configuration that asks for a
feature not implemented yet, or for features that do not work together yet (`COMBINATIONS`)
(`refusal`); `pagoda serve --help` hides the flags of those features
(`shown_in_help`), though the parser still takes them so the refusal can name them; and the
operator imports this table and refuses the same features in its validation
(`pagoda_operator.engine_capabilities`). When a feature lands, flip `implemented` here: the
operator then accepts it, and tests/operator/test_engine_contract.py demands that it does.

A base module: standard library only, nothing of the engine's (not even `config`, which reads
it), so that `config.py`, the CLI and the operator's image, which has no torch, can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class Feature:
    key: str  # the name the operator's mirror uses
    title: str  # what the feature is, as the refusal says it
    implemented: bool
    # EngineConfig fields (their flags' dests) that ask for the feature when set to anything
    # other than their default.
    options: tuple[str, ...] = ()
    # Environment variables holding a count (the LeaderWorkerSet group size) that ask for the
    # feature when above 1.
    env: tuple[str, ...] = ()
    hint: str = ""  # what works instead, while it is not implemented


FEATURES: tuple[Feature, ...] = (
    Feature("tensor-parallel", "tensor parallelism", True, options=("tensor_parallel_size",)),
    Feature("pipeline-parallel", "pipeline parallelism", True, options=("pipeline_parallel_size",)),
    Feature("data-parallel", "data parallelism inside one engine", True, options=("data_parallel_size",)),
    Feature("expert-parallel", "expert parallelism", True, options=("enable_expert_parallel",)),
    # The operator asks through the LeaderWorkerSet's group size (and passes it on as --nnodes).
    Feature("multi-node", "multi-node serving", True, options=("nnodes",), env=("LWS_GROUP_SIZE",)),
    Feature("kv-offload-cpu", "KV offload tiers in CPU memory", True, options=("kv_offload_cpu_gb",)),
    Feature("kv-offload-disk", "KV offload tiers on local disk", True, options=("kv_offload_disk_path", "kv_offload_disk_gb")),
    Feature("kv-offload-remote", "KV offload tiers in a remote store", True, options=("kv_offload_remote_url",)),
    Feature("lora", "LoRA adapters", True, options=("enable_lora",)),
    Feature("kv-cache-fp8", "FP8 KV cache pages", True, options=("kv_cache_dtype",)),
)



@dataclass(frozen=True)
class Combination:
    """Features that each work alone but not yet together."""

    keys: tuple[str, ...]  # Feature keys, all asked for at once
    title: str
    hint: str = ""


COMBINATIONS: tuple[Combination, ...] = (
    # Experts across the cores step them in lockstep, one forward each per turn; a pipeline's batch
    # queue launches and resolves batches on turns of its own.
    Combination(("pipeline-parallel", "data-parallel", "expert-parallel"),
                "expert parallelism across data-parallel engine cores under pipeline parallelism",
                hint="expert parallelism across data-parallel engine cores works with tensor parallelism"),
)

BY_KEY = {f.key: f for f in FEATURES}
_BY_OPTION = {option: f for f in FEATURES for option in f.options}


def shown_in_help(option: str) -> bool:
    """Whether the flag setting this EngineConfig field does something: flags of features not
    implemented yet are parsed (to be refused by name) but not offered in --help."""
    feature = _BY_OPTION.get(option)
    return feature is None or feature.implemented


def _non_default_options(config: Any) -> dict[str, Any]:
    """EngineConfig's fields that differ from their defaults, by name (any section)."""
    changed = {}
    for section in (getattr(config, f.name) for f in fields(config)):
        for f in fields(section):
            value = getattr(section, f.name)
            if f.name in _BY_OPTION and value != f.default:
                changed[f.name] = value
    return changed


def _count(value: str | None) -> int:
    return int(value) if value is not None and value.strip().isdigit() else 1


def flag_of(option: str) -> str:
    """The command-line flag that sets an EngineConfig field (vLLM's spelling)."""
    return "--" + option.replace("_", "-")


def _flag(option: str, value: Any) -> str:
    return flag_of(option) if value is True else f"{flag_of(option)} {value}"


def requested(config: Any, environ: Mapping[str, str]) -> list[tuple[Feature, str]]:
    """The features this configuration (an EngineConfig) and environment ask for, each with what
    asked for it (`--pipeline-parallel-size 2`, `LWS_GROUP_SIZE=2`), in table order."""
    changed = _non_default_options(config)
    out = []
    for feature in FEATURES:
        how = [_flag(option, changed[option]) for option in feature.options if option in changed]
        how += [f"{name}={environ[name]}" for name in feature.env if _count(environ.get(name)) > 1]
        if how:
            out.append((feature, ", ".join(how)))
    return out


def refused_combinations(keys: set[str] | list[str]) -> list[Combination]:
    """The combinations of COMBINATIONS that these asked-for features (keys) make."""
    return [c for c in COMBINATIONS if set(c.keys) <= set(keys)]


def refusal(config: Any, environ: Mapping[str, str]) -> str | None:
    """Why this engine cannot run the configuration, or None when it can."""
    asked = requested(config, environ)
    missing = [
        f"{feature.title} ({'; '.join(filter(None, [how, feature.hint]))})"
        for feature, how in asked if not feature.implemented
    ]
    how_asked = {feature.key: how for feature, how in asked}
    missing += [
        f"{c.title} ({'; '.join(filter(None, [' with '.join(how_asked[k] for k in c.keys), c.hint]))})"
        for c in refused_combinations(how_asked)
    ]
    return "not implemented in this engine yet: " + "; ".join(missing) if missing else None

"""What this engine can run: one table of the features a configuration can ask for, the flags
(and environment) that ask for each, and whether this engine implements it.

Three readers, one table: the engine core refuses at start-up a configuration that asks for a
feature not implemented yet, or for features that do not work together yet (`COMBINATIONS`)
(`refusal`); `pagoda serve --help` hides the flags of those features
(`shown_in_help`), though the parser still takes them so the refusal can name them; and the
operator, which cannot import the engine (its image has no torch), refuses the same features in
its validation from a generated copy of this table (`as_json`, written by `make capabilities` to
operator/src/pagoda_operator/engine_capabilities.json; a test fails when it is stale). When a
feature lands, flip `implemented` here and run `make capabilities`: the operator then accepts
it, and tests/operator/test_engine_contract.py demands that it does.

Torch-free, and imports nothing of the engine's at import time, so `config.py` and the CLI can
use it.
"""

from __future__ import annotations

import json
import sys
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


def as_json() -> str:
    """The table as the operator reads it: each feature with every flag (aliases included) that
    asks for it, as `pagoda serve` spells them, the combinations refused, and every flag
    `pagoda serve` takes (`serve_flags`)."""
    import argparse

    from pagoda_engine.config import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    option_strings = {action.dest: action.option_strings for action in parser._actions}
    table = [
        {"key": f.key, "title": f.title, "implemented": f.implemented,
         "flags": [flag for option in f.options for flag in option_strings[option]], "env": list(f.env), "hint": f.hint}
        for f in FEATURES
    ]
    combinations = [{"keys": list(c.keys), "title": c.title, "hint": c.hint} for c in COMBINATIONS]
    return json.dumps({"features": table, "combinations": combinations, "serve_flags": serve_flags()}, indent=2) + "\n"


# The bounds EngineConfig.validate puts on single numeric flags (its own checks stay the truth:
# tests/operator/test_engine_contract.py proves every bound here against them), copied into
# `serve_flags` so that the operator refuses an engine.extraArgs value out of them before a pod
# starts. "min"/"max": inclusive; "above": exclusive; "power_of_two". `pagoda serve`'s request
# limits are >= 1 too.
FLAG_BOUNDS: dict[str, dict[str, float]] = {
    "--block-size": {"power_of_two": 1},
    "--gpu-memory-utilization": {"above": 0, "max": 1},
    "--max-num-seqs": {"min": 1},
    "--max-num-batched-tokens": {"min": 1},
    "--long-prefill-token-threshold": {"min": 0},
    "--max-cudagraph-capture-size": {"min": 1},
    "--tensor-parallel-size": {"min": 1},
    "--pipeline-parallel-size": {"min": 1},
    "--data-parallel-size": {"min": 1},
    "--nnodes": {"min": 1},
    "--node-rank": {"min": 0},  # and below --nnodes: the engine's check across the two
    "--master-port": {"above": 0, "max": 65535},
    "--api-server-count": {"min": 1},
    "--num-gpu-blocks-override": {"min": 2},
    "--kv-offload-cpu-gb": {"min": 0},
    "--kv-offload-disk-gb": {"min": 0},
}

# How the operator's mirror converts a flag's value (`serve_flags`): argparse's `type`, by name.
# Any other type converts from any string here; the engine checks the value itself at start-up.
_VALUE_TYPES = {None: "str", str: "str", int: "int", float: "float", str.upper: "upper", str.lower: "lower"}


def serve_flags() -> list[dict[str, Any]]:
    """Every flag `pagoda serve` takes, as argparse reads it: its spellings, how many values
    follow it (0 for a switch), their type (`_VALUE_TYPES`), choices and bounds (`FLAG_BOUNDS`).
    The operator builds the same parser from these and checks a spec's engine.extraArgs with it,
    so that a flag the engine would refuse (unknown, missing its value, not a number, not one of
    its choices, out of its bounds) gives Validated=False instead of a crash-looping pod. Help
    (-h) is left out: it prints and exits."""
    import argparse

    from pagoda_engine.api.server.api_server import add_arguments
    from pagoda_engine.config import REQUEST_LIMIT_FLAGS

    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    bounds = {**FLAG_BOUNDS, **{flag: {"min": 1} for flag in REQUEST_LIMIT_FLAGS}}
    rows = []
    for action in parser._actions:
        if not action.option_strings:
            raise ValueError(f"pagoda serve takes a positional argument ({action.dest}): serve_flags cannot describe it")
        rows.append({"flags": list(action.option_strings), "nargs": action.nargs,
                     "type": None if action.nargs == 0 else _VALUE_TYPES.get(action.type, "any"),
                     "choices": list(action.choices) if action.choices is not None else None,
                     "bounds": next((bounds[f] for f in action.option_strings if f in bounds), None)})
    unknown = set(bounds) - {f for row in rows for f in row["flags"]}
    if unknown:
        raise ValueError(f"FLAG_BOUNDS names flags pagoda serve does not take: {sorted(unknown)}")
    return rows


if __name__ == "__main__":  # python -m pagoda_engine.capabilities FILE: write the operator's copy
    with open(sys.argv[1], "w") as out:
        out.write(as_json())

"""What the engine the operator deploys can run, which spec fields ask for what, and which flags
`pagoda serve` takes (engine.extraArgs are parsed with a copy of its parser: `extra_args_problems`).

The engine's capability table (pagoda_engine.capabilities) is the truth. The operator cannot
import the engine (its image has no torch), so it reads a copy generated from that table,
engine_capabilities.json (`make capabilities`; tests/operator/test_engine_contract.py fails when
it is stale and proves, on the examples and a generated matrix of specs, that every spec the
operator accepts renders a command line the engine runs, and that every spec the engine would
refuse is refused here first, with the engine's reason).
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from pagoda_operator.spec import InferenceServiceSpec

TABLE_FILE = "engine_capabilities.json"


@dataclass(frozen=True)
class EngineFeature:
    key: str
    title: str
    implemented: bool
    flags: tuple[str, ...] = ()  # `pagoda serve` flags that ask for it (in engine.extraArgs)
    env: tuple[str, ...] = ()  # environment variables that ask for it when above 1 (in engine.env)
    hint: str = ""


@dataclass(frozen=True)
class EngineCombination:
    """Features the engine runs alone but not yet together."""

    keys: tuple[str, ...]
    title: str
    hint: str = ""


def _load_table() -> tuple[tuple[EngineFeature, ...], tuple[EngineCombination, ...], tuple[dict[str, Any], ...]]:
    table = json.loads(resources.files(__package__).joinpath(TABLE_FILE).read_text())
    features = tuple(EngineFeature(**{**row, "flags": tuple(row["flags"]), "env": tuple(row["env"])})
                     for row in table["features"])
    combinations = tuple(EngineCombination(**{**row, "keys": tuple(row["keys"])}) for row in table["combinations"])
    return features, combinations, tuple(table["serve_flags"])


ENGINE_FEATURES, ENGINE_COMBINATIONS, SERVE_FLAGS = _load_table()
BY_KEY = {f.key: f for f in ENGINE_FEATURES}
TIER_FEATURES = {"cpu": "kv-offload-cpu", "disk": "kv-offload-disk", "remote": "kv-offload-remote"}


def _flag_feature(arg: str) -> EngineFeature | None:
    """The feature a command-line word asks for: its flag, `--flag=value`, or a prefix of a long
    flag (argparse takes unambiguous abbreviations)."""
    name = arg.split("=", 1)[0]
    for feature in ENGINE_FEATURES:
        for flag in feature.flags:
            if name == flag or (name.startswith("--") and len(name) > 2 and flag.startswith(name)):
                return feature
    return None


def requested_features(spec: InferenceServiceSpec) -> list[tuple[str, str]]:
    """(feature key, the spec field that asks for it) for every engine feature the spec asks for."""
    t = spec.topology
    asked = [
        (key, f"topology.{field}: {value}")
        for key, field, value, on in (
            ("tensor-parallel", "tensor", t.tensor, t.tensor > 1),
            ("pipeline-parallel", "pipeline", t.pipeline, t.pipeline > 1),
            ("data-parallel", "data", t.data, t.data > 1),
            ("expert-parallel", "expert", "true", t.expert),
            ("multi-node", "nodes", t.nodes, t.nodes > 1),
        )
        if on
    ]
    asked += [(TIER_FEATURES[tier.type], f"kvCache.tiers[{i}] ({tier.type})") for i, tier in enumerate(spec.kv_cache.tiers)]
    for arg in spec.engine.extra_args:
        feature = _flag_feature(arg)
        if feature is not None:
            asked.append((feature.key, f"engine.extraArgs: {arg}"))
    for var in spec.engine.env:
        feature = next((f for f in ENGINE_FEATURES if var.get("name") in f.env), None)
        if feature is None:
            continue
        # The engine reads a count above 1 as asking; a value from elsewhere (valueFrom) may be one.
        value = str(var.get("value") or "").strip()
        if "valueFrom" in var or (value.isdigit() and int(value) > 1):
            asked.append((feature.key, f"engine.env: {var['name']}={value or '(valueFrom)'}"))
    return asked


def unsupported(spec: InferenceServiceSpec) -> list[str]:
    """One problem per spec field asking for a feature the engine does not implement yet, and one
    per combination of asked-for features the engine does not run together yet."""
    problems = []
    asked = requested_features(spec)
    for key, where in asked:
        feature = BY_KEY[key]
        if not feature.implemented:
            hint = f" ({feature.hint})" if feature.hint else ""
            problems.append(f"{where} asks for {feature.title}, which Pagoda's engine does not implement yet{hint}")
    where_asked = {}
    for key, where in asked:
        where_asked.setdefault(key, where)
    for combination in ENGINE_COMBINATIONS:
        if set(combination.keys) <= set(where_asked):
            fields = " with ".join(where_asked[k] for k in combination.keys)
            hint = f" ({combination.hint})" if combination.hint else ""
            problems.append(f"{fields} asks for {combination.title}, which Pagoda's engine does not implement yet{hint}")
    return problems


class _Refused(Exception):
    """What `pagoda serve`'s parser would exit with."""


class _ServeParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Refused(message)


class _Help(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        raise _Refused(f"{option_string} prints the help and exits: the pod would exit at once, and restart")


# The engine's value types by the table's names (pagoda_engine.capabilities._VALUE_TYPES); "any":
# a type of the engine's own, which it checks at start-up.
_VALUE_TYPES = {"str": str, "int": int, "float": float, "upper": str.upper, "lower": str.lower, "any": str}


@functools.cache
def _serve_parser() -> _ServeParser:
    """`pagoda serve`'s parser, rebuilt from the table: the same spellings, abbreviations, value
    counts, types and choices, so it takes and refuses the same command lines."""
    parser = _ServeParser(prog="pagoda serve", add_help=False, allow_abbrev=True)
    parser.add_argument("-h", "--help", action=_Help, nargs=0)
    for i, row in enumerate(SERVE_FLAGS):
        if row["nargs"] == 0:
            parser.add_argument(*row["flags"], dest=f"flag{i}", action="store_true")
        else:
            parser.add_argument(*row["flags"], dest=f"flag{i}", nargs=row["nargs"], type=_VALUE_TYPES[row["type"]],
                                choices=row["choices"])
    return parser


def extra_args_problems(extra_args: list[str]) -> list[str]:
    """Why `pagoda serve` would refuse these engine.extraArgs: what its parser refuses
    (`extra_args_parse_problems`), else a value out of its flag's bounds. Empty when it would take
    them. Checks across flags (e.g. --node-rank against --nnodes) stay the engine's, at start-up."""
    parsed, problems = _parse_extra_args(extra_args)
    if parsed is None or problems:
        return problems
    return [f"engine.extraArgs: {SERVE_FLAGS[i]['flags'][0]} {value}: {fault}" for i, value, fault in _out_of_bounds(parsed)]


def extra_args_parse_problems(extra_args: list[str]) -> list[str]:
    """Why `pagoda serve`'s parser would refuse these engine.extraArgs (they follow the operator's
    own flags, each complete with its value, so they parse alone as they would there): an unknown
    flag, a flag without its value, a value of the wrong type or not one of the flag's choices, a
    word that is no flag's value, -h."""
    return _parse_extra_args(extra_args)[1]


def extra_arg_value(extra_args: list[str], flag: str) -> Any:
    """The value `pagoda serve` would take for `flag` (any of its spellings, the last one given
    winning, as argparse does) from these engine.extraArgs; None when they do not give it or do
    not parse (`extra_args_problems` says why)."""
    parsed, problems = _parse_extra_args(extra_args)
    if parsed is None or problems:
        return None
    (i,) = [i for i, row in enumerate(SERVE_FLAGS) if flag in row["flags"]]
    return getattr(parsed, f"flag{i}")


def _parse_extra_args(extra_args: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    try:
        parsed, rest = _serve_parser().parse_known_args(list(extra_args))
    except _Refused as e:
        return None, [f"engine.extraArgs: {e}"]
    problems = []
    known = [flag for row in SERVE_FLAGS for flag in row["flags"]]
    after_unknown_flag = False
    for word in rest:
        name = word.split("=", 1)[0]
        if name == "--":
            problems.append("engine.extraArgs: '--' ends the flags, and pagoda serve takes no other arguments")
        elif not name.startswith("-") or name == "-":
            if not after_unknown_flag:  # else it is most likely that flag's value: one problem, not two
                problems.append(f"engine.extraArgs: {word!r} is neither a flag of pagoda serve nor the value of one")
        else:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"engine.extraArgs: pagoda serve has no flag {name}{hint}")
        after_unknown_flag = name.startswith("-") and name != "--" and "=" not in word
    return parsed, problems


def _out_of_bounds(parsed: argparse.Namespace) -> list[tuple[int, Any, str]]:
    """(row, value, why) for every flag given a value outside its bounds (the table's "bounds":
    "min" and "max" inclusive, "above" exclusive, "power_of_two")."""
    faults = []
    for i, row in enumerate(SERVE_FLAGS):
        value, bounds = getattr(parsed, f"flag{i}", None), row.get("bounds") or {}
        if value is None or not bounds:
            continue
        if bounds.get("power_of_two") and (value < 1 or value & (value - 1)):
            faults.append((i, value, "must be a power of two"))
        elif "min" in bounds and value < bounds["min"]:
            faults.append((i, value, f"must be >= {bounds['min']:g}"))
        elif "above" in bounds and value <= bounds["above"]:
            faults.append((i, value, f"must be > {bounds['above']:g}"))
        elif "max" in bounds and value > bounds["max"]:
            faults.append((i, value, f"must be <= {bounds['max']:g}"))
    return faults

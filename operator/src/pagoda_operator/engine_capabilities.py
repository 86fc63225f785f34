"""What the engine the operator deploys can run, which spec fields ask for what, and whether
`pagoda serve` takes a spec's engine.extraArgs (`extra_args_problems`).

The engine's own torch-free modules are the truth, imported, not copied: its capability table
(`pagoda_engine.capabilities`), `pagoda serve`'s parser (`pagoda_engine.serve.add_arguments`,
built from the flag contract on the config dataclasses) and each flag's choices and bounds
(`pagoda_engine.config.value_fault`). tests/operator/test_engine_contract.py proves, on the
examples and a generated matrix of specs, that every spec the operator accepts renders a command
line the engine runs, and that every spec the engine would refuse is refused here first, with
the engine's reason.
"""

from __future__ import annotations

import argparse
import difflib
import functools
from typing import Any

from pagoda_engine import serve
from pagoda_engine.capabilities import BY_KEY, COMBINATIONS, FEATURES, Feature
from pagoda_engine.config import flags_by_dest, value_fault

from pagoda_operator.spec import InferenceServiceSpec

TIER_FEATURES = {"cpu": "kv-offload-cpu", "disk": "kv-offload-disk", "remote": "kv-offload-remote"}


class _Refused(Exception):
    """What `pagoda serve`'s parser would exit with."""


class _ServeParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _Refused(message)


class _Help(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        raise _Refused(f"{option_string} prints the help and exits: the pod would exit at once, and restart")


@functools.cache
def _serve_parser() -> _ServeParser:
    """`pagoda serve`'s own parser (the same spellings, abbreviations, value counts, types and
    choices), refusing instead of exiting, -h refused, and no defaults: what it parses from
    engine.extraArgs is only what they give."""
    parser = _ServeParser(prog="pagoda serve", add_help=False, allow_abbrev=True)
    parser.add_argument("-h", "--help", action=_Help, nargs=0)
    serve.add_arguments(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return parser


def _actions() -> dict[str, argparse.Action]:
    """`pagoda serve`'s flags by every spelling."""
    return _serve_parser()._option_string_actions


@functools.cache
def feature_flags(key: str) -> tuple[str, ...]:
    """Every spelling of the `pagoda serve` flags that ask for this feature (`--tensor-parallel-size`, `-tp`)."""
    by_dest = {action.dest: action.option_strings for action in _serve_parser()._actions}
    return tuple(flag for option in BY_KEY[key].options for flag in by_dest[option])


def _flag_feature(arg: str) -> Feature | None:
    """The feature a command-line word asks for: its flag, `--flag=value`, or a prefix of a long
    flag (argparse takes unambiguous abbreviations)."""
    name = arg.split("=", 1)[0]
    for feature in FEATURES:
        for flag in feature_flags(feature.key):
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
    if spec.engine.kv_cache_dtype != "auto":
        asked.append(("kv-cache-fp8", f"engine.kvCacheDtype: {spec.engine.kv_cache_dtype}"))
    if spec.loras:
        asked.append(("lora", f"loras: {', '.join(a.name for a in spec.loras)}"))
    for arg in spec.engine.extra_args:
        feature = _flag_feature(arg)
        if feature is not None:
            asked.append((feature.key, f"engine.extraArgs: {arg}"))
    for var in spec.engine.env:
        feature = next((f for f in FEATURES if var.get("name") in f.env), None)
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
    for combination in COMBINATIONS:
        if set(combination.keys) <= set(where_asked):
            fields = " with ".join(where_asked[k] for k in combination.keys)
            hint = f" ({combination.hint})" if combination.hint else ""
            problems.append(f"{fields} asks for {combination.title}, which Pagoda's engine does not implement yet{hint}")
    return problems


def extra_args_problems(extra_args: list[str]) -> list[str]:
    """Why `pagoda serve` would refuse these engine.extraArgs: what its parser refuses
    (`extra_args_parse_problems`), else a value outside its flag's choices or bounds (the
    engine's `value_fault`). Empty when it would take them. Checks across flags (e.g. --node-rank
    against --nnodes) stay the engine's, at start-up."""
    parsed, problems = _parse_extra_args(extra_args)
    if parsed is None or problems:
        return problems
    flags = flags_by_dest()
    return [f"engine.extraArgs: {flags[dest].spellings(dest)[0]} {value}: {fault}"
            for dest, value in vars(parsed).items()
            if dest in flags and (fault := value_fault(flags[dest], value)) is not None]


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
    return getattr(parsed, _actions()[flag].dest, None)


def _parse_extra_args(extra_args: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    try:
        parsed, rest = _serve_parser().parse_known_args(list(extra_args))
    except _Refused as e:
        return None, [f"engine.extraArgs: {e}"]
    problems = []
    known = [flag for flag in _actions() if flag not in ("-h", "--help")]
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

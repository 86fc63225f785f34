"""The operator against the engine it deploys, through the real `pagoda serve` parser, the
engine's EngineConfig and its capability table (pagoda_engine.capabilities), which the operator
imports (torch-free) rather than copies:

- every spec the operator accepts renders engine pods (Deployment, or LeaderWorkerSet leader and
  worker, with their environment) whose command line the engine parses, configures and does not
  refuse to start with;
- every spec the engine would refuse, the operator refuses first (Validated=False), naming the
  engine's reason;
- the two ask the same question: which features a spec asks for, and which are implemented.

Expectations come from the engine's table, never from a list here: when a feature lands and its
entry flips to implemented, these tests demand that the operator accept it.

Specs: every file in examples/, and a generated matrix of each topology field (tensor, pipeline,
data, expert, nodes), each KV tier type and autoscaling (off and each driver), on and off
together, plus every flag and environment variable of the table given through engine.extraArgs
and engine.env. (The schema has no quantization field yet; when it gains one, add it to MATRIX.)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import itertools
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagoda_operator import engine_capabilities
from pagoda_operator import render as r
from pagoda_operator.validation import check
from tests.operator.support import EXAMPLE_FILES, load_example, with_spec

from pagoda_engine import capabilities, serve
from pagoda_engine.config import config_from_args, flags_by_dest

router_app = pytest.importorskip("pagoda_engine.router.app")
from pagoda_engine.model_path import TINY_MODEL_NAME  # noqa: E402


def _parser(add_arguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser


ENGINE_PARSER = _parser(serve.add_arguments)
ENGINE_ACTIONS = {action.dest: action for action in ENGINE_PARSER._actions}


def _children(filename: str) -> list[dict]:
    body = load_example(filename)
    checked = check(body)
    assert checked.renderable, checked.problems
    return r.render(body, checked.spec)


def engine_containers(children: list[dict]) -> dict[str, dict]:
    """The engine container of every pod template the operator renders, by role."""
    workloads = [m for m in children if m["kind"] in ("Deployment", "LeaderWorkerSet")
                 and m["metadata"]["name"].endswith(("-engine", "-prefill", "-decode"))]
    if len(workloads) == 2:  # spec.prefill: a Deployment per role
        templates = {w["metadata"]["labels"]["llm-d.ai/role"]: w["spec"]["template"] for w in workloads}
    elif (workload := workloads[0])["kind"] == "Deployment":
        templates = {"engine": workload["spec"]["template"]}
    else:
        lwt = workload["spec"]["leaderWorkerTemplate"]
        templates = {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}
    out = {}
    for role, template in templates.items():
        (container,) = template["spec"]["containers"]
        assert container["command"] == ["pagoda", "serve"]
        out[role] = container
    return out


def _engine_args(children: list[dict]) -> list[str]:
    """The first role's command line (the leader's of a LeaderWorkerSet), as the pod runs it."""
    role, container = next(iter(engine_containers(children).items()))
    return pod_args(container, role)


# What the LeaderWorkerSet controller's pod labels give the downward-API variables of the first
# group: the leader is worker 0, the other pod worker 1.
LWS_LABELS = {"leader": {"LWS_GROUP_INDEX": "0", "LWS_WORKER_INDEX": "0"},
              "worker": {"LWS_GROUP_INDEX": "0", "LWS_WORKER_INDEX": "1"}}


POD_IP = "10.1.2.3"  # what the downward API gives a prefill pod's POD_IP


def _expand(text: str, environ: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a reference to a variable defined (earlier) is replaced."""
    return re.sub(r"\$\((\w+)\)", lambda m: environ.get(m.group(1), m.group(0)), text)


def pod_environment(container: dict, role: str) -> dict[str, str]:
    """The container's environment as the pod gets it (secrets left out)."""
    environ: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            environ[e["name"]] = _expand(e["value"], environ)
        elif e["name"] in LWS_LABELS.get(role, {}):
            environ[e["name"]] = LWS_LABELS[role][e["name"]]
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            environ[e["name"]] = POD_IP
    return environ


def pod_args(container: dict, role: str) -> list[str]:
    """The container's arguments with the $(VAR) references Kubernetes expands."""
    environ = pod_environment(container, role)
    return [_expand(arg, environ) for arg in container["args"]]


def engine_start(container: dict, role: str = "engine"):
    """What the engine does with this container: (its EngineConfig, the features it asks for,
    the refusal at start-up or None). Parsing and configuring must succeed: a spec the operator
    renders never fails on a flag or a value, only (until a feature lands) on the capability table."""
    environ = pod_environment(container, role)
    parsed = ENGINE_PARSER.parse_args(pod_args(container, role))  # SystemExit on an unknown flag or bad value
    config = config_from_args(parsed)
    assert config.parallel.headless == (role == "worker"), role
    asked = {feature.key for feature, _ in capabilities.requested(config, environ)}
    return config, asked, capabilities.refusal(config, environ)


def assert_operator_and_engine_agree(body: dict) -> None:
    checked = check(body)
    assert checked.renderable, checked.problems  # only capability problems: the engine gets to decide
    operator_asked = {key for key, _ in engine_capabilities.requested_features(checked.spec)}
    refused = [capabilities.BY_KEY[key] for key in operator_asked if not capabilities.BY_KEY[key].implemented]
    refused += capabilities.refused_combinations(operator_asked)
    for role, container in engine_containers(r.render(body, checked.spec)).items():
        _, engine_asked, refusal = engine_start(container, role)
        assert engine_asked == operator_asked, role
        if checked.ok:
            assert refusal is None, (role, refusal)
            continue
        assert refusal is not None, (role, checked.problems)  # the operator refuses only what the engine would
        for reason in refused:
            assert reason.title in refusal
            assert any(reason.title in p and reason.hint in p for p in checked.unsupported), (reason.title, checked.problems)
    assert checked.ok == (not refused)
    assert len(checked.unsupported) >= len(refused)


def test_every_kind_of_kv_tier_the_schema_offers_is_a_feature_of_the_engines_table():
    assert set(engine_capabilities.TIER_FEATURES.values()) <= set(capabilities.BY_KEY)


def test_every_flag_of_pagoda_serve_is_known_to_the_operator():
    """Each spelling of each flag `pagoda serve` takes, given a value it takes, passes the operator's
    check of engine.extraArgs, and every flag that asks for a feature of the table is read as
    asking for it."""
    flags = [(action, flag) for action in ENGINE_PARSER._actions for flag in action.option_strings]
    assert len(flags) > 60  # the parser was read
    contracts = flags_by_dest()
    for action, flag in flags:
        choices = action.choices or (contracts[action.dest].choices if action.dest in contracts else None)
        if action.nargs == 0:
            words = [flag]
        else:
            value = choices[0] if choices else {int: "2", float: "0.5"}.get(action.type, "x")
            words = [*(["--kv-offload-disk-path", "/kv"] if action.dest == "kv_offload_disk_gb" else []), flag, value]
        assert engine_capabilities.extra_args_problems(words) == [], words
    for feature in capabilities.FEATURES:
        for option in feature.options:
            assert set(ENGINE_ACTIONS[option].option_strings) <= set(engine_capabilities.feature_flags(feature.key))


# The modules of the engine the operator runs on: its image installs pagoda-engine without its
# dependencies (images/operator.Dockerfile), so none of these may import torch and its kin.
_TORCH_FREE_PROBE = textwrap.dedent("""
    import importlib.abc, sys

    HEAVY = {"torch", "transformers", "triton", "flashinfer", "numpy", "zmq", "msgspec", "redis"}

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HEAVY:
                raise ImportError(f"the operator's image has no {name}")

    sys.meta_path.insert(0, Refuse())
    import pagoda_operator.validation, pagoda_operator.engine_capabilities, pagoda_operator.cli
    from pagoda_operator.validation import check
    from tests.operator.support import load_example, with_spec

    body = with_spec(load_example("llama-3.1-8b.yaml"), engine__extraArgs=["--max-num-seqs", "0"],
                     kvCache__tiers=[{"type": "remote", "url": "http://kv"}])
    print(check(body).problems)
    print(sorted(m for m in sys.modules if m.startswith("pagoda_engine")))
""")


def test_the_engine_modules_the_operator_imports_import_without_torch():
    out = subprocess.run([sys.executable, "-c", _TORCH_FREE_PROBE], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr
    problems, modules = out.stdout.splitlines()
    assert "engine.extraArgs: --max-num-seqs 0: must be >= 1" in problems and "'http://kv' is not redis://" in problems
    assert "pagoda_engine.config" in modules and "pagoda_engine.kv_tiers" in modules


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_examples_render_what_the_engine_runs_or_are_refused_with_its_reason(filename):
    assert_operator_and_engine_agree(load_example(filename))


def test_api_server_processes_of_a_multi_node_spec_start_on_the_leader_alone():
    body = with_spec(load_example("llama-3.1-70b-multinode.yaml"), engine__apiServerCount=4)
    assert_operator_and_engine_agree(body)  # a headless worker's engine refuses --api-server-count > 1
    containers = engine_containers(r.render(body, check(body).spec))
    configs = {role: engine_start(container, role)[0] for role, container in containers.items()}
    assert (configs["leader"].server.api_server_count, configs["worker"].server.api_server_count) == (4, 1)
    extra = with_spec(load_example("llama-3.1-70b-multinode.yaml"), engine__extraArgs=["--api-server-count=4"])
    assert check(extra).problems == ["engine: extraArgs --api-server-count 4 would reach the headless worker pods too, "
                                     "which run no API server and refuse a count above 1; set apiServerCount instead "
                                     "(the leader's alone)"]
    worker = engine_containers(r.render(extra, check(extra).spec))["worker"]
    with pytest.raises(ValueError, match="cannot be used with --headless"):  # what that message spares the user
        engine_start(worker, "worker")


@pytest.mark.parametrize("extra_args", [["--api-server-count", "1"], ["--api-server-count=1"], ["-asc", "1"]])
def test_extra_args_api_server_count_of_one_reaches_every_node_and_each_engine_takes_it(extra_args):
    body = with_spec(load_example("llama-3.1-70b-multinode.yaml"), engine__extraArgs=extra_args)
    assert_operator_and_engine_agree(body)
    containers = engine_containers(r.render(body, check(body).spec))
    for role, container in containers.items():
        assert " ".join(extra_args) in " ".join(container["args"]), role
        assert engine_start(container, role)[0].server.api_server_count == 1


# A Mixtral on CPU: every combination below is right as written (no GPU count or memory fit to
# get wrong, an MoE model for expert parallelism, tensor parallel ranks that split over two
# nodes), so each one reaches the capability contract.
MATRIX_BASE = {
    "apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService",
    "metadata": {"name": "matrix", "namespace": "default", "uid": "0000-uid"},
    "spec": {"model": {"uri": "hf://mistralai/Mixtral-8x7B-Instruct-v0.1"}, "resources": {"gpusPerPod": 0, "memory": "96Gi"},
             "topology": {"tensor": 2}},
}
MATRIX = {
    **{f"topology.{field}": value for field, value in
       {"tensor": 4, "pipeline": 2, "data": 2, "expert": True, "nodes": 2}.items()},
    "kvCache.tiers.cpu": {"type": "cpu", "size": "8Gi"},
    "kvCache.tiers.disk": {"type": "disk", "size": "100Gi"},
    "kvCache.tiers.remote": {"type": "remote", "url": "redis://kv-redis-0.kv-redis:6379,redis://kv-redis-1.kv-redis:6379",
                             "secretRef": {"name": "kv", "key": "password"}},  # sharded over two servers
}
AUTOSCALING = {
    "off": None,
    **{driver: {"driver": driver, "minReplicas": 1, "maxReplicas": 4, "prometheusURL": "http://prometheus:9090"}
       for driver in ("builtin", "keda", "hpa")},
}


def matrix_spec(on: tuple[str, ...], autoscaling: str) -> dict:
    body = copy.deepcopy(MATRIX_BASE)
    spec = body["spec"]
    for key in on:
        section, field = key.split(".", 1)
        if field.startswith("tiers."):
            spec.setdefault(section, {}).setdefault("tiers", []).append(MATRIX[key])
        else:
            spec.setdefault(section, {})[field] = MATRIX[key]
    if AUTOSCALING[autoscaling] is not None:
        spec["autoscaling"] = AUTOSCALING[autoscaling]
    return body


MATRIX_CASES = [
    (on, autoscaling)
    for n in range(len(MATRIX) + 1)
    for on in itertools.combinations(MATRIX, n)
    for autoscaling in AUTOSCALING
]


@pytest.mark.parametrize("autoscaling", list(AUTOSCALING))
def test_every_combination_of_topology_tiers_and_autoscaling_is_run_or_refused_alike(autoscaling):
    cases = [on for on, a in MATRIX_CASES if a == autoscaling]
    assert len(cases) == 2 ** len(MATRIX)
    for on in cases:
        try:
            assert_operator_and_engine_agree(matrix_spec(on, autoscaling))
        except AssertionError as e:
            raise AssertionError(f"fields on: {on}, autoscaling {autoscaling}: {e}") from e


def _asking_words(flag: str, joined: bool) -> list[str]:
    """Command-line words that ask for the feature behind this flag (`--flag value` or `--flag=value`)."""
    action = ENGINE_PARSER._option_string_actions[flag]
    if action.nargs == 0:
        return [flag]
    # A flag with choices asks with its first one other than its default.
    chosen = next((c for c in action.choices if c != action.default), None) if action.choices else None
    value = _VALUES.get(action.dest) or chosen or {int: "2", float: "8"}.get(action.type, "/var/lib/kv")
    # A disk tier's size is valid only with its directory (the engine's config refuses it alone).
    companion = ["--kv-offload-disk-path", "/var/lib/kv"] if action.dest == "kv_offload_disk_gb" else []
    return [*companion, f"{flag}={value}"] if joined else [*companion, flag, value]


_VALUES = {"kv_offload_remote_url": "redis://kv:6379"}


TABLE_ASKS = [
    pytest.param({"extraArgs": _asking_words(flag, joined)}, id=f"{f.key}:{' '.join(_asking_words(flag, joined))}")
    for f in capabilities.FEATURES for option in f.options for flag in ENGINE_ACTIONS[option].option_strings
    for joined in ((False,) if ENGINE_ACTIONS[option].nargs == 0 else (False, True))
] + [
    pytest.param({"env": [{"name": var, "value": "2"}]}, id=f"{f.key}:{var}=2")
    for f in capabilities.FEATURES for var in f.env
]


@pytest.mark.parametrize("engine", TABLE_ASKS)
def test_every_flag_and_variable_of_the_table_is_run_or_refused_alike(engine):
    body = copy.deepcopy(MATRIX_BASE)
    body["spec"]["engine"] = engine
    assert_operator_and_engine_agree(body)


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_pagoda_serve_reads_the_rendered_arguments_as_the_spec_means_them(filename):
    children = _children(filename)
    args = _engine_args(children)
    parsed, unknown = ENGINE_PARSER.parse_known_args(args)
    assert unknown == []
    spec = check(load_example(filename)).spec
    assert parsed.port == 8000 and parsed.host == "0.0.0.0"
    assert parsed.served_model_name == (spec.model.name or load_example(filename)["metadata"]["name"])
    assert parsed.model == r.model_path(spec)
    assert (parsed.tensor_parallel_size, parsed.pipeline_parallel_size) == (spec.topology.tensor, spec.topology.pipeline)
    assert parsed.block_size == spec.kv_cache.page_size
    assert parsed.enable_prefix_caching is spec.engine.prefix_caching
    assert parsed.max_model_len == spec.model.max_model_len
    assert parsed.device == ("cpu" if spec.resources.gpus_per_pod == 0 else "auto")
    assert parsed.data_parallel_size == spec.topology.data
    assert parsed.enable_expert_parallel is spec.topology.expert
    assert parsed.api_server_count == spec.engine.api_server_count
    tier_types = {tier.type for tier in spec.kv_cache.tiers}
    assert (parsed.kv_offload_cpu_gb > 0) == ("cpu" in tier_types)
    assert (parsed.kv_offload_disk_path is not None) == ("disk" in tier_types)
    assert (parsed.kv_offload_remote_url is not None) == ("remote" in tier_types)
    config_from_args(parsed)  # the engine's own checks of the values pass too


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_pagoda_route_accepts_the_rendered_arguments(filename):
    router = next(m for m in _children(filename)
                  if m["kind"] == "Deployment" and m["metadata"]["labels"]["app.kubernetes.io/component"] == "router")
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["pagoda", "route"]
    parsed = _parser(router_app.add_arguments).parse_args(container["args"])
    name = router["metadata"]["name"]
    if check(load_example(filename)).spec.prefill is not None:
        assert (parsed.prefill_k8s_service, parsed.decode_k8s_service) == (f"default/{name}-prefill", f"default/{name}-decode")
        assert parsed.k8s_service is None
        router_app._validate_args(parsed)  # raises on anything pagoda route refuses
    else:
        assert parsed.k8s_service == f"default/{name}-engine"
    assert parsed.port == 8000
    assert parsed.policy == check(load_example(filename)).spec.router.policy


def test_builtin_tiny_renders_the_engine_s_name_for_its_tiny_model():
    # Without --model the engine serves its default model (SmolLM2), not the tiny one.
    assert r.BUILTIN_TINY_MODEL == TINY_MODEL_NAME
    args = _engine_args(_children("tiny-cpu.yaml"))
    assert args[args.index("--model") + 1] == TINY_MODEL_NAME


def test_a_remote_tier_on_a_unix_socket_reaches_the_engine_as_written():
    body = copy.deepcopy(MATRIX_BASE)
    body["spec"]["kvCache"] = {"tiers": [{"type": "remote", "url": "unix:///run/redis/redis.sock?db=1"}]}
    assert check(body).ok, check(body).problems
    assert_operator_and_engine_agree(body)
    config = engine_start(engine_containers(r.render(body, check(body).spec))["engine"])[0]
    assert config.cache.kv_offload_remote_url == "unix:///run/redis/redis.sock?db=1"


class _Refusing(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


# `pagoda serve`'s own parser, help included, as the CLI builds it.
SERVE_PARSER = _Refusing(prog="pagoda serve")
serve.add_arguments(SERVE_PARSER)


@functools.cache
def _rendered_args() -> tuple[str, ...]:
    """The command line the operator renders for llama-3.1-8b.yaml, which extraArgs follow."""
    return tuple(_engine_args(_children("llama-3.1-8b.yaml")))


def _pagoda_serve_takes(words: list[str]) -> bool:
    """Whether `pagoda serve`'s own parser takes these words after a rendered command line."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            SERVE_PARSER.parse_args([*_rendered_args(), *words])
    except (ValueError, SystemExit):  # SystemExit: -h printed the help
        return False
    return True


def _shortest_abbreviation(flag: str) -> str | None:
    """The shortest prefix of a long flag that argparse reads as that flag alone, if shorter."""
    long_flags = [f for f in ENGINE_PARSER._option_string_actions if f.startswith("--")] + ["--help"]
    for end in range(3, len(flag)):
        if [f for f in long_flags if f.startswith(flag[:end])] == [flag]:
            return flag[:end]
    return None


def _extra_args_cases() -> list[list[str]]:
    """For every flag of `pagoda serve`: words it takes (its value apart or joined, a unique
    abbreviation) and words it refuses (no value, a value of another type, not one of its choices,
    a value given to a switch); then unknown flags, stray words, help and ambiguous prefixes."""
    cases = []
    for action in ENGINE_PARSER._actions:
        for flag in action.option_strings:
            short = _shortest_abbreviation(flag) if flag.startswith("--") else None
            if action.nargs == 0:
                cases += [[flag], [f"{flag}=1"], ["--max-num-seqs", "8", flag]] + ([[short]] if short else [])
                continue
            good = action.choices[0].lower() if action.choices else {int: "2", float: "0.5"}.get(action.type, "x")
            cases += [[flag, good], [f"{flag}={good}"], [flag], [flag, "--max-num-seqs", "8"]]
            cases += [[short, good]] if short else []
            if action.type in (int, float):
                cases += [[flag, "two"], [flag, "-1"]]
            if action.choices:
                cases += [[flag, "no-such-choice"]]
    return cases + [["--no-such-flag"], ["--max-num-seqz", "8"], ["stray"], ["--max-num-seqs", "8", "9"], ["-h"],
                    ["--help"], ["--he"], ["--max"], ["--", "--max-num-seqs", "8"], ["-tp2"], ["-"], []]


def test_extra_args_are_refused_by_the_operators_parser_exactly_when_pagoda_serves_would_refuse_them():
    cases = _extra_args_cases()
    outcomes = []
    for words in cases:
        problems = engine_capabilities.extra_args_parse_problems(words)
        assert all(p.startswith("engine.extraArgs: ") for p in problems), problems
        takes = _pagoda_serve_takes(words)
        assert (not problems) == takes, (words, problems)
        outcomes.append(takes)
    assert len(cases) > 300 and outcomes.count(False) > 100 and outcomes.count(True) > 100  # both sides tried


def _engine_configures(words: list[str]) -> bool:
    """Whether the engine parses these words after a rendered command line and its EngineConfig
    takes the values (its own bounds)."""
    try:
        config_from_args(ENGINE_PARSER.parse_args([*_rendered_args(), *words]))
    except ValueError:
        return False
    return True


def _bound_cases() -> list[tuple[list[str], bool]]:
    """(words, inside the bounds) at and just past every bound of a flag (its `Flag`), each flag alone."""
    cases = []
    for dest, bounds in flags_by_dest().items():
        flag = bounds.spellings(dest)[0]
        step = 1 if ENGINE_ACTIONS[dest].type is int else 0.01
        for key, inside, outside in (("min", 0, -step), ("above", step, 0), ("max", 0, step)):
            if getattr(bounds, key) is not None:
                bound = getattr(bounds, key)
                cases += [([flag, f"{bound + inside:g}"], True), ([flag, f"{bound + outside:g}"], False)]
        if bounds.power_of_two:
            cases += [([flag, "1"], True), ([flag, "32"], True), ([flag, "24"], False), ([flag, "0"], False)]
    return cases


# Numeric flags the engine refuses at -1 or 0 only for want of their companions (they place engine
# cores on several nodes: --data-parallel-size and --nnodes above 1), a check across flags.
_CHECKED_WITH_COMPANIONS = {"--data-parallel-size-local", "--data-parallel-start-rank", "--data-parallel-rpc-port"}


def test_every_numeric_flag_the_engine_bounds_alone_has_its_bounds_in_its_flag():
    """The flags' bounds are complete at the low end: a numeric flag whose `Flag` has none takes
    -1 and 0 in the engine's EngineConfig, or is refused only for its companions."""
    flags = flags_by_dest()
    unbounded = [flags[dest].spellings(dest)[0] for dest, action in ENGINE_ACTIONS.items()
                 if dest in flags and action.type in (int, float)
                 and (flags[dest].min, flags[dest].above, flags[dest].power_of_two) == (None, None, False)]
    assert "--max-model-len" in unbounded and "--max-num-seqs" not in unbounded  # the rows were read
    refused = [(flag, value) for flag in unbounded for value in ("-1", "0") if not _engine_configures([flag, value])]
    assert {flag for flag, _ in refused} <= _CHECKED_WITH_COMPANIONS, refused


def test_every_bound_the_operator_checks_is_the_engines_own():
    cases = _bound_cases()
    assert len(cases) >= 2 * 22  # every bound of the flags (the request limits' too), both sides
    for words, inside in cases:
        assert _engine_configures(words) == inside, words  # the engine's EngineConfig.validate agrees
        problems = engine_capabilities.extra_args_problems(words)
        assert (not problems) == inside, (words, problems)
        if not inside:  # one problem, naming the flag and its bound
            assert len(problems) == 1 and re.fullmatch(
                rf"engine\.extraArgs: {words[0]} \S+: must be ((>=|>|<=) \S+|a power of two)( \(.+\))?", problems[0]), problems


@pytest.mark.parametrize("words, problem", [
    (["--max-num-seqz", "8"], "engine.extraArgs: pagoda serve has no flag --max-num-seqz (did you mean --max-num-seqs?)"),
    (["--long-prefill-token-threshold", "a lot"],
     "engine.extraArgs: argument --long-prefill-token-threshold: invalid int value: 'a lot'"),
    (["--cudagraph-mode", "piecewise"], "engine.extraArgs: argument --cudagraph-mode: invalid choice: 'PIECEWISE' "
                                        "(choose from 'FULL_AND_PIECEWISE', 'FULL_DECODE_ONLY', 'NONE')"),
    (["--help"], "engine.extraArgs: --help prints the help and exits: the pod would exit at once, and restart"),
    (["--max-num-seqs", "8", "9"], "engine.extraArgs: '9' is neither a flag of pagoda serve nor the value of one"),
    (["--long-prefill-token-threshold", "-1"],
     "engine.extraArgs: --long-prefill-token-threshold -1: must be >= 0 (0: no cap)"),
    (["--tool-call-parser", "nope"], "engine.extraArgs: --tool-call-parser nope: invalid tool call parser: nope "
                                     "(choose from { hermes, llama3_json, mistral, pythonic, qwen3_coder })"),
    (["--gpu-memory-utilization", "1.2"], "engine.extraArgs: --gpu-memory-utilization 1.2: must be <= 1"),
])
def test_a_spec_whose_extra_args_pagoda_serve_would_refuse_is_not_validated_and_says_why(words, problem):
    checked = check(with_spec(load_example("llama-3.1-8b.yaml"), engine__extraArgs=words))
    assert checked.problems == [problem]
    assert not checked.renderable  # a fault of the spec, not a feature the engine lacks

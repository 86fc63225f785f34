"""Is an InferenceService servable as written? A pure function from the resource to a list of
problems, each a sentence that shows its arithmetic, so the user can fix the spec from the
`Validated=False` condition (or `pagoda-operator render`) alone. A spec that asks for what the
engine cannot run yet is refused here too, with the engine's reason (engine_capabilities), and so
is a remote KV tier's URL the engine would refuse (the engine's own rule, `kv_tiers`), so the
user gets Validated=False, not a crash loop. Nothing here raises on user input; the
handler creates nothing while the list is non-empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from pagoda_engine.kv_tiers import remote_url_problems
from pagoda_engine.speculative import InvalidSpeculativeConfigError, parse_speculative_config

from pagoda_operator import engine_capabilities, sizing
from pagoda_operator.autoscaler.decision import NOT_FOR_PREFILL, PREFILL_POLICIES, autoscaling_problems
from pagoda_operator.autoscaler.prometheus import spec_prometheus_url
from pagoda_operator.models import architecture_of
from pagoda_operator.quantity import format_gib, gib, parse_quantity
from pagoda_operator.schema import SpecProblems
from pagoda_operator.spec import (InferenceServiceSpec, KVDiskVolume, desired_replicas, parse_spec, role_spec,
                                  shared_compile_cache_claim)

# Children are named <name>-engine (a Service: a DNS-1035 label of at most 63 characters).
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_NAME_LENGTH = 63 - len("-engine")
# spec.prefill: a Service per role, <name>-prefill the longest.
MAX_DISAGG_NAME_LENGTH = 63 - len("-prefill")
# Managers allowed to own spec.replicas next to spec.autoscaling: writes through the scale
# subresource (HPA, KEDA, kubectl scale) and Pagoda's own autoscaler.
SCALER_MANAGER_PREFIX = "pagoda"


@dataclass
class Checked:
    """The outcome of validation: the parsed spec when it parsed, and every problem found.

    `problems` holds them all (the Validated=False message); `unsupported` those of them that
    only ask for engine features not implemented yet (engine_capabilities)."""

    spec: InferenceServiceSpec | None
    problems: list[str]
    unsupported: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def renderable(self) -> bool:
        """Right as written, apart from features the engine lacks: `render` can show what the
        spec would become (for review and tests), though the operator applies none of it."""
        return self.spec is not None and len(self.problems) == len(self.unsupported)


def check(body: dict[str, Any]) -> Checked:
    """Parse and validate a whole InferenceService object (metadata and spec): its schema, its
    arithmetic, and whether the engine it deploys can run it."""
    problems = _check_metadata(body.get("metadata") or {})
    try:
        spec = parse_spec(body.get("spec"))
    except SpecProblems as e:
        return Checked(None, problems + e.problems)
    problems += validate_spec(spec)
    problems += _check_replicas_owner(spec, body.get("metadata") or {})
    if spec.prefill is not None:
        problems += _check_replicas_owner(role_spec(spec, "prefill"), body.get("metadata") or {}, prefill=True)
    name = (body.get("metadata") or {}).get("name")
    if spec.prefill is not None and isinstance(name, str) and MAX_DISAGG_NAME_LENGTH < len(name) <= MAX_NAME_LENGTH:
        problems.append(f"metadata.name: {name!r} is too long for spec.prefill: at most {MAX_DISAGG_NAME_LENGTH} "
                        f"characters, so that the Service {name}-prefill is a valid name")
    unsupported = engine_capabilities.unsupported(spec)
    if spec.prefill is not None:
        unsupported += [f"prefill: {p}" for p in engine_capabilities.unsupported(role_spec(spec, "prefill"))
                        if p not in unsupported]
    return Checked(spec, problems + unsupported, unsupported)


def _check_metadata(meta: dict[str, Any]) -> list[str]:
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return ["metadata.name: required"]
    if not re.fullmatch(NAME_PATTERN, name) or len(name) > MAX_NAME_LENGTH:
        return [
            f"metadata.name: {name!r} must be a lower-case DNS label that starts with a letter and has at most "
            f"{MAX_NAME_LENGTH} characters, so that the Service {name}-engine is a valid name"
        ]
    return []


def validate_spec(spec: InferenceServiceSpec) -> list[str]:
    """Semantic checks of a parsed spec (types and bounds were checked by parsing)."""
    return [
        *_check_model(spec),
        *_check_topology(spec),
        *_check_heads(spec),
        *_check_experts(spec),
        *_check_memory(spec),
        *_check_scaling(spec),
        *_check_kv_cache(spec),
        *_check_node_fit(spec),
        *_check_router(spec),
        *engine_capabilities.extra_args_problems(spec.engine.extra_args),
        *_check_api_servers(spec),
        *_check_compile_cache(spec),
        *_check_engine_key(spec),
        *_check_speculative(spec),
        *_check_all2all(spec),
        *_check_drain(spec),
        *_check_rollout(spec),
        *_check_prefill(spec),
        *_check_loras(spec),
    ]


LORA_FLAGS = {"--enable-lora": "spec.loras", "--lora-modules": "spec.loras", "--max-loras": "engine.maxLoras",
              "--max-lora-rank": "engine.maxLoraRank"}


def _check_loras(spec: InferenceServiceSpec) -> list[str]:
    """spec.loras: names unique and apart from the model's (each is a model name of its own), the
    LoRA flags from their fields only, and what the engine refuses beside adapters."""
    if not spec.loras:
        return [f"engine.{field_}: needs spec.loras (adapters to serve)" for field_, value in
                (("maxLoras", spec.engine.max_loras), ("maxLoraRank", spec.engine.max_lora_rank)) if value is not None]
    problems = [f"engine.extraArgs {flag}: set {field_} instead (spec.loras renders the LoRA flags)"
                for flag, field_ in LORA_FLAGS.items()
                if engine_capabilities.extra_arg_value(spec.engine.extra_args, flag) not in (None, False)]
    names = [a.name for a in spec.loras]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"loras: the name {name!r} is given twice; each adapter is a model name of its own")
    served = spec.model.name
    if served is not None and served in names:
        problems.append(f"loras: {served!r} is model.name; an adapter needs a name of its own")
    if spec.engine.api_server_count > 1:
        problems.append(f"loras: engine.apiServerCount {spec.engine.api_server_count}: an adapter loaded at run time "
                        f"reaches one API server process only; keep apiServerCount 1")
    return problems


# Flags that decide the KV pages' layout (or the transfer itself): a prefill pod's must be the
# decode pods', so they come from the shared fields, never from a role's extraArgs.
PAGE_LAYOUT_FLAGS = {
    "--model": "model.uri", "--dtype": "model.dtype", "--quantization": "model.quantization",
    "--block-size": "kvCache.pageSize", "--kv-cache-dtype": "engine.kvCacheDtype",
    "--tensor-parallel-size": "topology.tensor", "--pipeline-parallel-size": "topology.pipeline",
    "--kv-transfer-config": "spec.prefill (the operator sets each role's)",
    "--enable-prefix-caching": "engine.prefixCaching",
}


def _check_prefill(spec: InferenceServiceSpec) -> list[str]:
    """spec.prefill: what keeps the prefill pods' pages usable by the decode pods (the same model,
    dtypes, quantization and page size, no tensor or pipeline parallelism, the prefix cache on,
    which is where a held prompt's pages live), what the disaggregated router cannot run with yet,
    and the prefill role's own settings checked as the decode pods' are."""
    p = spec.prefill
    if p is None:
        return [f"engine.extraArgs {flag}: set by the operator with spec.prefill; remove it"
                for flag in ("--kv-transfer-config",) if engine_capabilities.extra_arg_value(spec.engine.extra_args, flag) is not None]
    problems = []
    t = spec.topology
    if t.tensor != 1 or t.pipeline != 1:
        problems.append(f"topology: spec.prefill needs tensor 1 and pipeline 1 (given tensor {t.tensor}, pipeline "
                        f"{t.pipeline}): KV transfers between tensor- or pipeline-parallel engines are not supported yet")
    if t.nodes != 1:
        problems.append(f"topology.nodes: spec.prefill needs one node per replica (given {t.nodes})")
    if not spec.engine.prefix_caching:
        problems.append("engine.prefixCaching: spec.prefill needs the prefix cache (the pages a prefill holds for "
                        "the decode pods are its prefix cache's)")
    engine = p.engine
    if engine is not None and engine.prefix_caching is False:
        problems.append("prefill.engine.prefixCaching: must stay true (the pages a prefill holds for the decode pods "
                        "are its prefix cache's)")
    if engine is not None and engine.kv_cache_dtype is not None and engine.kv_cache_dtype != spec.engine.kv_cache_dtype:
        problems.append(f"prefill.engine.kvCacheDtype: {engine.kv_cache_dtype} differs from engine.kvCacheDtype "
                        f"{spec.engine.kv_cache_dtype}; the decode pods cannot use pages of another dtype (set "
                        f"engine.kvCacheDtype, which both roles share)")
    for where, extra in (("engine.extraArgs", spec.engine.extra_args),
                         ("prefill.engine.extraArgs", engine.extra_args if engine is not None else None)):
        for flag, field_ in PAGE_LAYOUT_FLAGS.items():
            if extra and engine_capabilities.extra_arg_value(extra, flag) is not None:
                problems.append(f"{where} {flag}: both roles must share it for the pages to move between them; "
                                f"set {field_} instead")
    if spec.router.mode == "gateway":
        problems.append("router.mode: gateway with spec.prefill is not supported yet (the Endpoint Picker picks one "
                        "engine per request); use the builtin router")
    problems += _check_prefill_autoscaling(spec)
    # The prefill role's own settings (its resources, engine fields and extraArgs), checked as the
    # decode pods' are: what the decode pods' check already said is not repeated, nor its
    # autoscaling, named above as prefill.autoscaling.
    role = role_spec(spec, "prefill")
    said = set(problems) | set(validate_spec(_without_prefill(spec))) | set(_check_scaling(role))
    problems += [f"prefill: {problem}" for problem in validate_spec(role) if problem not in said]
    return problems


def _without_prefill(spec: InferenceServiceSpec) -> InferenceServiceSpec:
    return replace(spec, prefill=None)


def _check_all2all(spec: InferenceServiceSpec) -> list[str]:
    """--all2all-backend, --enable-dbo and --enable-eplb are about experts across data-parallel
    cores: the engine refuses them at start-up without (`EngineConfig.validate`), --enable-dbo
    without the all-to-all, EPLB with tensor parallelism."""
    extra, topology = spec.engine.extra_args, spec.topology
    across = topology.expert and topology.data > 1
    problems = []
    backend = engine_capabilities.extra_arg_value(extra, "--all2all-backend")
    if backend is not None and backend != "allgather_reducescatter" and not across:
        problems.append(f"engine.extraArgs --all2all-backend {backend}: needs experts across data-parallel engine "
                        f"cores (topology.expert with topology.data above 1)")
    if engine_capabilities.extra_arg_value(extra, "--enable-dbo") and (not across or backend != "alltoallv"):
        problems.append("engine.extraArgs --enable-dbo: needs --all2all-backend alltoallv with experts across "
                        "data-parallel engine cores (topology.expert with topology.data above 1)")
    if engine_capabilities.extra_arg_value(extra, "--enable-eplb") and not (across and topology.tensor == 1):
        problems.append("engine.extraArgs --enable-eplb: needs experts across data-parallel engine cores "
                        "(topology.expert with topology.data above 1) and topology.tensor 1")
    return problems


def _check_speculative(spec: InferenceServiceSpec) -> list[str]:
    """The engine's own check of a speculative config (`pagoda_engine.speculative`), for
    engine.speculative and a --speculative-config in extraArgs alike, and what it refuses with
    the topology."""
    in_extra_args = engine_capabilities.extra_arg_value(spec.engine.extra_args, "--speculative-config")
    if spec.engine.speculative is not None and in_extra_args is not None:
        return ["engine: speculative and extraArgs --speculative-config both set speculative decoding; keep one"]
    given, where = ((spec.engine.speculative.config(), "engine.speculative") if spec.engine.speculative is not None
                    else (in_extra_args, "engine.extraArgs --speculative-config"))
    if given is None:
        return []
    try:
        parsed = parse_speculative_config(given)
    except InvalidSpeculativeConfigError as e:
        return [f"{where}: {e}"]
    if spec.topology.pipeline > 1 and parsed.method == "eagle3":
        return [f"{where}: method 'eagle3' is not supported under pipeline parallelism yet (topology.pipeline "
                f"{spec.topology.pipeline})"]
    return []


def _check_drain(spec: InferenceServiceSpec) -> list[str]:
    """A --drain-timeout of the user's own must end before the pod's grace period does."""
    given = engine_capabilities.extra_arg_value(spec.engine.extra_args, "--drain-timeout")
    prestop, room = sizing.engine_shutdown(spec)
    if given is not None and given > room:
        return [f"engine.extraArgs: --drain-timeout {given:g} does not fit in terminationGracePeriodSeconds "
                f"{spec.engine.termination_grace_period_seconds} (a {prestop} s preStop sleep, then at most {room} s "
                f"of drain, then {sizing.SHUTDOWN_MARGIN_SECONDS} s to exit); raise "
                f"engine.terminationGracePeriodSeconds or lower the drain timeout"]
    return []


def _check_rollout(spec: InferenceServiceSpec) -> list[str]:
    """An in-place rollout takes a replica away before its successor is ready: with one replica
    that leaves none."""
    if spec.engine.rollout != "in-place":
        return []
    if spec.autoscaling is not None:  # scaled to one at times (or from zero to one)
        where, fewest, alone = "autoscaling.minReplicas", spec.autoscaling.min_replicas, spec.autoscaling.min_replicas < 2
    else:  # zero replicas: nothing serves, nothing to replace
        where, fewest = "replicas", 1 if spec.replicas is None else spec.replicas
        alone = fewest == 1
    if alone:
        return [f"engine.rollout: in-place replaces a replica before its successor is ready, and with {where} "
                f"{fewest} no replica would serve meanwhile; use surge (the default) or 2 replicas or more"]
    return []


def _check_engine_key(spec: InferenceServiceSpec) -> list[str]:
    """The engines' key is the operator's: from the Secret <name>-internal-key, which the router
    presents too. A key of the user's own would lock the router out (401 on every request)."""
    problems = []
    if any(e.get("name") == "PAGODA_API_KEY" for e in spec.engine.env):
        problems.append("engine.env: PAGODA_API_KEY is set by the operator (the router's key to the engines, from the "
                        "Secret <name>-internal-key); remove it, and give clients keys with router.apiKeySecretRef")
    if engine_capabilities.extra_arg_value(spec.engine.extra_args, "--api-key") is not None:
        problems.append("engine.extraArgs: --api-key would replace the key the router presents to the engines; remove it, "
                        "and give clients keys with router.apiKeySecretRef")
    return problems


def _check_compile_cache(spec: InferenceServiceSpec) -> list[str]:
    """A shared compile cache is for GPU engines, and is Triton's cache: a TRITON_CACHE_DIR of the
    user's own would leave the claim mounted and unused."""
    if shared_compile_cache_claim(spec) is None:
        return []
    if sizing.gpus_per_pod(spec) == 0:
        return ["engine.compileCache: CPU engines compile no GPU kernels; remove it or give the pods GPUs"]
    if any(e.get("name") == "TRITON_CACHE_DIR" for e in spec.engine.env):
        return ["engine: compileCache.persistentVolumeClaim and env TRITON_CACHE_DIR both place Triton's cache; keep one"]
    return []


def _check_api_servers(spec: InferenceServiceSpec) -> list[str]:
    """Each API server process keeps a CPU core busy under load: a pod given fewer CPUs than
    processes only makes them take turns. A count in engine.extraArgs reaches every pod, the
    headless workers of a multi-node replica too, which run no API server and refuse above 1."""
    count, cpu = spec.engine.api_server_count, spec.resources.cpu
    # What the engine's parser takes from extraArgs (a bad or missing value: extra_args_problems says so).
    in_extra_args = engine_capabilities.extra_arg_value(spec.engine.extra_args, "--api-server-count")
    if count > 1 and in_extra_args is not None:
        return ["engine: apiServerCount and extraArgs --api-server-count both set the API server processes; keep one"]
    if in_extra_args is not None and in_extra_args > 1 and spec.topology.nodes > 1:
        return [f"engine: extraArgs --api-server-count {in_extra_args} would reach the headless worker pods too, which "
                "run no API server and refuse a count above 1; set apiServerCount instead (the leader's alone)"]
    if count > 1 and spec.topology.data > 1 and spec.topology.nodes > 1:
        return [f"engine: apiServerCount {count} with engine cores on several nodes (data {spec.topology.data} × nodes "
                f"{spec.topology.nodes}): one API server reaches the other nodes' cores; keep apiServerCount 1"]
    if count > 1 and cpu is not None and parse_quantity(cpu) < count:
        return [f"engine: apiServerCount {count} needs at least {count} CPUs per pod, but resources.cpu is {cpu}"]
    return []


def _check_model(spec: InferenceServiceSpec) -> list[str]:
    """Without model.uri there is no model to serve but the engine's built-in tiny random-weight one:
    that has to be asked for (model.builtinTiny), or a forgotten field would put a toy on the user's GPUs."""
    if spec.model.uri is not None and spec.model.builtin_tiny:
        return ["model: give model.uri or model.builtinTiny: true, not both"]
    if spec.model.uri is None and not spec.model.builtin_tiny:
        where = " on GPU" if spec.resources.gpus_per_pod != 0 else ""
        return [f"model.uri: required{where} (without it there is only the engine's built-in tiny model with random "
                "weights); set model.uri, or model.builtinTiny: true to serve the tiny model on purpose"]
    scheme = (spec.model.uri or "").partition("://")[0]
    dl = spec.model.download
    if dl.s3_secret_ref is not None and scheme != "s3":
        return ["model.download.s3SecretRef: only an s3:// model is downloaded with it; remove it or use an s3:// uri"]
    if dl.token_secret_ref is not None and scheme != "hf":
        return ["model.download.tokenSecretRef: only an hf:// model is downloaded with it; remove it or use an hf:// uri"]
    return []


def _check_topology(spec: InferenceServiceSpec) -> list[str]:
    t = spec.topology
    ranks = sizing.ranks(spec)
    given = spec.resources.gpus_per_pod
    shape = f"tensor {t.tensor} × pipeline {t.pipeline} × data {t.data} = {ranks} ranks"
    if given == 0:
        return []  # CPU: ranks are processes, not devices
    if given is not None and given * t.nodes != ranks:
        return [
            f"topology: {shape} need {ranks} GPUs per replica, but resources give "
            f"gpusPerPod {given} × nodes {t.nodes} = {given * t.nodes}; make them equal"
        ]
    if given is None and ranks % t.nodes:
        return [f"topology: {shape} cannot be spread evenly over nodes {t.nodes} ({ranks} / {t.nodes} = {ranks / t.nodes:.2f} GPUs per pod)"]
    if t.data > 1 and t.nodes > 1 and t.data % t.nodes:
        # Engine cores over several nodes are whole cores: each pod runs data / nodes of them.
        return [f"topology: data {t.data} engine cores cannot be spread evenly over nodes {t.nodes}: each pod of the "
                f"replica runs whole cores (data / nodes = {t.data / t.nodes:.2f}); make data a multiple of nodes"]
    return []


def _check_heads(spec: InferenceServiceSpec) -> list[str]:
    arch = architecture_of(spec.model)
    tp = spec.topology.tensor
    problems = []
    heads, kv_heads = arch.num_attention_heads, arch.num_key_value_heads
    if heads is not None and heads % tp:
        problems.append(
            f"topology.tensor: {tp} does not divide the model's {heads} attention heads "
            f"({heads} / {tp} = {heads / tp:.2f}); use a divisor of {heads}"
        )
    if kv_heads is not None and kv_heads % tp and tp % kv_heads:
        problems.append(
            f"topology.tensor: {tp} neither divides the model's {kv_heads} KV heads ({kv_heads} / {tp} = {kv_heads / tp:.2f}) "
            f"nor is a multiple of them (each GPU must hold whole KV heads)"
        )
    if arch.num_layers is not None and spec.topology.pipeline > arch.num_layers:
        problems.append(f"topology.pipeline: {spec.topology.pipeline} stages for {arch.num_layers} layers leaves stages empty")
    return problems


def _check_experts(spec: InferenceServiceSpec) -> list[str]:
    if not spec.topology.expert:
        return []
    arch = architecture_of(spec.model)
    what = spec.model.uri or "the built-in tiny model"
    if arch.moe is None:
        return [f"topology.expert: expert parallelism needs a mixture-of-experts model, and {what} is not a known one; set spec.model.architecture.moe: true if it is"]
    if not arch.moe:
        return [f"topology.expert: expert parallelism needs a mixture-of-experts model, but {what} is dense (moe: false)"]
    ep = spec.topology.tensor * spec.topology.data
    if arch.num_experts is not None and arch.num_experts % ep:
        return [f"topology.expert: {arch.num_experts} experts cannot be split evenly over tensor {spec.topology.tensor} × data {spec.topology.data} = {ep} ranks"]
    return []


def _check_memory(spec: InferenceServiceSpec) -> list[str]:
    if sizing.gpus_per_pod(spec) == 0:
        return []
    plan = sizing.memory_plan(spec)
    if plan is None or plan.needed_gib <= plan.usable_gib:
        return []
    need_shards = -(-plan.weights_gib * plan.model_shards // max(plan.usable_gib - plan.kv_gib - plan.reserve_gib, 1e-9))
    return [f"memory: the model does not fit: {plan.explain()}; raise topology.tensor or topology.pipeline (about {int(need_shards)} shards), or use GPUs with more memory (resources.gpuMemoryGiB)"]


def _check_scaling(spec: InferenceServiceSpec, where: str = "autoscaling", replicas: str = "replicas") -> list[str]:
    """An autoscaling block and the replicas beside it (`where`, `replicas`: their names, for the
    prefill role's spec.prefill.autoscaling and spec.prefill.replicas)."""
    a = spec.autoscaling
    if a is None:
        return []
    problems = []
    if a.min_replicas > a.max_replicas:
        problems.append(f"{where}: minReplicas {a.min_replicas} > maxReplicas {a.max_replicas}")
    if spec.replicas is not None and not a.min_replicas <= spec.replicas <= a.max_replicas:
        problems.append(f"{replicas}: {spec.replicas} is outside {where}'s [{a.min_replicas}, {a.max_replicas}]")
    return problems + autoscaling_problems(a, where)


def _check_prefill_autoscaling(spec: InferenceServiceSpec) -> list[str]:
    """spec.prefill.autoscaling: on what measures prefill load, never to zero (with no prefill pod
    the router sends whole requests to the decode pods, and no prefill signal is left to scale up
    on). The built-in driver writes prefill.replicas; KEDA or an HPA scale the prefill Deployment
    itself (there is no scale subresource for prefill.replicas), and take prometheusURL from
    spec.autoscaling when the block has none, as the built-in driver does."""
    a = spec.prefill.autoscaling
    if a is None:
        return []
    problems = []
    if a.driver == "hpa" and a.prometheus_url:
        # spec.autoscaling's is read for the KV status; this one only by a prefill scaler that queries it.
        problems.append("prefill.autoscaling.prometheusURL: an HPA reads its metrics through the cluster's "
                        "external-metrics adapter, not from a URL; remove it, or use driver keda or builtin")
    url = spec_prometheus_url(spec, prefill=True)
    if url != a.prometheus_url:
        spec = replace(spec, prefill=replace(spec.prefill, autoscaling=replace(a, prometheus_url=url)))
    if a.policy not in PREFILL_POLICIES:
        problems.append(f"prefill.autoscaling.policy: {a.policy} does not measure prefill load: {NOT_FOR_PREFILL[a.policy]}; "
                        f"use queue (waiting requests per ready prefill replica) or ttft (the prefill pods' p90 time "
                        f"to first token)")
    if a.min_replicas == 0:
        problems.append("prefill.autoscaling.minReplicas: 0 could never scale back up: with no prefill pod the router "
                        "sends whole requests to the decode pods, so no prefill pod's queue or TTFT is left to scale "
                        "on; use 1 or more (prefill.replicas: 0, without autoscaling, runs no prefill pod)")
    return problems + _check_scaling(role_spec(spec, "prefill"), "prefill.autoscaling", "prefill.replicas")


def _check_replicas_owner(spec: InferenceServiceSpec, meta: dict[str, Any], prefill: bool = False) -> list[str]:
    """replicas and autoscaling are exclusive for users; with autoscaling, spec.replicas is the
    scaler's output (scale subresource), and with `prefill` (`spec` the prefill role's) so is
    spec.prefill.replicas, the built-in autoscaler's. managedFields tell who wrote it."""
    if spec.autoscaling is None or spec.replicas is None:
        return []
    path = ("f:spec", "f:prefill", "f:replicas") if prefill else ("f:spec", "f:replicas")

    def owns(entry: dict[str, Any]) -> bool:
        fields = entry.get("fieldsV1") or {}
        for key in path[:-1]:
            fields = fields.get(key) or {}
        return path[-1] in fields

    owners = [entry for entry in meta.get("managedFields") or [] if owns(entry)]
    by_user = [
        e.get("manager", "?") for e in owners
        if e.get("subresource") != "scale" and not str(e.get("manager", "")).startswith(SCALER_MANAGER_PREFIX)
    ]
    if owners and not by_user:
        return []
    who = f" (set by {', '.join(by_user)})" if by_user else ""
    if prefill and spec.autoscaling.driver != "builtin":
        return [f"prefill.replicas: set prefill.replicas or prefill.autoscaling, not both{who}; with driver "
                f"{spec.autoscaling.driver} the scaler sets the prefill Deployment's replicas"]
    if prefill:
        return [f"prefill.replicas: set prefill.replicas or prefill.autoscaling, not both{who}; with autoscaling the "
                f"built-in autoscaler sets prefill.replicas"]
    return [f"replicas: set replicas or autoscaling, not both{who}; with autoscaling the scaler sets replicas through the scale subresource"]


def _check_kv_cache(spec: InferenceServiceSpec) -> list[str]:
    kv = spec.kv_cache
    problems = []
    if kv.page_size & (kv.page_size - 1):
        problems.append(f"kvCache.pageSize: {kv.page_size} is not a power of two")
    if kv.tiers and not spec.engine.prefix_caching:
        problems.append("kvCache.tiers: the tiers hold prefix-cache pages, so they need engine.prefixCaching: true")
    seen = set()
    for i, tier in enumerate(kv.tiers):
        where = f"kvCache.tiers[{i}] ({tier.type})"
        if tier.type in seen:
            problems.append(f"{where}: a second {tier.type} tier; give each type at most once")
        seen.add(tier.type)
        if tier.type in ("cpu", "disk"):
            if tier.size is None:
                problems.append(f"{where}: size is required")
            elif gib(tier.size) <= 0:
                problems.append(f"{where}: size {tier.size} must be positive")
            if tier.url is not None or tier.secret_ref is not None:
                problems.append(f"{where}: url and secretRef belong to a remote tier")
        if tier.type == "disk" and tier.volume is not None:
            problems += _check_disk_volume(spec, tier.volume, where)
        if tier.type != "disk" and tier.volume is not None:
            problems.append(f"{where}: volume belongs to a disk tier")
        if tier.type == "remote":
            if tier.url is None:
                problems.append(f"{where}: url is required (redis://host:port)")
            else:
                problems += [f"{where}: url {problem}" for problem in remote_url_problems(tier.url)]
    return problems


def most_replicas(spec: InferenceServiceSpec) -> int:
    """The most engine replicas the service may run: autoscaling's ceiling, else its replicas."""
    return spec.autoscaling.max_replicas if spec.autoscaling is not None else desired_replicas(spec)


def _check_disk_volume(spec: InferenceServiceSpec, volume: KVDiskVolume, where: str) -> list[str]:
    if volume.persistent_volume_claim is not None and volume.ephemeral is not None:
        return [f"{where}: volume takes persistentVolumeClaim or ephemeral, not both"]
    pods = most_replicas(spec) * spec.topology.nodes
    if volume.persistent_volume_claim is not None and pods > 1:
        return [f"{where}: volume.persistentVolumeClaim is one volume, but up to {pods} engine pods would share it "
                f"(each pod's tier is its own); use volume.ephemeral (a claim per pod) or the default emptyDir"]
    return []


def _check_node_fit(spec: InferenceServiceSpec) -> list[str]:
    """The engine pods that may share a node, each with its cpu KV tier, fit the node's
    allocatable memory (resources.nodeMemory), and a pod's GPUs fit a node (gpusPerNode)."""
    r = spec.resources
    gpus = sizing.gpus_per_pod(spec)
    problems = []
    if r.gpus_per_node is not None and gpus > r.gpus_per_node:
        problems.append(f"resources.gpusPerNode: a pod needs {gpus} GPUs but a node has {r.gpus_per_node}; "
                        f"spread the replica over more nodes (topology.nodes)")
    if r.node_memory is None:
        return problems
    pods, why = sizing.pods_per_node(spec, most_replicas(spec))
    engine, tier = sizing.engine_memory_gib(spec), sizing.cpu_tier_gib(spec)
    node = gib(r.node_memory)
    need = pods * (engine + tier)
    if need > node:
        room = node / pods - engine
        fix = (f"shrink the cpu tier to at most {format_gib(max(room, 0))} per pod, or " if tier and room > 0 else "")
        problems.append(
            f"resources.nodeMemory: {why} × (engine memory {engine:g} GiB + cpu KV tier {tier:g} GiB) = "
            f"{need:g} GiB, but a node offers nodeMemory {r.node_memory} ({node:g} GiB); "
            f"{fix}use nodes with more memory (or lower resources.memory)")
    return problems


def _check_router(spec: InferenceServiceSpec) -> list[str]:
    problems = []
    ingress = spec.router.ingress
    if ingress is not None and ingress.tls is not None and not ingress.host:
        problems.append("router.ingress.tls: needs router.ingress.host (the certificate is for a host name)")
    if spec.router.gateway is not None and spec.router.mode != "gateway":
        problems.append("router.gateway: set router.mode: gateway to use it (the builtin mode attaches to no Gateway)")
    if spec.router.mode == "gateway" and spec.topology.nodes > 1:
        problems.append("router.mode: gateway with topology.nodes > 1 is not supported yet (the InferencePool would "
                        "select every node's pod, not only the leaders that serve)")
    if spec.router.mode == "gateway" and spec.router.api_key_secret_ref is not None:
        # The gateway reaches the engines directly: it would have to present their key, which is the operator's.
        problems.append("router.apiKeySecretRef: not supported with router.mode: gateway yet (the gateway would reach "
                        "the engines without a key); authenticate clients at the gateway instead")
    return problems

"""Validation: the examples pass; bad specs are rejected with the arithmetic in the message;
nothing a user writes makes validation raise."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda_operator.conditions import Observation, compute_status
from pagoda_engine import capabilities
from pagoda_operator.engine_capabilities import requested_features
from pagoda_operator.render import engine_args, render
from pagoda_operator.validation import check
from tests.operator.support import EXAMPLE_FILES, EXAMPLES_DIR, load_example, with_spec

FEATURES = {f.key: f for f in capabilities.FEATURES}


def problems_of(body: dict) -> list[str]:
    return check(body).problems


def _header(filename: str) -> str:
    """The leading comment of an example file, as one line of text."""
    lines = (EXAMPLES_DIR / filename).read_text().splitlines()
    comment = itertools.takewhile(lambda line: line.startswith("#"), lines)
    return " ".join(" ".join(line.lstrip("#") for line in comment).split())


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_examples_are_valid_or_say_which_engine_features_they_wait_for(filename):
    checked = check(load_example(filename))
    assert checked.renderable and checked.problems == checked.unsupported, checked.problems
    asked = {key for key, _ in requested_features(checked.spec)}
    waiting = {FEATURES[key].title for key in asked if not FEATURES[key].implemented}
    waiting |= {c.title for c in capabilities.COMBINATIONS if set(c.keys) <= asked}
    header = _header(filename)
    assert checked.ok == (not waiting)
    # An example that waits for a feature says so at its top, and which; one that runs does not.
    assert ("NEEDS A LATER PAGODA" in header) == bool(waiting)
    assert ("Validated=False" in header) == bool(waiting)
    for title in waiting:
        assert title in header, f"{filename} does not say it needs {title}"


@pytest.mark.parametrize("filename", [f for f in EXAMPLE_FILES if not check(load_example(f)).ok])
def test_an_example_the_engine_cannot_run_yet_gets_validated_false_with_the_engines_reason(filename):
    checked = check(load_example(filename))
    status = compute_status(None, Observation(generation=1, validated=checked.ok, problems=checked.problems), "2026-01-01T00:00:00Z")
    (validated,) = [c for c in status["conditions"] if c["type"] == "Validated"]
    assert validated["status"] == "False"
    for key, where in requested_features(checked.spec):
        feature = FEATURES[key]
        if not feature.implemented:
            assert f"{where} asks for {feature.title}, which Pagoda's engine does not implement yet" in validated["message"]
    for combination in capabilities.COMBINATIONS:
        if set(combination.keys) <= {key for key, _ in requested_features(checked.spec)}:
            assert f"asks for {combination.title}, which Pagoda's engine does not implement yet" in validated["message"]


# (case, the feature asked for, spec changes, the problem while the engine lacks the feature)
UNSUPPORTED = [
    ("pipeline", "pipeline-parallel", {"topology": {"pipeline": 2}},
     "topology.pipeline: 2 asks for pipeline parallelism, which Pagoda's engine does not implement yet (tensor parallelism works)"),
    ("nodes", "multi-node", {"topology": {"nodes": 2}, "resources": {"gpusPerPod": 0}},
     "topology.nodes: 2 asks for multi-node serving, which Pagoda's engine does not implement yet (tensor parallelism works inside one pod)"),
    ("cpu-tier", "kv-offload-cpu", {"kvCache": {"tiers": [{"type": "cpu", "size": "1Gi"}]}},
     "kvCache.tiers[0] (cpu) asks for KV offload tiers in CPU memory, which Pagoda's engine does not implement yet"),
    ("extra-args", "kv-offload-remote", {"engine": {"extraArgs": ["--max-num-seqs", "8", "--kv-offload-remote-url=redis://kv:6379"]}},
     "engine.extraArgs: --kv-offload-remote-url=redis://kv:6379 asks for KV offload tiers in a remote store"),
    ("extra-args-short", "data-parallel", {"engine": {"extraArgs": ["-dp", "2"]}},
     "engine.extraArgs: -dp asks for data parallelism inside one engine"),
    ("extra-args-abbreviated", "expert-parallel", {"engine": {"extraArgs": ["--enable-expert"]}},
     "engine.extraArgs: --enable-expert asks for expert parallelism"),
    ("env", "multi-node", {"engine": {"env": [{"name": "LWS_GROUP_SIZE", "value": "4"}]}},
     "engine.env: LWS_GROUP_SIZE=4 asks for multi-node serving"),
    ("kv-cache-dtype", "kv-cache-fp8", {"engine": {"kvCacheDtype": "fp8"}},
     "engine.kvCacheDtype: fp8 asks for FP8 KV cache pages, which Pagoda's engine does not implement yet"),
    ("kv-cache-dtype-extra-args", "kv-cache-fp8", {"engine": {"extraArgs": ["--kv-cache-dtype", "fp8_e4m3"]}},
     "engine.extraArgs: --kv-cache-dtype asks for FP8 KV cache pages"),
]


@pytest.mark.parametrize("case,key,changes,expected", UNSUPPORTED, ids=[c[0] for c in UNSUPPORTED])
def test_a_feature_the_engine_lacks_is_refused_with_the_field_that_asks_for_it(case, key, changes, expected):
    body = load_example(TINY)
    _merge(body["spec"], changes)
    checked = check(body)
    assert [k for k, _ in requested_features(checked.spec)] == [key]
    if FEATURES[key].implemented:  # it has landed: nothing left to refuse
        assert checked.problems == []
    else:
        assert checked.renderable and not checked.ok
        assert checked.problems == checked.unsupported == [p for p in checked.problems if expected in p], checked.problems


def test_data_parallel_with_expert_parallel_runs_but_not_under_pipeline_parallelism():
    body = load_example("mixtral-8x7b-ep.yaml")
    assert problems_of(body) == []  # tensor 2 × data 2, experts over all 4 ranks
    piped = with_spec(body, topology={**body["spec"]["topology"], "pipeline": 2})
    assert check(piped).unsupported == [
        "topology.pipeline: 2 with topology.data: 2 with topology.expert: true asks for expert parallelism across "
        "data-parallel engine cores under pipeline parallelism, which Pagoda's engine does not implement yet "
        "(expert parallelism across data-parallel engine cores works with tensor parallelism)"]


def test_data_parallel_needs_tensor_times_data_gpus_per_pod():
    body = with_spec(load_example(LLAMA_8B), topology={"tensor": 2, "data": 2}, resources__gpusPerPod=2)
    assert problems_of(body) == [
        "topology: tensor 2 × pipeline 1 × data 2 = 4 ranks need 4 GPUs per replica, but resources give "
        "gpusPerPod 2 × nodes 1 = 2; make them equal"]
    assert problems_of(with_spec(body, resources__gpusPerPod=4)) == []


def test_engine_cores_over_several_nodes_are_accepted():
    """data 2 × nodes 2: each pod runs one whole core of tensor 4 (the engine's `dp_nodes`)."""
    body = with_spec(load_example(LLAMA_70B), topology={"tensor": 4, "data": 2, "nodes": 2})
    assert problems_of(body) == []


def test_what_the_engine_runs_is_not_refused():
    body = with_spec(load_example(TINY), topology={"tensor": 2}, engine={
        "extraArgs": ["--tensor-parallel-size", "2", "--max-num-seqs", "8"], "env": [{"name": "LWS_GROUP_SIZE", "value": "1"}]})
    assert problems_of(body) == []


LLAMA_8B = "llama-3.1-8b.yaml"
LLAMA_70B = "llama-3.1-70b-multinode.yaml"
TINY = "tiny-cpu.yaml"

BAD_SPECS = [
    ("tp-does-not-divide-heads", LLAMA_8B, {"topology": {"tensor": 3}},
     "topology.tensor: 3 does not divide the model's 32 attention heads (32 / 3 = 10.67); use a divisor of 32"),
    ("tp-does-not-divide-kv-heads", LLAMA_8B,
     {"topology": {"tensor": 6}, "model": {"uri": "hf://acme/custom", "architecture": {"numAttentionHeads": 48, "numKeyValueHeads": 8}}},
     "topology.tensor: 6 neither divides the model's 8 KV heads (8 / 6 = 1.33) nor is a multiple of them"),
    ("gpus-per-pod-inconsistent", LLAMA_70B, {"topology": {"tensor": 8, "nodes": 1}, "resources": {"gpusPerPod": 4}},
     "topology: tensor 8 × pipeline 1 × data 1 = 8 ranks need 8 GPUs per replica, but resources give gpusPerPod 4 × nodes 1 = 4"),
    ("data-cores-over-nodes-uneven", LLAMA_70B, {"topology": {"tensor": 2, "data": 2, "nodes": 4}, "resources": {"gpusPerPod": None}},
     "topology: data 2 engine cores cannot be spread evenly over nodes 4: each pod of the replica runs whole cores"),
    ("api-servers-with-cores-over-nodes", LLAMA_70B,
     {"topology": {"tensor": 4, "data": 2, "nodes": 2}, "engine": {"apiServerCount": 2}},
     "engine: apiServerCount 2 with engine cores on several nodes (data 2 × nodes 2)"),
    ("ranks-over-nodes-uneven", LLAMA_70B, {"topology": {"tensor": 2, "pipeline": 3, "nodes": 4}, "resources": {"gpusPerPod": None}},
     "topology: tensor 2 × pipeline 3 × data 1 = 6 ranks cannot be spread evenly over nodes 4 (6 / 4 = 1.50 GPUs per pod)"),
    ("multinode-ranks-over-pod-gpus", LLAMA_70B, {"topology": {"tensor": 8, "pipeline": 2, "nodes": 2}},
     "topology: tensor 8 × pipeline 2 × data 1 = 16 ranks need 16 GPUs per replica, but resources give gpusPerPod 4 × nodes 2 = 8"),
    ("multinode-stages-over-declared-layers", LLAMA_70B,
     {"model": {"uri": "pvc://models/acme/small", "architecture": {"numLayers": 2, "numAttentionHeads": 8}},
      "topology": {"tensor": 2, "pipeline": 4}},
     "topology.pipeline: 4 stages for 2 layers leaves stages empty"),
    ("multinode-tp-not-dividing-declared-heads", LLAMA_70B,
     {"model": {"uri": "pvc://models/acme/odd", "architecture": {"numAttentionHeads": 12}}},
     "topology.tensor: 8 does not divide the model's 12 attention heads (12 / 8 = 1.50); use a divisor of 12"),
    ("expert-on-dense-model", LLAMA_8B, {"topology": {"expert": True}},
     "topology.expert: expert parallelism needs a mixture-of-experts model, but hf://meta-llama/Llama-3.1-8B-Instruct is dense (moe: false)"),
    ("expert-on-unknown-model", LLAMA_8B, {"topology": {"expert": True}, "model": {"uri": "hf://acme/custom"}},
     "hf://acme/custom is not a known one; set spec.model.architecture.moe: true if it is"),
    ("70b-does-not-fit-one-gpu", LLAMA_70B, {"topology": {"tensor": 1, "nodes": 1}, "resources": {"gpusPerPod": 1}},
     "memory: the model does not fit: weights 70.6B params × 2 bytes / (tensor × pipeline = 1) = 131.5 GiB per GPU, "
     "+ KV for 16384 tokens 5.0 GiB + 2.0 GiB activations = 138.5 GiB, but a GPU offers 80 GiB × gpuMemoryUtilization 0.9 = 72.0 GiB"),
    ("replicas-and-autoscaling", LLAMA_8B, {"autoscaling": {"maxReplicas": 4}},
     "replicas: set replicas or autoscaling, not both; with autoscaling the scaler sets replicas through the scale subresource"),
    ("min-over-max", LLAMA_8B, {"replicas": None, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
     "autoscaling: minReplicas 5 > maxReplicas 2"),
    ("cpu-tier-pods-over-node-memory", LLAMA_8B,
     {"resources": {"memory": "32Gi", "nodeMemory": "160Gi", "gpusPerNode": 8}, "kvCache": {"tiers": [{"type": "cpu", "size": "64Gi"}]}},
     "resources.nodeMemory: 2 engine pods per node (gpusPerNode 8 / gpusPerPod 1, 2 pods in all) × (engine memory 32 GiB + "
     "cpu KV tier 64 GiB) = 192 GiB, but a node offers nodeMemory 160Gi (160 GiB); shrink the cpu tier to at most 48Gi per pod"),
    ("cpu-tier-autoscaled-pods-over-node-memory", LLAMA_8B,
     {"replicas": None, "autoscaling": {"minReplicas": 1, "maxReplicas": 8},
      "resources": {"nodeMemory": "512Gi", "gpusPerNode": 8}, "kvCache": {"tiers": [{"type": "cpu", "size": "64Gi"}]}},
     "resources.nodeMemory: 8 engine pods per node (gpusPerNode 8 / gpusPerPod 1, 8 pods in all) × (engine memory 16 GiB + "
     "cpu KV tier 64 GiB) = 640 GiB, but a node offers nodeMemory 512Gi (512 GiB); shrink the cpu tier to at most 48Gi per pod"),
    ("cpu-tier-one-pod-over-node-memory", LLAMA_8B,
     {"resources": {"nodeMemory": "64Gi"}, "kvCache": {"tiers": [{"type": "cpu", "size": "64Gi"}]}},
     "resources.nodeMemory: 1 engine pod per node × (engine memory 16 GiB + cpu KV tier 64 GiB) = 80 GiB, but a node offers "
     "nodeMemory 64Gi (64 GiB); shrink the cpu tier to at most 48Gi per pod"),
    ("pod-gpus-over-node-gpus", "mixtral-8x7b-ep.yaml", {"resources": {"gpusPerNode": 2}},
     "resources.gpusPerNode: a pod needs 4 GPUs but a node has 2; spread the replica over more nodes (topology.nodes)"),
    ("disk-tier-claim-shared-by-pods", LLAMA_8B,
     {"kvCache": {"tiers": [{"type": "disk", "size": "10Gi", "volume": {"persistentVolumeClaim": {"claimName": "kv"}}}]}},
     "kvCache.tiers[0] (disk): volume.persistentVolumeClaim is one volume, but up to 2 engine pods would share it"),
    ("disk-tier-claim-and-ephemeral", LLAMA_8B,
     {"replicas": 1, "kvCache": {"tiers": [{"type": "disk", "size": "10Gi",
                                             "volume": {"persistentVolumeClaim": {"claimName": "kv"}, "ephemeral": {}}}]}},
     "kvCache.tiers[0] (disk): volume takes persistentVolumeClaim or ephemeral, not both"),
    ("tiers-without-prefix-caching", LLAMA_8B, {"engine": {"prefixCaching": False}, "kvCache": {"tiers": [{"type": "cpu", "size": "1Gi"}]}},
     "kvCache.tiers: the tiers hold prefix-cache pages, so they need engine.prefixCaching: true"),
    ("cpu-tier-with-a-volume", LLAMA_8B, {"kvCache": {"tiers": [{"type": "cpu", "size": "1Gi", "volume": {"ephemeral": {}}}]}},
     "kvCache.tiers[0] (cpu): volume belongs to a disk tier"),
    ("remote-tier-without-url", LLAMA_8B, {"kvCache": {"tiers": [{"type": "remote"}]}},
     "kvCache.tiers[0] (remote): url is required (redis://host:port)"),
    ("remote-tier-not-redis", LLAMA_8B, {"kvCache": {"tiers": [{"type": "remote", "url": "http://cache:80"}]}},
     "kvCache.tiers[0] (remote): url 'http://cache:80' is not redis://host[:port][/db], rediss://... or "
     "unix:///path: the scheme must be redis://, rediss:// or unix:// (lower case)"),
    ("remote-tier-one-shard-not-redis", LLAMA_8B,
     {"kvCache": {"tiers": [{"type": "remote", "url": "redis://kv-0:6379,kv-1:6379"}]}},
     "kvCache.tiers[0] (remote): url 'kv-1:6379' is not redis://host[:port][/db], rediss://... or "
     "unix:///path: the scheme must be"),
    ("remote-tier-shard-twice", LLAMA_8B,
     {"kvCache": {"tiers": [{"type": "remote", "url": "redis://kv-0:6379,redis://kv-0:6379"}]}},
     "kvCache.tiers[0] (remote): url names a server twice: 'redis://kv-0:6379'"),
    ("disk-tier-without-size", LLAMA_8B, {"kvCache": {"tiers": [{"type": "disk"}]}},
     "kvCache.tiers[0] (disk): size is required"),
    ("tier-twice", LLAMA_8B, {"kvCache": {"tiers": [{"type": "cpu", "size": "1Gi"}, {"type": "cpu", "size": "2Gi"}]}},
     "kvCache.tiers[1] (cpu): a second cpu tier; give each type at most once"),
    ("tier-size-not-a-quantity", LLAMA_8B, {"kvCache": {"tiers": [{"type": "cpu", "size": "lots"}]}},
     "spec.kvCache.tiers[0].size: expected a quantity such as 64Gi or 500m, got 'lots'"),
    ("page-size-not-power-of-two", LLAMA_8B, {"kvCache": {"pageSize": 24}},
     "kvCache.pageSize: 24 is not a power of two"),
    ("unknown-field", LLAMA_8B, {"engine": {"maxNumSeq": 12}},
     "spec.engine.maxNumSeq: unknown field"),
    ("wrong-type", LLAMA_8B, {"topology": {"tensor": "two"}},
     "spec.topology.tensor: expected an integer, got 'two'"),
    ("below-minimum", LLAMA_8B, {"topology": {"tensor": 0}},
     "spec.topology.tensor: must be >= 1, got 0"),
    ("bad-enum", LLAMA_8B, {"router": {"policy": "random"}},
     "spec.router.policy: must be one of prefix-aware, least-load, round-robin; got 'random'"),
    ("bad-uri-scheme", LLAMA_8B, {"model": {"uri": "gs://bucket/llama"}},
     "spec.model.uri: 'gs://bucket/llama' does not match"),
    ("tls-without-host", TINY, {"router": {"ingress": {"tls": {"secretName": "cert"}}}},
     "router.ingress.tls: needs router.ingress.host"),
    ("utilization-over-one", LLAMA_8B, {"engine": {"gpuMemoryUtilization": 1.5}},
     "spec.engine.gpuMemoryUtilization: must be <= 1, got 1.5"),
]


def _merge(spec: dict, changes: dict) -> None:
    for key, value in changes.items():
        if value is None:
            spec.pop(key, None)
        elif isinstance(value, dict) and isinstance(spec.get(key), dict):
            _merge(spec[key], value)
        else:
            spec[key] = value


@pytest.mark.parametrize("case,filename,changes,expected", BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_is_rejected_with_its_arithmetic(case, filename, changes, expected):
    body = load_example(filename)
    _merge(body["spec"], changes)
    problems = problems_of(body)
    assert any(expected in p for p in problems), problems


def test_an_fp8_70b_fits_one_h200_where_bf16_does_not():
    """model.quantization: fp8 counts one byte a weight in the fit check."""
    body = with_spec(load_example(LLAMA_70B), topology={"tensor": 1, "nodes": 1},
                     resources={"gpusPerPod": 1, "gpuMemoryGiB": 141})
    assert [p for p in problems_of(body) if p.startswith("memory:")] == [
        "memory: the model does not fit: weights 70.6B params × 2 bytes / (tensor × pipeline = 1) = 131.5 GiB per GPU, "
        "+ KV for 16384 tokens 5.0 GiB + 2.0 GiB activations = 138.5 GiB, but a GPU offers 141 GiB × "
        "gpuMemoryUtilization 0.9 = 126.9 GiB; raise topology.tensor or topology.pipeline (about 2 shards), or use GPUs "
        "with more memory (resources.gpuMemoryGiB)"]
    fp8 = with_spec(body, model__quantization="fp8")
    assert [p for p in problems_of(fp8) if p.startswith("memory:")] == []
    args = engine_args("llama", check(fp8).spec)
    assert args[args.index("--quantization") + 1] == "fp8" and "--kv-cache-dtype" not in args


def test_fp8_kv_pages_count_one_byte_a_value_and_render_the_flag():
    """engine.kvCacheDtype: fp8 halves the KV bytes of the fit check and reaches the engine as
    --kv-cache-dtype."""
    from pagoda_operator.sizing import memory_plan

    body = load_example(LLAMA_70B)
    fp8 = with_spec(body, engine={**body["spec"].get("engine", {}), "kvCacheDtype": "fp8"})
    plain, quantized = memory_plan(check(body).spec), memory_plan(check(fp8).spec)
    assert quantized.kv_bytes_per_token * 2 == plain.kv_bytes_per_token and quantized.kv_gib * 2 == plain.kv_gib
    assert problems_of(fp8) == []
    args = engine_args("llama", check(fp8).spec)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"


def test_fp8_on_a_moe_model_is_accepted():
    assert problems_of(with_spec(load_example("mixtral-8x7b-ep.yaml"), model__quantization="fp8")) == []


def test_every_problem_is_reported_at_once():
    body = with_spec(load_example(LLAMA_8B), topology={"tensor": 3, "expert": True}, kvCache={"pageSize": 24})
    problems = problems_of(body)
    # heads, KV heads, expert parallelism on a dense model, page size; then what the engine lacks
    lacking = [] if FEATURES["expert-parallel"].implemented else ["topology.expert"]
    assert [p.split(":")[0] for p in problems] == ["topology.tensor", "topology.tensor", "topology.expert", "kvCache.pageSize", *lacking]


def test_bad_names_are_rejected():
    body = load_example(TINY)
    body["metadata"]["name"] = "Tiny_Model"
    assert problems_of(body)[0].startswith("metadata.name: 'Tiny_Model' must be a lower-case DNS label that starts with a letter")
    body["metadata"]["name"] = "x" * 57
    assert "at most 56 characters" in problems_of(body)[0]


def test_replicas_written_through_the_scale_subresource_do_not_conflict_with_autoscaling():
    body = with_spec(load_example(LLAMA_8B), replicas=3, autoscaling={"minReplicas": 1, "maxReplicas": 4})
    owned_replicas = {"f:spec": {"f:replicas": {}}}
    body["metadata"]["managedFields"] = [
        {"manager": "kubectl-client-side-apply", "operation": "Update", "fieldsV1": {"f:spec": {"f:model": {}}}},
        {"manager": "kube-controller-manager", "operation": "Update", "subresource": "scale", "fieldsV1": owned_replicas},
    ]
    assert problems_of(body) == []
    body["metadata"]["managedFields"].append({"manager": "kubectl", "operation": "Apply", "fieldsV1": owned_replicas})
    assert problems_of(body) == ["replicas: set replicas or autoscaling, not both (set by kubectl); with autoscaling the scaler sets replicas through the scale subresource"]
    # Even the scaler cannot put replicas outside the bounds.
    body["metadata"]["managedFields"].pop()
    body["spec"]["replicas"] = 9
    assert problems_of(body) == ["replicas: 9 is outside autoscaling's [1, 4]"]


@pytest.mark.parametrize("spec", [None, [], "text", 3, {"model": 5}, {"model": {"uri": 7}}, {"topology": None},
                                  {"kvCache": {"tiers": ["cpu"]}}, {"kvCache": {"tiers": [{"type": "cpu", "size": True}]}},
                                  {"resources": {"tolerations": "all"}}, {"autoscaling": {}}, {"replicas": -1},
                                  {"engine": {"extraArgs": [1, 2]}}, {"resources": {"nodeSelector": {"a": 1}}}])
def test_junk_specs_give_problems_never_exceptions(spec):
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "junk"}, "spec": spec}
    problems = problems_of(body)
    if spec is not None:  # an absent spec means every default: the built-in tiny model on one GPU
        assert problems
    assert all(isinstance(p, str) and p for p in problems)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 100) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)
spec_keys = st.sampled_from(["model", "engine", "resources", "topology", "kvCache", "replicas", "autoscaling", "router", "monitoring"])


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(spec_keys, json_values, max_size=4))
def test_any_json_spec_gives_problems_or_a_parsed_spec_never_an_exception(spec):
    checked = check({"metadata": {"name": "fuzz"}, "spec": spec})
    assert checked.ok == (checked.problems == [])
    assert all(isinstance(p, str) for p in checked.problems)


def _paths(obj, prefix=()):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield prefix + (i,)
            yield from _paths(value, prefix + (i,))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLE_FILES), st.data())
def test_any_field_of_an_example_set_to_anything_is_rejected_or_renders(filename, data):
    body = load_example(filename)
    path = data.draw(st.sampled_from(list(_paths(body["spec"]))))
    target = body["spec"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = data.draw(json_values)
    checked = check(body)
    assert checked.ok == (checked.problems == [])
    if checked.renderable:  # whatever passes validation (engine features aside) renders
        assert render(body, checked.spec)


def _validated_condition(body: dict) -> dict:
    checked = check(body)
    status = compute_status(None, Observation(generation=1, validated=checked.ok, problems=checked.problems),
                            "2026-01-01T00:00:00Z")
    (validated,) = [c for c in status["conditions"] if c["type"] == "Validated"]
    return validated


def test_a_gpu_service_without_a_model_is_refused_unless_the_tiny_model_is_asked_for():
    gpu = load_example("llama-3.1-8b.yaml")
    without_model = with_spec(gpu, model__uri=None, model__download=None, model__architecture=None)
    validated = _validated_condition(without_model)
    assert validated["status"] == "False" and validated["reason"] == "InvalidSpec"
    assert "model.uri: required on GPU" in validated["message"] and "builtinTiny" in validated["message"]
    assert _validated_condition(with_spec(without_model, model__builtinTiny=True))["status"] == "True"


def test_the_tiny_model_needs_an_opt_in_on_cpu_too_and_a_uri_excludes_it():
    tiny = load_example("tiny-cpu.yaml")
    assert check(tiny).ok
    assert any(p.startswith("model.uri: required (") for p in problems_of(with_spec(tiny, model__builtinTiny=None)))
    both = with_spec(load_example("llama-3.1-8b.yaml"), model__builtinTiny=True)
    assert "model: give model.uri or model.builtinTiny: true, not both" in problems_of(both)


def test_api_server_count_needs_as_many_cpus_and_one_way_of_setting_it():
    base = load_example("llama-3.1-8b.yaml")
    assert problems_of(with_spec(base, engine__apiServerCount=4, resources={"cpu": "4"})) == []
    assert problems_of(with_spec(base, engine__apiServerCount=4)) == []  # no CPU request: nothing to compare
    few = problems_of(with_spec(base, engine__apiServerCount=4, resources={"cpu": "3500m"}))
    assert few == ["engine: apiServerCount 4 needs at least 4 CPUs per pod, but resources.cpu is 3500m"]
    both = problems_of(with_spec(base, engine__apiServerCount=2, engine__extraArgs=["--api-server-count", "2"]))
    assert both == ["engine: apiServerCount and extraArgs --api-server-count both set the API server processes; keep one"]
    assert any("apiServerCount" in p for p in problems_of(with_spec(base, engine__apiServerCount=0)))


def test_a_shared_compile_cache_is_for_gpu_engines_and_the_only_place_of_tritons_cache():
    shared = {"persistentVolumeClaim": {"claimName": "kernels"}}
    gpu = load_example("llama-3.1-8b.yaml")
    assert problems_of(with_spec(gpu, engine__compileCache=shared)) == []
    assert problems_of(with_spec(gpu, engine__compileCache={})) == []  # the default: an emptyDir per pod
    cpu = problems_of(with_spec(load_example("tiny-cpu.yaml"), engine__compileCache=shared))
    assert cpu == ["engine.compileCache: CPU engines compile no GPU kernels; remove it or give the pods GPUs"]
    own = problems_of(with_spec(gpu, engine__compileCache=shared,
                                engine__env=[{"name": "TRITON_CACHE_DIR", "value": "/data/triton"}]))
    assert own == ["engine: compileCache.persistentVolumeClaim and env TRITON_CACHE_DIR both place Triton's cache; keep one"]
    bad_name = problems_of(with_spec(gpu, engine__compileCache={"persistentVolumeClaim": {"claimName": "Not_A_Name"}}))
    assert any("claimName" in p for p in bad_name), bad_name
    assert any("claimName" in p for p in problems_of(with_spec(gpu, engine__compileCache={"persistentVolumeClaim": {}})))


@pytest.mark.parametrize("extra_args, expected", [
    (["--api-server-count", "1"], []),
    (["--api-server-count=1"], []),
    (["-asc", "1", "--max-num-seqs", "8"], []),
    (["--api-server-count=4", "--api-server-count", "1"], []),  # the engine's parser keeps the last
    (["--api-server-count", "2"], ["engine: extraArgs --api-server-count 2 would reach the headless worker pods too, "
                                   "which run no API server and refuse a count above 1; set apiServerCount instead "
                                   "(the leader's alone)"]),
    (["--api-server-count=4"], ["engine: extraArgs --api-server-count 4 would reach the headless worker pods too, "
                                "which run no API server and refuse a count above 1; set apiServerCount instead "
                                "(the leader's alone)"]),
    (["--api-server-count=two"], ["engine.extraArgs: argument --api-server-count/-asc: invalid int value: 'two'"]),
    (["--api-server-count", "1.5"], ["engine.extraArgs: argument --api-server-count/-asc: invalid int value: '1.5'"]),
    (["--max-num-seqs", "8", "-asc"], ["engine.extraArgs: argument --api-server-count/-asc: expected one argument"]),
    (["--api-server-count=0"], ["engine.extraArgs: --api-server-count 0: must be >= 1"]),
    # The engine's parser takes any spelling: the short flag and an unambiguous abbreviation reach the workers too.
    (["-asc", "2"], ["engine: extraArgs --api-server-count 2 would reach the headless worker pods too, which run no "
                     "API server and refuse a count above 1; set apiServerCount instead (the leader's alone)"]),
    (["--api-server=3"], ["engine: extraArgs --api-server-count 3 would reach the headless worker pods too, which run "
                          "no API server and refuse a count above 1; set apiServerCount instead (the leader's alone)"]),
])
def test_extra_args_api_server_count_on_several_nodes_is_refused_only_above_one(extra_args, expected):
    body = with_spec(load_example("llama-3.1-70b-multinode.yaml"), engine__extraArgs=extra_args)
    assert [p for p in problems_of(body) if p.startswith(("engine:", "engine.extraArgs:"))] == expected


def test_extra_args_api_server_count_on_one_node_is_checked_but_may_be_above_one():
    base = load_example("llama-3.1-8b.yaml")
    assert problems_of(with_spec(base, engine__extraArgs=["--api-server-count=4"])) == []
    assert problems_of(with_spec(base, engine__extraArgs=["--api-server-count", "x"])) == [
        "engine.extraArgs: argument --api-server-count/-asc: invalid int value: 'x'"]


def test_speculative_decoding_renders_the_engines_flag_and_is_checked_as_the_engine_checks_it():
    from pagoda_operator.render import engine_args
    from pagoda_operator.spec import parse_spec

    speculative = {"method": "ngram", "numSpeculativeTokens": 4, "promptLookupMax": 3, "disableByBatchSize": 8}
    body = with_spec(load_example(LLAMA_8B), engine__speculative=speculative)
    assert problems_of(body) == []
    args = engine_args("llama", parse_spec(body["spec"]))
    assert json.loads(args[args.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 8}
    assert problems_of(with_spec(body, engine__speculative__promptLookupMin=5)) == [
        "engine.speculative: speculative config: prompt_lookup_min (5) must be <= prompt_lookup_max (3)"]
    assert problems_of(with_spec(body, topology={"pipeline": 2}, resources__gpusPerPod=2)) == []
    assert problems_of(with_spec(body, engine__speculative={"method": "eagle3", "model": "pvc://heads/l8",
                                                            "numSpeculativeTokens": 2},
                                 topology={"pipeline": 2}, resources__gpusPerPod=2)) == [
        "engine.speculative: method 'eagle3' is not supported under pipeline parallelism yet (topology.pipeline 2)"]
    moe = with_spec(load_example("mixtral-8x7b-ep.yaml"), engine__speculative=speculative)
    assert problems_of(moe) == []  # experts across data-parallel cores
    assert problems_of(with_spec(moe, engine__speculative={"method": "eagle3", "model": "pvc://heads/q3",
                                                           "numSpeculativeTokens": 2})) == []
    both = with_spec(body, engine__extraArgs=["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert problems_of(both) == ["engine: speculative and extraArgs --speculative-config both set speculative decoding; "
                                 "keep one"]
    eagle = with_spec(load_example(LLAMA_8B), engine__extraArgs=[
        "--speculative-config", '{"method": "eagle", "model": "x", "num_speculative_tokens": 2}'])
    assert problems_of(eagle) == [
        "engine.extraArgs --speculative-config: speculative config: method 'eagle' (EAGLE-1/2 heads) is not implemented "
        "in this engine yet; implemented: ngram, draft_model, eagle3"]
    eagle3 = ["--speculative-config", '{"method": "eagle3", "model": "/models/head", "num_speculative_tokens": 2}']
    assert problems_of(with_spec(load_example(LLAMA_8B), engine__extraArgs=eagle3)) == []
    assert problems_of(with_spec(load_example(LLAMA_8B), engine__extraArgs=eagle3, topology={"tensor": 2},
                                 resources__gpusPerPod=2)) == []


def test_a_drafting_model_is_checked_and_counted_in_the_memory_arithmetic():
    base = load_example(LLAMA_8B)
    draft = {"method": "draft_model", "model": "hf://meta-llama/Llama-3.2-1B-Instruct", "numSpeculativeTokens": 4}
    assert problems_of(with_spec(base, engine__speculative=draft)) == []
    assert problems_of(with_spec(base, engine__speculative={"method": "draft_model", "numSpeculativeTokens": 4})) == [
        "engine.speculative: speculative config: method 'draft_model' needs \"model\": the drafting model's directory"]
    assert problems_of(with_spec(base, engine__speculative={**draft, "method": "ngram"})) == [
        "engine.speculative: speculative config: model does not apply to method 'ngram' (its keys: "
        "disable_by_batch_size, method, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)"]
    # Under tensor parallelism the whole draft sits beside the target's first shard, as counted below.
    assert problems_of(with_spec(base, engine__speculative=draft, topology={"tensor": 2}, resources__gpusPerPod=2)) == []
    # 15.0 GiB of weights + 4.0 GiB of KV + 2.0 GiB fit 24 GiB × 0.9; with the draft's 3.3 GiB they do not.
    small = with_spec(base, resources__gpuMemoryGiB=24)
    assert problems_of(small) == []
    (problem,) = problems_of(with_spec(small, engine__speculative=draft))
    assert "the drafting model's 1.24B params and KV 3.3 GiB" in problem and "= 24.3 GiB" in problem


def test_a_drain_timeout_longer_than_the_grace_period_allows_is_refused():
    base = load_example("llama-3.1-8b.yaml")
    assert problems_of(with_spec(base, engine__extraArgs=["--drain-timeout", "45"])) == []
    assert problems_of(with_spec(base, engine__extraArgs=["--drain-timeout", "46"])) == [
        "engine.extraArgs: --drain-timeout 46 does not fit in terminationGracePeriodSeconds 60 (a 10 s preStop sleep, "
        "then at most 45 s of drain, then 5 s to exit); raise engine.terminationGracePeriodSeconds or lower the "
        "drain timeout"]
    longer = with_spec(base, engine__extraArgs=["--drain-timeout", "100"], engine__terminationGracePeriodSeconds=120)
    assert problems_of(longer) == []


def test_an_in_place_rollout_needs_a_second_replica_to_serve_meanwhile():
    base = load_example("llama-3.1-8b.yaml")
    assert base["spec"]["replicas"] == 2
    assert problems_of(with_spec(base, engine__rollout="in-place")) == []
    assert problems_of(with_spec(base, engine__rollout="surge", replicas=1)) == []
    assert problems_of(with_spec(base, engine__rollout="in-place", replicas=0)) == []  # nothing to replace
    assert problems_of(with_spec(base, engine__rollout="in-place", replicas=1)) == [
        "engine.rollout: in-place replaces a replica before its successor is ready, and with replicas 1 no replica "
        "would serve meanwhile; use surge (the default) or 2 replicas or more"]
    scaled = load_example("llama-3.1-8b-tiers-autoscaling.yaml")
    assert scaled["spec"]["autoscaling"]["minReplicas"] == 1
    (problem,) = problems_of(with_spec(scaled, engine__rollout="in-place"))
    assert problem.startswith("engine.rollout: in-place") and "autoscaling.minReplicas 1" in problem
    assert problems_of(with_spec(scaled, engine__rollout="in-place", autoscaling__minReplicas=2)) == []
    (problem,) = problems_of(with_spec(base, engine__rollout="sideways"))
    assert "engine.rollout" in problem


def test_the_all2all_backend_needs_experts_across_data_parallel_cores():
    """`--all2all-backend alltoallv` in extraArgs: taken where experts span the cores, refused
    (as the engine refuses it at start-up) where there are none to reach."""
    ep = load_example("mixtral-8x7b-ep.yaml")
    assert (ep["spec"]["topology"]["data"], ep["spec"]["topology"]["expert"]) == (2, True)
    assert problems_of(with_spec(ep, engine__extraArgs=["--all2all-backend", "alltoallv"])) == []
    within = with_spec(ep, topology={"tensor": 2, "data": 1, "expert": True},
                       engine__extraArgs=["--all2all-backend", "alltoallv"])
    assert problems_of(within) == ["engine.extraArgs --all2all-backend alltoallv: needs experts across data-parallel "
                                   "engine cores (topology.expert with topology.data above 1)"]
    assert problems_of(with_spec(ep, engine__extraArgs=["--all2all-backend", "deepep_low_latency"])) != []
    assert problems_of(with_spec(ep, engine__extraArgs=["--all2all-backend", "alltoallv", "--enable-dbo"])) == []
    assert problems_of(with_spec(ep, engine__extraArgs=["--enable-dbo"])) == [
        "engine.extraArgs --enable-dbo: needs --all2all-backend alltoallv with experts across data-parallel engine "
        "cores (topology.expert with topology.data above 1)"]
    # EPLB balances over one rank per core: the example's two tensor-parallel ranks per core are refused.
    assert problems_of(with_spec(ep, engine__extraArgs=["--enable-eplb"])) == [
        "engine.extraArgs --enable-eplb: needs experts across data-parallel engine cores (topology.expert with "
        "topology.data above 1) and topology.tensor 1"]

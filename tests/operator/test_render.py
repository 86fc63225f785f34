"""The renderer: every example becomes valid Kubernetes objects with exactly the fields the
engine, router and cluster need (no cluster involved)."""

from __future__ import annotations

import json
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from pagoda_operator import render as r
from pagoda_operator.validation import check
from tests.operator import crd_schema
from tests.operator.support import EXAMPLE_FILES, EXAMPLES_DIR, load_example, with_spec

K8S_VERSION = "1.33.0"
OWNER = [{
    "apiVersion": "pagoda.dev/v1alpha1",
    "kind": "InferenceService",
    "name": None,  # filled per example
    "uid": "0000-uid",
    "controller": True,
    "blockOwnerDeletion": True,
}]


def rendered(body: dict) -> dict[tuple[str, str], dict]:
    """The children of a spec that is right as written. It may ask for engine features not
    implemented yet (the operator refuses those, test_validation): they render all the same, so
    the examples that document them are checked here too."""
    checked = check(body)
    assert checked.renderable, checked.problems
    manifests = r.render(body, checked.spec)
    by_key = {(m["kind"], m["metadata"]["name"]): m for m in manifests}
    assert len(by_key) == len(manifests), "two children with one kind and name"
    return by_key


def engine_container(pod_template: dict) -> dict:
    (container,) = pod_template["spec"]["containers"]
    assert container["name"] == "engine"
    return container


def _validate(manifest: dict) -> None:
    kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_every_manifest_is_valid_kubernetes(filename):
    for manifest in rendered(load_example(filename)).values():
        if manifest["kind"] == "LeaderWorkerSet":
            # Not a built-in kind: its pod templates are validated as core PodTemplates.
            lwt = manifest["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"x-{role.lower()}"}, "template": lwt[role]})
        elif manifest["kind"] == "ServiceMonitor":
            assert set(manifest["spec"]) == {"selector", "endpoints"}
        elif manifest["kind"] in ("InferencePool", "HTTPRoute"):
            pass  # validated against their real CRDs in test_gateway_mode.py
        else:
            _validate(manifest)


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_every_child_has_labels_owner_and_namespace(filename):
    body = load_example(filename)
    name = body["metadata"]["name"]
    for (kind, child_name), m in rendered(body).items():
        meta = m["metadata"]
        assert meta["namespace"] == "default"
        assert meta["ownerReferences"] == [{**OWNER[0], "name": name}]
        assert meta["labels"]["app.kubernetes.io/name"] == "pagoda"
        assert meta["labels"]["app.kubernetes.io/instance"] == name
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator"
        assert meta["labels"]["app.kubernetes.io/component"] in ("engine", "router", "monitoring", "endpoint-picker")
        assert child_name in (name, f"{name}-engine", f"{name}-router", f"{name}-epp", f"{name}-prefill", f"{name}-decode")
        assert (m["apiVersion"], kind) in r.CHILD_KINDS


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_rendering_is_deterministic(filename):
    assert rendered(load_example(filename)) == rendered(load_example(filename))


def test_tiny_cpu_example():
    body = load_example("tiny-cpu.yaml")
    out = rendered(body)
    assert sorted(out) == [
        ("ConfigMap", "tiny-engine"), ("Deployment", "tiny"), ("Deployment", "tiny-engine"),
        ("NetworkPolicy", "tiny"), ("NetworkPolicy", "tiny-engine"),
        ("PodDisruptionBudget", "tiny-engine"), ("Role", "tiny-router"), ("RoleBinding", "tiny-router"),
        ("Service", "tiny"), ("Service", "tiny-engine"), ("ServiceAccount", "tiny-router"),
    ]
    deploy = out[("Deployment", "tiny-engine")]
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["selector"] == {"matchLabels": {
        "app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": "tiny", "app.kubernetes.io/component": "engine"}}
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = deploy["spec"]["template"]
    c = engine_container(pod)
    assert c["image"] == "pagoda/engine-cpu:dev"
    assert c["command"] == ["pagoda", "serve"]
    assert c["args"] == [
        "--host", "0.0.0.0", "--port", "8000", "--model", "pagoda-tiny", "--served-model-name", "tiny",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--block-size", "16",
        "--enable-prefix-caching", "--drain-timeout", "45", "--device", "cpu",
    ]
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "2Gi"}}
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    # The router's key to the engines, and the caches on the cache volume (the root filesystem is read-only).
    assert c["env"] == [
        {"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "tiny-internal-key", "key": "api-key"}}},
        {"name": "XDG_CACHE_HOME", "value": "/var/cache/pagoda"},
        {"name": "PAGODA_CACHE_DIR", "value": "/var/cache/pagoda/pagoda"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/var/cache/pagoda/torchinductor"},
    ]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                                              "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "10"]}}}
    # The tiny model: the 10-minute floor of the startup budget.
    assert c["startupProbe"] == {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 60, "timeoutSeconds": 5}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert pod["spec"]["volumes"] == [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
        {"name": "config", "configMap": {"name": "tiny-engine"}},
        {"name": "cache", "emptyDir": {"sizeLimit": "4Gi"}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    assert c["volumeMounts"] == [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "config", "mountPath": "/etc/pagoda", "readOnly": True},
        {"name": "cache", "mountPath": "/var/cache/pagoda"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    assert "initContainers" not in pod["spec"] and "tolerations" not in pod["spec"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 60
    assert pod["metadata"]["annotations"][r.CONFIG_HASH_ANNOTATION] == r.config_hash(out[("ConfigMap", "tiny-engine")]["data"])

    svc = out[("Service", "tiny-engine")]["spec"]
    assert svc["clusterIP"] == "None" and "publishNotReadyAddresses" not in svc
    router = out[("Deployment", "tiny")]["spec"]["template"]["spec"]
    (rc,) = router["containers"]
    assert rc["command"] == ["pagoda", "route"]
    assert rc["args"] == ["--k8s-service", "default/tiny-engine", "--policy", "round-robin", "--port", "8000"]
    assert rc["env"] == [{"name": "PAGODA_BACKEND_API_KEY", "valueFrom": {"secretKeyRef": {"name": "tiny-internal-key", "key": "api-key"}}}]
    assert rc["securityContext"] == c["securityContext"] and router["securityContext"] == pod["spec"]["securityContext"]
    assert router["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    assert rc["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert router["serviceAccountName"] == "tiny-router"
    assert out[("Service", "tiny")]["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert out[("PodDisruptionBudget", "tiny-engine")]["spec"]["maxUnavailable"] == 1


def test_router_rbac_is_its_own_account_with_read_only_endpointslices():
    """Per InferenceService, in its namespace: the router's ServiceAccount, a Role that reads
    EndpointSlices (nothing else) and the binding between them; all validated, all owned."""
    body = load_example("llama-3.1-8b.yaml", namespace="team-a", uid="1234-uid")
    name = body["metadata"]["name"]
    manifests = r.render(body, check(body).spec)
    rbac = [m for m in manifests if m["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    meta = {
        "name": "llama-8b-router",
        "namespace": "team-a",
        "labels": {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": name,
                   "app.kubernetes.io/component": "router", "app.kubernetes.io/managed-by": "pagoda-operator"},
        "ownerReferences": [{**OWNER[0], "name": name, "uid": "1234-uid"}],
    }
    assert name == "llama-8b"
    assert rbac == [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llama-8b-router"},
         "subjects": [{"kind": "ServiceAccount", "name": "llama-8b-router", "namespace": "team-a"}]},
    ]
    for m in rbac:
        _validate(m)
    # Applied before the router Deployment, whose pods the API server refuses without the account.
    order = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert max(order.index((k, "llama-8b-router")) for k in ("ServiceAccount", "Role", "RoleBinding")) < order.index(("Deployment", name))
    (router,) = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == name]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "llama-8b-router"
    # Only the engine pods opt out of the token; the router needs it to read EndpointSlices.
    assert "automountServiceAccountToken" not in router["spec"]["template"]["spec"]


def test_a_draft_model_is_downloaded_beside_the_model_and_named_in_the_speculative_flag():
    body = with_spec(load_example("llama-3.1-8b.yaml"), engine__speculative={
        "method": "draft_model", "model": "hf://meta-llama/Llama-3.2-1B-Instruct@abc", "numSpeculativeTokens": 4})
    deploy = rendered(body)[("Deployment", "llama-8b-engine")]
    pod = deploy["spec"]["template"]["spec"]
    c = engine_container(deploy["spec"]["template"])
    flag = json.loads(c["args"][c["args"].index("--speculative-config") + 1])
    assert flag == {"method": "draft_model", "model": "/drafts/meta-llama/Llama-3.2-1B-Instruct",
                    "num_speculative_tokens": 4}
    model, draft = pod["initContainers"]
    assert (model["name"], draft["name"]) == ("model-download", "draft-download")
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in draft["env"]}
    assert (env["MODEL_REPO"], env["MODEL_REVISION"], env["MODEL_DIR"]) == (
        "meta-llama/Llama-3.2-1B-Instruct", "abc", "/drafts/meta-llama/Llama-3.2-1B-Instruct")
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}  # model.download's
    assert draft["volumeMounts"][0] == {"name": "draft-cache", "mountPath": "/drafts"}
    assert {"name": "draft-cache", "emptyDir": {}} in pod["volumes"]
    assert {"name": "draft-cache", "mountPath": "/drafts", "readOnly": True} in c["volumeMounts"]
    _validate({"apiVersion": "apps/v1", **deploy})

    on_claim = with_spec(body, engine__speculative__model="pvc://heads/eagle3-llama-8b", engine__speculative__method="eagle3")
    deploy = rendered(on_claim)[("Deployment", "llama-8b-engine")]
    c = engine_container(deploy["spec"]["template"])
    assert json.loads(c["args"][c["args"].index("--speculative-config") + 1])["model"] == "/drafts/eagle3-llama-8b"
    assert [i["name"] for i in deploy["spec"]["template"]["spec"]["initContainers"]] == ["model-download"]
    assert {"name": "draft", "persistentVolumeClaim": {"claimName": "heads", "readOnly": True}} in (
        deploy["spec"]["template"]["spec"]["volumes"])


def test_llama_8b_example_downloads_from_hugging_face_onto_one_gpu():
    out = rendered(load_example("llama-3.1-8b.yaml"))
    deploy = out[("Deployment", "llama-8b-engine")]
    assert deploy["spec"]["replicas"] == 2
    # A surge: both replicas serve until each successor is ready (the load's TTFT holds).
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    in_place = rendered(with_spec(load_example("llama-3.1-8b.yaml"), engine__rollout="in-place"))
    assert in_place[("Deployment", "llama-8b-engine")]["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0, "maxUnavailable": 1}
    pod = deploy["spec"]["template"]["spec"]
    c = engine_container(deploy["spec"]["template"])
    assert c["image"] == "pagoda/engine:dev"
    assert c["args"] == [
        "--host", "0.0.0.0", "--port", "8000",
        "--model", "/models/meta-llama/Llama-3.1-8B-Instruct",
        "--served-model-name", "llama-3.1-8b-instruct", "--dtype", "bfloat16", "--max-model-len", "32768",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
        "--gpu-memory-utilization", "0.9", "--block-size", "16", "--enable-prefix-caching", "--drain-timeout", "45",
    ]
    assert c["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"},
    }
    assert c["startupProbe"]["failureThreshold"] == 80  # 600 s + 25 s × 8.03B params = 800 s
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    (init,) = pod["initContainers"]
    assert init["name"] == "model-download" and init["image"] == c["image"]
    assert init["command"][:2] == ["sh", "-c"] and "hf download" in init["command"][2] and "timeout" in init["command"][2]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in init["env"]}
    assert env == {
        "MODEL_REPO": "meta-llama/Llama-3.1-8B-Instruct",
        "MODEL_REVISION": "main",
        "MODEL_DIR": "/models/meta-llama/Llama-3.1-8B-Instruct",
        "DOWNLOAD_TIMEOUT_SECONDS": "3600",
        "DOWNLOAD_RETRIES": "3",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": "/tmp/huggingface",
        "HF_TOKEN": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    assert init["volumeMounts"] == [{"name": "model-cache", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
    assert init["securityContext"] == c["securityContext"]
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
    sm = out[("ServiceMonitor", "llama-8b")]
    assert sm["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": "llama-8b"}},
        "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
    }
    assert out[("Deployment", "llama-8b")]["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "--k8s-service", "default/llama-8b-engine", "--policy", "prefix-aware", "--port", "8000"]


def test_llama_70b_example_is_a_leader_worker_set_across_two_nodes():
    out = rendered(load_example("llama-3.1-70b-multinode.yaml"))
    assert ("Deployment", "llama-70b-engine") not in out
    lws = out[("LeaderWorkerSet", "llama-70b-engine")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert spec["replicas"] == 1
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["size"] == 2 and lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = engine_container(lwt["leaderTemplate"]), engine_container(lwt["workerTemplate"])
    # The same command on both, with vLLM's multi-node flags from the LWS environment; the worker headless.
    # (--drain-timeout only on the leader: the worker serves no HTTP, nothing to drain.)
    drain = leader["args"].index("--drain-timeout")
    assert leader["args"][:drain] + leader["args"][drain + 2:] + ["--headless"] == worker["args"]
    assert leader["args"][-8:] == ["--nnodes", "$(LWS_GROUP_SIZE)", "--node-rank", "$(LWS_WORKER_INDEX)",
                                   "--master-addr", "$(LWS_LEADER_ADDRESS)", "--master-port", "29501"]
    assert leader["args"][leader["args"].index("--tensor-parallel-size") + 1] == "8"
    assert leader["args"][leader["args"].index("--model") + 1] == "/models/meta-llama/Llama-3.1-70B-Instruct"
    for c in (leader, worker):
        assert c["resources"]["requests"]["nvidia.com/gpu"] == "4"  # TP 8 / 2 nodes
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert c["env"] == [
            {"name": "LWS_GROUP_INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"}}},
            {"name": "LWS_WORKER_INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"}}},
            {"name": "LWS_GROUP_SIZE", "value": "2"},
            {"name": "LWS_LEADER_ADDRESS", "value": "llama-70b-engine-$(LWS_GROUP_INDEX).llama-70b-engine.default"},
            {"name": "PAGODA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "llama-70b-internal-key", "key": "api-key"}}},
            {"name": "XDG_CACHE_HOME", "value": "/var/cache/pagoda"},
            {"name": "PAGODA_CACHE_DIR", "value": "/var/cache/pagoda/pagoda"},
            {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/var/cache/pagoda/torchinductor"},
            {"name": "TRITON_CACHE_DIR", "value": "/var/cache/pagoda/triton"},
            {"name": "FLASHINFER_WORKSPACE_BASE", "value": "/var/cache/pagoda/flashinfer"},
            {"name": "CUDA_CACHE_PATH", "value": "/var/cache/pagoda/nv"},
        ]
    # A 70B model gets at least 30 minutes to start; workers serve no HTTP and have no probes.
    probe = leader["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 30 * 60
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    pod = lwt["leaderTemplate"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "initContainers" not in pod
    svc = out[("Service", "llama-70b-engine")]["spec"]
    assert svc["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert svc["publishNotReadyAddresses"] is True
    # Exposed through the Ingress, it asks clients for keys from the Secret the example names.
    router = out[("Deployment", "llama-70b")]["spec"]["template"]["spec"]
    assert router["containers"][0]["args"][-2:] == ["--api-key-file", "/etc/pagoda/api-keys"]
    assert {"name": "api-keys", "secret": {"secretName": "llama-70b-client-keys"}} in router["volumes"]
    ingress = out[("Ingress", "llama-70b")]
    assert ingress["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/proxy-read-timeout": "600"}
    assert ingress["spec"] == {
        "ingressClassName": "nginx",
        "rules": [{"host": "llama-70b.example.com", "http": {"paths": [{
            "path": "/", "pathType": "Prefix", "backend": {"service": {"name": "llama-70b", "port": {"name": "http"}}}}]}}],
        "tls": [{"hosts": ["llama-70b.example.com"], "secretName": "llama-70b-tls"}],
    }


def test_mixtral_example_enables_expert_parallelism():
    out = rendered(load_example("mixtral-8x7b-ep.yaml"))
    c = engine_container(out[("Deployment", "mixtral-engine")]["spec"]["template"])
    args = c["args"]
    assert args[args.index("--tensor-parallel-size"):args.index("--block-size")] == [
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "1", "--data-parallel-size", "2", "--enable-expert-parallel"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "4"  # tensor 2 × data 2


def test_tiers_and_autoscaling_example():
    out = rendered(load_example("llama-3.1-8b-tiers-autoscaling.yaml"))
    deploy = out[("Deployment", "llama-8b-tiered-engine")]
    assert deploy["spec"]["replicas"] == 1  # minReplicas until the autoscaler sets spec.replicas
    c = engine_container(deploy["spec"]["template"])
    args = c["args"]
    assert args[args.index("--kv-offload-cpu-gb"):] == [
        "--kv-offload-cpu-gb", "64",
        "--kv-offload-disk-path", "/var/lib/pagoda/kv", "--kv-offload-disk-gb", "200",
        "--kv-offload-remote-url", "redis://kv-redis.default.svc:6379",
    ]
    # The Redis password from its Secret, never in the pod spec.
    assert c["env"][0] == {"name": "PAGODA_KV_REMOTE_PASSWORD", "valueFrom": {"secretKeyRef": {"name": "kv-redis", "key": "password"}}}
    assert [e["name"] for e in c["env"]] == ["PAGODA_KV_REMOTE_PASSWORD", "PAGODA_API_KEY", "XDG_CACHE_HOME", "PAGODA_CACHE_DIR",
                                             "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "CUDA_CACHE_PATH"]
    # The engine's own 32Gi plus the 64Gi cpu tier, as request and limit.
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "96Gi"
    pod = deploy["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}}
    # A claim per pod from the StorageClass, with headroom over the 200Gi tier (5 %), mounted
    # where --kv-offload-disk-path points.
    assert volumes["kv-disk"] == {"name": "kv-disk", "ephemeral": {"volumeClaimTemplate": {"spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "210Gi"}}, "storageClassName": "local-nvme"}}}}
    assert {"name": "kv-disk", "mountPath": args[args.index("--kv-offload-disk-path") + 1]} in c["volumeMounts"]


def _tiered(tiers: list[dict], **changes) -> dict:
    return with_spec(load_example("llama-3.1-8b.yaml"), kvCache={"tiers": tiers}, **changes)


def _engine_pod(body: dict) -> dict:
    return rendered(body)[("Deployment", f"{body['metadata']['name']}-engine")]["spec"]["template"]


def test_a_cpu_tier_is_added_to_the_pods_memory_request_and_limit():
    default = engine_container(_engine_pod(_tiered([{"type": "cpu", "size": "32Gi"}])))
    assert default["resources"]["requests"]["memory"] == default["resources"]["limits"]["memory"] == "48Gi"  # 16Gi per GPU + 32Gi
    given = engine_container(_engine_pod(_tiered([{"type": "cpu", "size": "1536Mi"}], resources={"memory": "20Gi"})))
    assert given["resources"]["requests"]["memory"] == given["resources"]["limits"]["memory"] == "22016Mi"  # 20Gi + 1.5Gi
    assert given["args"][given["args"].index("--kv-offload-cpu-gb") + 1] == "1.5"
    untiered = engine_container(_engine_pod(with_spec(load_example("llama-3.1-8b.yaml"), resources={"memory": "20000Mi"})))
    assert untiered["resources"]["limits"]["memory"] == "20000Mi"  # as given, without a tier


def test_a_disk_tier_is_an_emptydir_by_default_or_the_claim_the_spec_names():
    default = _engine_pod(_tiered([{"type": "disk", "size": "100Gi"}]))
    args = engine_container(default)["args"]
    assert args[args.index("--kv-offload-disk-path"):args.index("--kv-offload-disk-path") + 4] == [
        "--kv-offload-disk-path", "/var/lib/pagoda/kv", "--kv-offload-disk-gb", "100"]
    assert {"name": "kv-disk", "emptyDir": {"sizeLimit": "105Gi"}} in default["spec"]["volumes"]
    assert {"name": "kv-disk", "emptyDir": {"sizeLimit": "3Gi"}} in _engine_pod(_tiered([{"type": "disk", "size": "2Gi"}]))["spec"]["volumes"]  # at least 1Gi more
    claim = _engine_pod(_tiered([{"type": "disk", "size": "100Gi", "volume": {"persistentVolumeClaim": {"claimName": "kv-files"}}}],
                                replicas=1))  # one pod: a claim is one volume
    assert {"name": "kv-disk", "persistentVolumeClaim": {"claimName": "kv-files"}} in claim["spec"]["volumes"]
    ephemeral = _engine_pod(_tiered([{"type": "disk", "size": "100Gi", "volume": {"ephemeral": {"accessModes": ["ReadWriteOncePod"]}}}]))
    assert {"name": "kv-disk", "ephemeral": {"volumeClaimTemplate": {"spec": {
        "accessModes": ["ReadWriteOncePod"], "resources": {"requests": {"storage": "105Gi"}}}}}} in ephemeral["spec"]["volumes"]
    for pod in (default, claim, ephemeral):
        assert {"name": "kv-disk", "mountPath": "/var/lib/pagoda/kv"} in engine_container(pod)["volumeMounts"]
        _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "kv"}, "template": pod})


def test_a_remote_tier_without_a_secret_passes_only_the_url():
    c = engine_container(_engine_pod(_tiered([{"type": "remote", "url": "rediss://kv:6380/2"}])))
    assert c["args"][c["args"].index("--kv-offload-remote-url") + 1] == "rediss://kv:6380/2"


def test_a_remote_tier_over_several_servers_passes_them_in_their_order():
    urls = "redis://kv-0.kv:6379,redis://kv-1.kv:6379,redis://kv-2.kv:6379"  # the engine's contract test parses it
    c = engine_container(_engine_pod(_tiered([{"type": "remote", "url": urls}])))
    assert c["args"][c["args"].index("--kv-offload-remote-url") + 1] == urls
    assert r.KV_REMOTE_PASSWORD_ENV not in {e["name"] for e in c.get("env", [])}


@pytest.mark.parametrize("compile_cache, triton_dir, shared_volume", [
    # Triton's and FlashInfer's caches on an emptyDir, which outlives the container: an engine
    # that restarts in its pod loads the kernels it compiled instead of compiling them again.
    (None, "/var/cache/pagoda/triton", None),
    # A claim shared by every pod of the service holds Triton's kernels; FlashInfer's builds stay per pod.
    ({"persistentVolumeClaim": {"claimName": "kernels"}}, "/var/cache/pagoda-shared/triton",
     {"name": "compile-cache-shared", "persistentVolumeClaim": {"claimName": "kernels"}}),
], ids=["per-pod", "shared-claim"])
def test_gpu_engines_keep_compiled_kernels_across_restarts_in_their_pod(compile_cache, triton_dir, shared_volume):
    body = load_example("llama-3.1-8b.yaml")
    pod = _engine_pod(with_spec(body, engine__compileCache=compile_cache) if compile_cache else body)
    c = engine_container(pod)
    assert {"name": "cache", "emptyDir": {"sizeLimit": "4Gi"}} in pod["spec"]["volumes"]
    assert {"name": "cache", "mountPath": "/var/cache/pagoda"} in c["volumeMounts"]
    shared = [v for v in pod["spec"]["volumes"] if v["name"] == "compile-cache-shared"]
    assert shared == ([shared_volume] if shared_volume else [])
    if shared_volume:
        assert {"name": "compile-cache-shared", "mountPath": "/var/cache/pagoda-shared"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TRITON_CACHE_DIR"] == triton_dir
    assert env["FLASHINFER_WORKSPACE_BASE"] == "/var/cache/pagoda/flashinfer"
    assert env["CUDA_CACHE_PATH"] == "/var/cache/pagoda/nv"
    _validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "cc"}, "template": pod})


def test_a_users_own_compile_cache_wins_and_cpu_engines_get_none():
    own = engine_container(_engine_pod(with_spec(load_example("llama-3.1-8b.yaml"),
                                                 engine__env=[{"name": "TRITON_CACHE_DIR", "value": "/data/triton"}])))
    assert [e for e in own["env"] if e["name"] == "TRITON_CACHE_DIR"] == [{"name": "TRITON_CACHE_DIR", "value": "/data/triton"}]
    # A CPU engine compiles no GPU kernels: its cache volume holds the CPU libraries' caches only.
    cpu = engine_container(_engine_pod(load_example("tiny-cpu.yaml")))
    assert [e["name"] for e in cpu["env"]] == ["PAGODA_API_KEY", "XDG_CACHE_HOME", "PAGODA_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"]


def test_engine_config_change_changes_the_pod_template_hash_and_nothing_else_does():
    body = load_example("llama-3.1-8b.yaml")

    def template_hash(b):
        return rendered(b)[("Deployment", "llama-8b-engine")]["spec"]["template"]["metadata"]["annotations"][r.CONFIG_HASH_ANNOTATION]

    base = template_hash(body)
    assert template_hash(with_spec(body, engine__maxNumSeqs=128)) != base
    assert template_hash(with_spec(body, model__maxModelLen=8192)) != base
    assert template_hash(with_spec(body, replicas=5)) == base
    assert template_hash(with_spec(body, router__policy="least-load")) == base


def test_models_from_a_pvc_and_a_file_path():
    body = load_example("llama-3.1-8b.yaml")
    pvc = rendered(with_spec(body, model__uri="pvc://weights", model__download=None))
    c = engine_container(pvc[("Deployment", "llama-8b-engine")]["spec"]["template"])
    assert c["args"][c["args"].index("--model") + 1] == "/models"
    f = rendered(with_spec(body, model__uri="file:///opt/models/llama", model__download=None))
    pod = f[("Deployment", "llama-8b-engine")]["spec"]["template"]
    c = engine_container(pod)
    assert c["args"][c["args"].index("--model") + 1] == "/opt/models/llama"
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["shm", "config", "cache", "tmp"]


def test_render_command_prints_the_manifests(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pagoda_operator.cli", "render", "-f", str(EXAMPLES_DIR / "tiny-cpu.yaml"), "-n", "team-a"],
        capture_output=True, text=True, check=True,
    )
    docs = list(yaml.safe_load_all(result.stdout))
    # The NetworkPolicies first: no pod runs before they protect it.
    assert [d["kind"] for d in docs] == ["NetworkPolicy", "NetworkPolicy", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
                                         "Service", "ServiceAccount", "Role", "RoleBinding", "Deployment"]
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    assert docs[-1]["spec"]["template"]["spec"]["containers"][0]["args"][1] == "team-a/tiny-engine"
    assert docs[9]["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-router", "namespace": "team-a"}]
    assert "&id" not in result.stdout, "YAML anchors: children share a dict"
    assert "ownerReferences" not in docs[0]["metadata"]  # no uid before the object exists


def test_render_command_rejects_an_invalid_file(tmp_path):
    bad = load_example("llama-3.1-8b.yaml")
    bad["spec"]["topology"]["tensor"] = 3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = subprocess.run([sys.executable, "-m", "pagoda_operator.cli", "render", "-f", str(path)], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "InferenceService 'llama-8b' is invalid" in result.stderr
    assert "topology.tensor: 3 does not divide the model's 32 attention heads (32 / 3 = 10.67)" in result.stderr


@pytest.mark.parametrize("filename", [f for f in EXAMPLE_FILES if check(load_example(f)).unsupported])
def test_render_command_refuses_an_example_the_engine_cannot_run_yet(filename):
    result = subprocess.run([sys.executable, "-m", "pagoda_operator.cli", "render", "-f", str(EXAMPLES_DIR / filename)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stdout == ""
    name = load_example(filename)["metadata"]["name"]
    assert f"InferenceService {name!r} is invalid" in result.stderr
    assert "which Pagoda's engine does not implement yet" in result.stderr
    for problem in check(load_example(filename)).unsupported:
        assert f"  - {problem}" in result.stderr


@pytest.mark.parametrize("driver,kind", [("hpa", "HorizontalPodAutoscaler"), ("keda", "ScaledObject"), ("builtin", None)])
def test_autoscaling_driver_adds_its_scaler_object(driver, kind):
    body = load_example("llama-3.1-8b-tiers-autoscaling.yaml")
    body["spec"]["autoscaling"]["driver"] = driver
    if driver == "hpa":  # an HPA has no interval of its own: refused
        body["spec"]["autoscaling"].pop("intervalSeconds", None)
    out = rendered(body)
    scalers = [m for (k, _), m in out.items() if k in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert [m["kind"] for m in scalers] == ([kind] if kind else [])
    for m in scalers:
        assert m["spec"]["scaleTargetRef"] == {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "name": "llama-8b-tiered"}
        assert m["metadata"]["ownerReferences"][0]["uid"] == "0000-uid"
        if kind == "HorizontalPodAutoscaler":
            _validate(m)
        else:
            assert crd_schema.validate(m, "keda.scaledobjects.yaml").errors == []


def test_api_server_count_becomes_the_engine_flag_and_is_left_out_at_one():
    base = load_example("llama-3.1-8b.yaml")
    assert "--api-server-count" not in engine_container(_engine_pod(base))["args"]
    args = engine_container(_engine_pod(with_spec(base, engine__apiServerCount=4, resources={"cpu": "8"})))["args"]
    assert args[args.index("--api-server-count") + 1] == "4"


@pytest.mark.parametrize("grace, prestop, drain", [(60, 10, 45), (10, 2, 3), (300, 10, 285)])
def test_the_engines_preStop_and_drain_timeout_fit_its_grace_period(grace, prestop, drain):
    body = with_spec(load_example("tiny-cpu.yaml"), engine__terminationGracePeriodSeconds=grace)
    pod = rendered(body)[("Deployment", "tiny-engine")]["spec"]["template"]
    c = engine_container(pod)
    assert pod["spec"]["terminationGracePeriodSeconds"] == grace
    assert c["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", str(prestop)]}}}
    assert c["args"][c["args"].index("--drain-timeout") + 1] == str(drain)

"""The kopf operator, in-process, against an emulated API server (kmock, extended in
apiserver.py): what it creates, updates and writes, and what it leaves alone."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import threading
import time
from typing import Any, Callable

import httpx
import kopf
import pytest

from pagoda_operator import handlers, kube, kv_status
from pagoda_operator import render as r
from tests.operator.apiserver import BackgroundApiServer
from tests.operator.support import load_example

NS = "default"
IS = ("pagoda.dev", "v1alpha1", "inferenceservices")
DEPLOYMENTS = ("apps", "v1", "deployments")
TIMEOUT = 60  # generous: CI runs this beside heavy tests on 2 cores; waits end as soon as met
# What the tiny example becomes: engine ConfigMap, Service, Deployment and PDB; router Service and
# Deployment; the router's ServiceAccount, Role and RoleBinding; the engine's and the router's
# NetworkPolicy.
TINY_CHILDREN = 11
SECRETS = ("", "v1", "secrets")


class Operator:
    """kopf.operator() in its own thread and event loop (kopf cancels every task of its loop
    when it stops, so it cannot share the API server's); start and stop at will."""

    def __init__(self, apiserver: BackgroundApiServer, recheck_crds_seconds: float = handlers.MISSING_CRD_RECHECK_SECONDS,
                 kv_status_seconds: float = kv_status.KV_STATUS_INTERVAL_S,
                 not_ready_seconds: float = handlers.NOT_READY_RECHECK_SECONDS,
                 lora_sync_seconds: float = handlers.loras.LORA_SYNC_INTERVAL_S):
        self.apiserver = apiserver
        self.lora_sync_seconds = lora_sync_seconds
        self.not_ready_seconds = not_ready_seconds
        self.recheck_crds_seconds = recheck_crds_seconds
        self.kv_status_seconds = kv_status_seconds
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        url = self.apiserver.url
        registry = kopf.OperatorRegistry()
        handlers.register(registry, recheck_crds_seconds=self.recheck_crds_seconds, kv_status_seconds=self.kv_status_seconds,
                          not_ready_seconds=self.not_ready_seconds, lora_sync_seconds=self.lora_sync_seconds)

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True)

        @kopf.on.startup(registry=registry)
        def quick(settings: kopf.OperatorSettings, **_: Any) -> None:
            settings.scanning.disabled = True  # the emulator serves no CRD list to watch
            settings.watching.connect_timeout = 5
            settings.batching.idle_timeout = 1
            settings.batching.batch_window = 0.05

        self._stop = threading.Event()
        ready = threading.Event()

        async def operator() -> None:
            client = kube.connect(url)
            try:
                await kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=self._stop,
                                    ready_flag=ready, memo=kopf.Memo(kube=client, images=r.Images()))
            finally:
                await client.close()

        def run() -> None:
            asyncio.run(operator())

        self._thread = threading.Thread(target=run, name="operator", daemon=True)
        self._thread.start()
        assert ready.wait(TIMEOUT), "the operator did not start"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)
        assert not self._thread.is_alive(), "the operator did not stop"


@pytest.fixture(scope="module")
def cluster():
    apiserver = BackgroundApiServer()
    operator = Operator(apiserver)
    operator.start()
    yield apiserver, operator
    operator.stop()
    apiserver.close()


def path_of(kind: tuple, name: str | None = None, subresource: str | None = None) -> str:
    group, version, plural = kind
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    return f"{base}/namespaces/{NS}/{plural}" + (f"/{name}" if name else "") + (f"/{subresource}" if subresource else "")


def request(apiserver: BackgroundApiServer, method: str, path: str, body: Any = None,
            content_type: str = "application/json", **params: str) -> dict:
    """A write of another client (a user, a controller), straight to the emulated API server. Its
    loop also serves the operator's watches and writes, on a machine the other test worker shares:
    httpx's default 5 s timed out there under load, as `BackgroundApiServer.call`'s 30 s does not."""
    response = httpx.request(method, apiserver.url + path, json=body, params=params,
                             headers={"content-type": content_type}, timeout=30)
    response.raise_for_status()
    return response.json()


def create(apiserver: BackgroundApiServer, body: dict) -> dict:
    return request(apiserver, "POST", path_of(IS), body)


def patch_spec(apiserver: BackgroundApiServer, name: str, spec: dict) -> dict:
    return request(apiserver, "PATCH", path_of(IS, name), {"spec": spec}, "application/merge-patch+json")


def wait_for(what: str, fn: Callable[[], Any], timeout: float = TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _quiet_for(apiserver: BackgroundApiServer, path_part: str, seconds: float) -> bool:
    """True once no write touching `path_part` has arrived for `seconds` (blocks that long)."""
    count = sum(1 for w in apiserver.api.writes if path_part in w.path)
    time.sleep(seconds)
    return sum(1 for w in apiserver.api.writes if path_part in w.path) == count


def get(apiserver: BackgroundApiServer, kind: tuple, name: str) -> dict | None:
    return apiserver.call(_read(apiserver, kind, name))


async def _read(apiserver: BackgroundApiServer, kind: tuple, name: str) -> dict | None:
    return apiserver.api.get(*kind, NS, name)


def children_of(apiserver: BackgroundApiServer, name: str) -> dict[tuple[str, str], dict]:
    async def read() -> dict:
        out = {}
        for group, version, plural in [("", "v1", "configmaps"), ("", "v1", "services"), DEPLOYMENTS,
                                       ("policy", "v1", "poddisruptionbudgets"), ("networking.k8s.io", "v1", "ingresses"),
                                       ("", "v1", "serviceaccounts"), ("rbac.authorization.k8s.io", "v1", "roles"),
                                       ("rbac.authorization.k8s.io", "v1", "rolebindings"),
                                       ("networking.k8s.io", "v1", "networkpolicies")]:
            for child in apiserver.api.names(group, version, plural, NS):
                if child in (name, f"{name}-engine", f"{name}-router", f"{name}-prefill", f"{name}-decode"):
                    obj = apiserver.api.get(group, version, plural, NS, child)
                    out[(obj.get("kind", plural), child)] = obj
        return out

    return apiserver.call(read())


def conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def status_of(apiserver, name) -> dict:
    return (get(apiserver, IS, name) or {}).get("status") or {}


def mark_rolled_out(apiserver: BackgroundApiServer, name: str, replicas: int) -> None:
    """Play the Deployment controller: every replica of the current generation is ready."""
    obj = get(apiserver, DEPLOYMENTS, name)
    status = {"observedGeneration": obj["metadata"]["generation"], "replicas": replicas, "readyReplicas": replicas,
              "updatedReplicas": replicas, "availableReplicas": replicas}
    request(apiserver, "PATCH", path_of(DEPLOYMENTS, name, "status"), {"status": status}, "application/merge-patch+json")


def tiny(name: str = "tiny") -> dict:
    body = load_example("tiny-cpu.yaml")
    body["metadata"] = {"name": name, "namespace": NS}
    return body


def events_for(apiserver: BackgroundApiServer, name: str) -> list[dict]:
    events = [get(apiserver, ("", "v1", "events"), e) for e in apiserver.api.names("", "v1", "events", NS)]
    return [e for e in events if e and e.get("involvedObject", {}).get("name") == name]


def ready_service(apiserver: BackgroundApiServer, name: str) -> None:
    """A tiny service whose children the controllers have brought up (Ready, rolled out)."""
    create(apiserver, tiny(name))
    wait_for("children", lambda: len(children_of(apiserver, name)) == TINY_CHILDREN)
    mark_rolled_out(apiserver, name, 1)
    mark_rolled_out(apiserver, f"{name}-engine", 1)
    wait_for("Ready", lambda: conditions(get(apiserver, IS, name)).get("Progressing", {}).get("reason") == "RolloutComplete"
             and conditions(get(apiserver, IS, name)).get("Ready", {}).get("status") == "True")


def test_applying_an_inference_service_creates_its_children_with_owner_references(cluster):
    apiserver, _ = cluster
    created = create(apiserver, tiny())
    uid = created["metadata"]["uid"]
    children = wait_for("children", lambda: len(children_of(apiserver, "tiny")) == TINY_CHILDREN and children_of(apiserver, "tiny"))
    assert sorted(children) == [
        ("ConfigMap", "tiny-engine"), ("Deployment", "tiny"), ("Deployment", "tiny-engine"),
        ("NetworkPolicy", "tiny"), ("NetworkPolicy", "tiny-engine"),
        ("PodDisruptionBudget", "tiny-engine"), ("Role", "tiny-router"), ("RoleBinding", "tiny-router"),
        ("Service", "tiny"), ("Service", "tiny-engine"), ("ServiceAccount", "tiny-router"),
    ]
    for child in children.values():
        assert child["metadata"]["ownerReferences"] == [{
            "apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "name": "tiny", "uid": uid,
            "controller": True, "blockOwnerDeletion": True}]
        assert child["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagoda-operator"
    # The router runs as its own account, which may read this namespace's EndpointSlices only.
    assert children[("Deployment", "tiny")]["spec"]["template"]["spec"]["serviceAccountName"] == "tiny-router"
    assert children[("RoleBinding", "tiny-router")]["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-router", "namespace": NS}]
    assert children[("RoleBinding", "tiny-router")]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tiny-router"}
    assert children[("Role", "tiny-router")]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    applies = [w for w in apiserver.api.writes if w.path.endswith(("/tiny-engine", "/tiny", "/tiny-router"))]
    applies = [w for w in applies if "inferenceservices" not in w.path]
    assert applies and all(w.method == "PATCH" and w.content_type == "application/apply-patch+yaml"
                           and w.params == {"fieldManager": "pagoda-operator", "force": "true"} for w in applies)

    status = wait_for("status", lambda: conditions(get(apiserver, IS, "tiny") or {}).get("Validated") and status_of(apiserver, "tiny"))
    conds = conditions({"status": status})
    assert status["observedGeneration"] == 1
    assert status["selector"] == "app.kubernetes.io/component=engine,app.kubernetes.io/instance=tiny,app.kubernetes.io/name=pagoda"
    assert status["url"] == "http://tiny.default.svc:8000"
    assert {t: (c["status"], c["reason"]) for t, c in conds.items()} == {
        "Ready": ("False", "RouterNotReady"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
        "Validated": ("True", "Valid"),
    }
    assert all(c["observedGeneration"] == 1 and c["lastTransitionTime"] and c["message"] for c in conds.values())

    # The controllers bring the pods up: the status follows the children.
    mark_rolled_out(apiserver, "tiny", 1)
    mark_rolled_out(apiserver, "tiny-engine", 1)
    status = wait_for("Ready", lambda: conditions(get(apiserver, IS, "tiny")).get("Ready", {}).get("status") == "True" and status_of(apiserver, "tiny"))
    conds = conditions({"status": status})
    assert (conds["Ready"]["reason"], conds["Ready"]["message"]) == ("AllReplicasReady", "1/1 engine replicas ready.")
    assert (conds["Progressing"]["status"], conds["Progressing"]["reason"]) == ("False", "RolloutComplete")
    assert status["replicas"] == 1 and status["readyReplicas"] == 1
    assert conds["Validated"]["lastTransitionTime"] <= conds["Ready"]["lastTransitionTime"]
    wait_for("the Ready event", lambda: any(e.get("reason") == "Ready" and e.get("type") == "Normal" for e in events_for(apiserver, "tiny")))


def _template_hash(apiserver, name) -> str:
    deploy = get(apiserver, DEPLOYMENTS, f"{name}-engine")
    return deploy["spec"]["template"]["metadata"]["annotations"][r.CONFIG_HASH_ANNOTATION]


def test_a_spec_change_updates_the_children_and_rolls_the_pods(cluster):
    apiserver, _ = cluster
    ready_service(apiserver, "changed")
    before = get(apiserver, DEPLOYMENTS, "changed-engine")
    validated_since = conditions(get(apiserver, IS, "changed"))["Validated"]["lastTransitionTime"]
    old_hash = _template_hash(apiserver, "changed")

    patch_spec(apiserver, "changed", {"engine": {"maxNumSeqs": 8}})
    wait_for("new template", lambda: _template_hash(apiserver, "changed") != old_hash)
    after = get(apiserver, DEPLOYMENTS, "changed-engine")
    args = after["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    configmap = get(apiserver, ("", "v1", "configmaps"), "changed-engine")
    assert r.config_hash(configmap["data"]) == _template_hash(apiserver, "changed")

    status = wait_for("generation 2 observed", lambda: status_of(apiserver, "changed").get("observedGeneration") == 2 and status_of(apiserver, "changed"))
    conds = conditions({"status": status})
    assert all(c["observedGeneration"] == 2 for c in conds.values())
    assert (conds["Progressing"]["status"], conds["Progressing"]["reason"]) == ("True", "RollingOut")
    assert conds["Ready"]["status"] == "False"  # the Deployment controller has not caught up yet
    assert conds["Validated"]["lastTransitionTime"] == validated_since  # still valid: no transition

    mark_rolled_out(apiserver, "changed-engine", 1)
    wait_for("rolled out", lambda: conditions(get(apiserver, IS, "changed")).get("Progressing", {}).get("reason") == "RolloutComplete")


def test_an_unchanged_spec_makes_no_changing_writes(cluster):
    apiserver, operator = cluster
    ready_service(apiserver, "steady")
    wait_for("the Ready event", lambda: any(e.get("reason") == "Ready" for e in events_for(apiserver, "steady")))
    # The first reconcile may still be finishing its own writes (kopf's annotations, the status)
    # after the Event: take the snapshot once nothing has touched the service for a second.
    wait_for("the first reconcile to settle", lambda: _quiet_for(apiserver, "/steady", 1.0))
    before = {key: obj["metadata"]["resourceVersion"] for key, obj in children_of(apiserver, "steady").items()}
    is_version = get(apiserver, IS, "steady")["metadata"]["resourceVersion"]
    events_before = len(events_for(apiserver, "steady"))
    mark = len(apiserver.api.writes)

    operator.stop()
    operator.start()  # resume: kopf reconciles every existing InferenceService again

    def steady_writes():
        return [w for w in apiserver.api.writes[mark:] if "/steady" in w.path]

    wait_for("the resumed reconcile", lambda: len([w for w in steady_writes() if w.content_type == "application/apply-patch+yaml"]) >= 6)
    time.sleep(1.0)  # a status write or an Event, had there been one, follows the applies
    changed = [w for w in steady_writes() if w.changed]
    assert changed == [], [(w.path, get(apiserver, IS, "steady")) for w in changed]
    assert not [w for w in steady_writes() if w.path.endswith("/status")]
    assert {key: obj["metadata"]["resourceVersion"] for key, obj in children_of(apiserver, "steady").items()} == before
    assert get(apiserver, IS, "steady")["metadata"]["resourceVersion"] == is_version
    assert len(events_for(apiserver, "steady")) == events_before


def test_an_invalid_spec_is_reported_and_creates_nothing(cluster):
    apiserver, _ = cluster
    body = load_example("llama-3.1-8b.yaml")
    body["metadata"] = {"name": "broken", "namespace": NS}
    body["spec"]["topology"]["tensor"] = 3
    create(apiserver, body)
    conds = wait_for("Validated=False", lambda: conditions(get(apiserver, IS, "broken") or {}).get("Validated") and conditions(get(apiserver, IS, "broken")))
    assert conds["Validated"]["status"] == "False" and conds["Validated"]["reason"] == "InvalidSpec"
    assert "topology.tensor: 3 does not divide the model's 32 attention heads (32 / 3 = 10.67)" in conds["Validated"]["message"]
    assert conds["Validated"]["observedGeneration"] == 1
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "InvalidSpec")
    assert children_of(apiserver, "broken") == {}
    wait_for("the InvalidSpec event", lambda: any(e.get("reason") == "InvalidSpec" and e.get("type") == "Warning"
                                                  for e in events_for(apiserver, "broken")))

    # Fixing the spec creates the children; the operator kept running throughout.
    patch_spec(apiserver, "broken", {"topology": {"tensor": 1}})
    wait_for("children after the fix", lambda: len(children_of(apiserver, "broken")) == TINY_CHILDREN)
    conds = wait_for("Validated=True", lambda: conditions(get(apiserver, IS, "broken")).get("Validated", {}).get("status") == "True"
                     and conditions(get(apiserver, IS, "broken")))
    assert conds["Validated"]["observedGeneration"] == 2


def test_extra_args_pagoda_serve_would_refuse_are_reported_and_create_nothing(cluster):
    # A typo in a GitOps manifest's flags: Validated=False naming the flag, not a crash-looping pod.
    apiserver, _ = cluster
    body = load_example("llama-3.1-8b.yaml")
    body["metadata"] = {"name": "flag-typo", "namespace": NS}
    body["spec"]["engine"]["extraArgs"] = ["--long-prefil-token-treshold", "512"]
    create(apiserver, body)
    conds = wait_for("Validated=False", lambda: conditions(get(apiserver, IS, "flag-typo") or {}).get("Validated")
                     and conditions(get(apiserver, IS, "flag-typo")))
    assert (conds["Validated"]["status"], conds["Validated"]["reason"]) == ("False", "InvalidSpec")
    assert ("engine.extraArgs: pagoda serve has no flag --long-prefil-token-treshold (did you mean "
            "--long-prefill-token-threshold?)") in conds["Validated"]["message"]
    assert children_of(apiserver, "flag-typo") == {}
    patch_spec(apiserver, "flag-typo", {"engine": {"extraArgs": ["--long-prefill-token-threshold", "512"]}})
    wait_for("children after the fix", lambda: len(children_of(apiserver, "flag-typo")) == TINY_CHILDREN)


def test_a_valid_service_turned_invalid_keeps_its_children(cluster):
    apiserver, _ = cluster
    ready_service(apiserver, "typo")
    before = copy.deepcopy(children_of(apiserver, "typo"))
    patch_spec(apiserver, "typo", {"kvCache": {"pageSize": 24}})
    conds = wait_for("Validated=False", lambda: conditions(get(apiserver, IS, "typo")).get("Validated", {}).get("status") == "False"
                     and conditions(get(apiserver, IS, "typo")))
    assert "kvCache.pageSize: 24 is not a power of two" in conds["Validated"]["message"]
    assert children_of(apiserver, "typo") == before
    patch_spec(apiserver, "typo", {"kvCache": {"pageSize": 16}})
    wait_for("valid again", lambda: conditions(get(apiserver, IS, "typo")).get("Validated", {}).get("status") == "True")


@pytest.mark.usefixtures("engine_with_multi_node")  # LeaderWorkerSets, ahead of the engine
def test_missing_optional_crds_degrade_instead_of_failing(cluster):
    apiserver, _ = cluster
    body = tiny("watched")
    body["spec"]["monitoring"] = {"serviceMonitor": True}
    create(apiserver, body)
    conds = wait_for("Degraded", lambda: conditions(get(apiserver, IS, "watched") or {}).get("Degraded") and conditions(get(apiserver, IS, "watched")))
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "ServiceMonitorCRDMissing")
    assert "the ServiceMonitor CRD (monitoring.coreos.com/v1) is not installed" in conds["Degraded"]["message"]
    assert conds["Validated"]["status"] == "True"
    assert len(children_of(apiserver, "watched")) == TINY_CHILDREN  # everything else was applied

    multinode = tiny("spread")
    multinode["spec"]["topology"] = {"nodes": 2}
    create(apiserver, multinode)
    conds = wait_for("Degraded", lambda: conditions(get(apiserver, IS, "spread") or {}).get("Degraded") and conditions(get(apiserver, IS, "spread")))
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "LeaderWorkerSetMissing")
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "EngineMissing")
    assert ("Deployment", "spread-engine") not in children_of(apiserver, "spread")


@pytest.mark.usefixtures("engine_with_multi_node")  # LeaderWorkerSets, ahead of the engine
def test_children_the_spec_no_longer_asks_for_are_deleted(cluster):
    apiserver, _ = cluster
    create(apiserver, tiny("pruned"))
    wait_for("children", lambda: len(children_of(apiserver, "pruned")) == TINY_CHILDREN)
    patch_spec(apiserver, "pruned", {"router": {"ingress": {"host": "pruned.example.com"}}})
    wait_for("the Ingress", lambda: ("Ingress", "pruned") in children_of(apiserver, "pruned"))

    # Moving to two nodes once LeaderWorkerSet is installed: the LWS replaces the Deployment,
    # and dropping the ingress removes it.
    apiserver.api.declare("leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet")
    patch_spec(apiserver, "pruned", {"router": {"ingress": None}, "topology": {"nodes": 2}})
    wait_for("the LeaderWorkerSet", lambda: get(apiserver, ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"), "pruned-engine"))
    children = wait_for("pruned children", lambda: (("Ingress", "pruned") not in children_of(apiserver, "pruned")
                                                    and ("Deployment", "pruned-engine") not in children_of(apiserver, "pruned")
                                                    and children_of(apiserver, "pruned")))
    assert sorted(children) == [("ConfigMap", "pruned-engine"), ("Deployment", "pruned"),
                                ("NetworkPolicy", "pruned"), ("NetworkPolicy", "pruned-engine"), ("PodDisruptionBudget", "pruned-engine"),
                                ("Role", "pruned-router"), ("RoleBinding", "pruned-router"),
                                ("Service", "pruned"), ("Service", "pruned-engine"), ("ServiceAccount", "pruned-router")]
    deletes = sorted(w.path for w in apiserver.api.writes if w.method == "DELETE")
    assert deletes == ["/apis/apps/v1/namespaces/default/deployments/pruned-engine",
                       "/apis/networking.k8s.io/v1/namespaces/default/ingresses/pruned"]
    conds = wait_for("Degraded=False", lambda: conditions(get(apiserver, IS, "pruned")).get("Degraded", {}).get("status") == "False"
                     and conditions(get(apiserver, IS, "pruned")))
    assert conds["Validated"]["status"] == "True"


def internal_key(secret: dict) -> str:
    """The key a Secret holds: in data (base64) as the API server keeps it, or in stringData as
    written (the emulator does not convert)."""
    if "api-key" in (secret.get("data") or {}):
        return base64.b64decode(secret["data"]["api-key"]).decode()
    return secret["stringData"]["api-key"]


def test_the_internal_key_is_created_once_owned_and_handed_to_engines_and_router(cluster):
    apiserver, _ = cluster
    uid = create(apiserver, tiny("keyed"))["metadata"]["uid"]
    children = wait_for("children", lambda: len(children_of(apiserver, "keyed")) == TINY_CHILDREN and children_of(apiserver, "keyed"))
    secret = get(apiserver, SECRETS, "keyed-internal-key")
    assert secret["metadata"]["ownerReferences"] == [{
        "apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "name": "keyed", "uid": uid,
        "controller": True, "blockOwnerDeletion": True}]
    key = internal_key(secret)
    assert len(key) >= 43  # 32 random bytes, base64url
    ref = {"secretKeyRef": {"name": "keyed-internal-key", "key": "api-key"}}
    (engine,) = children[("Deployment", "keyed-engine")]["spec"]["template"]["spec"]["containers"]
    (router,) = children[("Deployment", "keyed")]["spec"]["template"]["spec"]["containers"]
    assert {"name": "PAGODA_API_KEY", "valueFrom": ref} in engine["env"]
    assert {"name": "PAGODA_BACKEND_API_KEY", "valueFrom": ref} in router["env"]

    # Reconciles after a spec change keep the key: rotating it would break the running pods.
    version = secret["metadata"]["resourceVersion"]
    patch_spec(apiserver, "keyed", {"engine": {"maxNumSeqs": 8}})
    wait_for("generation 2 reconciled", lambda: status_of(apiserver, "keyed").get("observedGeneration") == 2)
    secret = get(apiserver, SECRETS, "keyed-internal-key")
    assert (secret["metadata"]["resourceVersion"], internal_key(secret)) == (version, key)
    assert [w for w in apiserver.api.writes if "/secrets" in w.path and w.changed] != []  # the one create
    # Every service has a key of its own.
    create(apiserver, tiny("keyed-too"))
    other = wait_for("the second key", lambda: get(apiserver, SECRETS, "keyed-too-internal-key"))
    assert internal_key(other) != key


def test_a_refused_internal_key_degrades_and_starts_no_pods(cluster, monkeypatch):
    """Without its key the engines could not start (their env references it): nothing is applied,
    and the Degraded condition says why (here an installation whose RBAC lacks secrets/create)."""
    apiserver, _ = cluster
    create_for_real = kube.create

    async def refuse_this_key(client, manifest, field_manager):
        if manifest["metadata"]["name"] == "locked-internal-key":
            raise kube.KubeError(403, 'Forbidden secrets is forbidden: cannot create resource "secrets"')
        return await create_for_real(client, manifest, field_manager)

    monkeypatch.setattr(kube, "create", refuse_this_key)
    create(apiserver, tiny("locked"))
    conds = wait_for("Degraded", lambda: conditions(get(apiserver, IS, "locked") or {}).get("Degraded")
                     and conditions(get(apiserver, IS, "locked")))
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "ApplyFailed")
    assert conds["Degraded"]["message"].startswith("Secret locked-internal-key: 403: Forbidden")
    assert children_of(apiserver, "locked") == {}


def test_network_policies_go_when_the_spec_turns_them_off(cluster):
    apiserver, _ = cluster
    create(apiserver, tiny("open"))
    children = wait_for("children", lambda: len(children_of(apiserver, "open")) == TINY_CHILDREN and children_of(apiserver, "open"))
    assert children[("NetworkPolicy", "open-engine")]["spec"]["podSelector"] == {"matchLabels": {
        "app.kubernetes.io/name": "pagoda", "app.kubernetes.io/instance": "open", "app.kubernetes.io/component": "engine"}}
    patch_spec(apiserver, "open", {"networkPolicy": False})
    children = wait_for("no policies", lambda: len(children_of(apiserver, "open")) == TINY_CHILDREN - 2 and children_of(apiserver, "open"))
    assert "NetworkPolicy" not in {kind for kind, _ in children}


def test_replicas_set_through_the_scale_subresource_reach_the_engine(cluster):
    apiserver, _ = cluster
    body = tiny("scaled")
    del body["spec"]["replicas"]
    body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    create(apiserver, body)
    wait_for("engine at minReplicas", lambda: (get(apiserver, DEPLOYMENTS, "scaled-engine") or {}).get("spec", {}).get("replicas") == 1)

    # What HPA, KEDA or Pagoda's autoscaler do: write a Scale.
    scale = request(apiserver, "PATCH", path_of(IS, "scaled", "scale"), {"spec": {"replicas": 3}}, "application/merge-patch+json",
                    fieldManager="pagoda-autoscaler")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    wait_for("engine at 3", lambda: get(apiserver, DEPLOYMENTS, "scaled-engine")["spec"]["replicas"] == 3)
    conds = wait_for("generation 2", lambda: status_of(apiserver, "scaled").get("observedGeneration") == 2 and conditions(get(apiserver, IS, "scaled")))
    assert conds["Validated"]["status"] == "True"

    # A user writing replicas next to autoscaling is told to choose.
    request(apiserver, "PATCH", path_of(IS, "scaled"), {"spec": {"replicas": 2}}, "application/merge-patch+json",
            fieldManager="kubectl-edit")
    conds = wait_for("Validated=False", lambda: conditions(get(apiserver, IS, "scaled")).get("Validated", {}).get("status") == "False"
                     and conditions(get(apiserver, IS, "scaled")))
    assert "replicas: set replicas or autoscaling, not both (set by kubectl-edit)" in conds["Validated"]["message"]
    assert get(apiserver, DEPLOYMENTS, "scaled-engine")["spec"]["replicas"] == 3  # nothing applied


RECONCILER_CONDITIONS = {"Ready", "Progressing", "Degraded", "Validated"}


def status_apply(apiserver: BackgroundApiServer, name: str, status: dict, manager: str) -> dict:
    """Server-side apply of `status` on /status as `manager`, not forced: a conflict would fail."""
    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name, "namespace": NS},
            "status": status}
    return request(apiserver, "PATCH", path_of(IS, name, "status"), body, "application/apply-patch+yaml", fieldManager=manager)


def condition_owners(obj: dict) -> dict[str, list[str]]:
    """condition type → the managers owning its entry in metadata.managedFields."""
    out: dict[str, list[str]] = {}
    for entry in obj["metadata"].get("managedFields") or []:
        for key in ((entry["fieldsV1"].get("f:status") or {}).get("f:conditions") or {}):
            out.setdefault(json.loads(key[2:])["type"], []).append(entry["manager"])
    return out


def test_two_field_managers_apply_status_without_conflicts_or_lost_conditions():
    apiserver = BackgroundApiServer()  # no operator: the two writers are this test
    try:
        create(apiserver, tiny("pair"))

        def cond(type_: str, status: str, reason: str) -> dict:
            return {"type": type_, "status": status, "reason": reason, "message": reason, "lastTransitionTime": "2026-01-01T00:00:00Z"}

        status_apply(apiserver, "pair", {"observedGeneration": 1, "conditions": [cond("Ready", "False", "RouterNotReady")]}, "pagoda-operator")
        status_apply(apiserver, "pair", {"conditions": [cond("ScalingReady", "True", "Steady")],
                                         "autoscaling": {"desiredReplicas": 1, "lastDecision": {"result": 1, "inputs": {"waiting": 0}}}},
                     "pagoda-autoscaler")
        # Each writer changes its own condition: the other's stays as it was.
        status_apply(apiserver, "pair", {"observedGeneration": 1, "conditions": [cond("Ready", "True", "AllReplicasReady"),
                                                                                  cond("Progressing", "False", "RolloutComplete")]},
                     "pagoda-operator")
        status_apply(apiserver, "pair", {"conditions": [cond("ScalingReady", "False", "PrometheusUnavailable")],
                                         "autoscaling": {"desiredReplicas": 1, "lastDecision": {"result": 1, "inputs": {}}}},
                     "pagoda-autoscaler")
        obj = get(apiserver, IS, "pair")
        assert {t: (c["status"], c["reason"]) for t, c in conditions(obj).items()} == {
            "Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
            "ScalingReady": ("False", "PrometheusUnavailable")}
        assert obj["status"]["observedGeneration"] == 1
        # What a writer applies no more is gone (its field set is its whole intent).
        assert obj["status"]["autoscaling"]["lastDecision"] == {"result": 1}
        assert condition_owners(obj) == {"Ready": ["pagoda-operator"], "Progressing": ["pagoda-operator"],
                                         "ScalingReady": ["pagoda-autoscaler"]}
        # The emulator does detect conflicts: a third writer taking Ready without force is refused.
        with pytest.raises(httpx.HTTPStatusError) as refused:
            status_apply(apiserver, "pair", {"conditions": [cond("Ready", "False", "Mine")]}, "someone-else")
        assert refused.value.response.status_code == 409
        assert conditions(get(apiserver, IS, "pair"))["Ready"]["reason"] == "AllReplicasReady"
    finally:
        apiserver.close()


def test_a_manager_that_gave_up_its_status_fields_and_applies_again_removes_only_its_own():
    """The prefill autoscaler's sequence when spec.prefill.autoscaling goes while one of its ticks
    is in flight: it gives up its status part (an empty apply, `kube.apply_status` with {}), then
    the late tick applies that part again. The other writers' fields stay throughout."""
    apiserver = BackgroundApiServer()  # no operator: the writers are this test, through the operator's own apply
    try:
        create(apiserver, tiny("late"))
        ready = {"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": "m",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"}

        async def writes() -> None:
            client = kube.connect(apiserver.url)
            try:
                await kube.apply_status(client, NS, "late", {"conditions": [ready]}, "pagoda-operator")
                await kube.apply_status(client, NS, "late", {"autoscaling": {"desiredReplicas": 2}}, "pagoda-autoscaler")
                mine = {"prefillAutoscaling": {"desiredReplicas": 3}}
                await kube.apply_status(client, NS, "late", mine, "pagoda-autoscaler-prefill")
                await kube.apply_status(client, NS, "late", {}, "pagoda-autoscaler-prefill")
                assert "prefillAutoscaling" not in status_of(apiserver, "late")
                await kube.apply_status(client, NS, "late", mine, "pagoda-autoscaler-prefill")  # the late tick
            finally:
                await client.close()

        asyncio.run(writes())
        status = status_of(apiserver, "late")
        assert status["conditions"] == [ready] and status["autoscaling"] == {"desiredReplicas": 2}
        assert status["prefillAutoscaling"] == {"desiredReplicas": 3}
    finally:
        apiserver.close()


def test_the_reconciler_and_the_autoscaler_never_overwrite_each_others_conditions(cluster):
    apiserver, _ = cluster
    body = tiny("both")
    del body["spec"]["replicas"]
    # No Prometheus: every second the autoscaler decides "unchanged" and applies ScalingReady=False.
    body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 2, "intervalSeconds": 1}
    create(apiserver, body)
    every = RECONCILER_CONDITIONS | {"ScalingReady"}
    wait_for("both writers' conditions", lambda: set(conditions(get(apiserver, IS, "both") or {})) == every)

    def decisions_after(time: str) -> bool:
        return status_of(apiserver, "both")["autoscaling"]["lastDecision"]["time"] > time

    # The reconciler's conditions change (the pods come up, then a spec change rolls them) while
    # the autoscaler keeps applying its own.
    mark_rolled_out(apiserver, "both", 1)
    mark_rolled_out(apiserver, "both-engine", 1)
    wait_for("Ready", lambda: conditions(get(apiserver, IS, "both"))["Ready"]["status"] == "True")
    wait_for("a decision after Ready", lambda: decisions_after(conditions(get(apiserver, IS, "both"))["Ready"]["lastTransitionTime"]))
    patch_spec(apiserver, "both", {"engine": {"maxNumSeqs": 8}})
    wait_for("generation 2 rolling out", lambda: status_of(apiserver, "both").get("observedGeneration") == 2
             and conditions(get(apiserver, IS, "both"))["Progressing"]["status"] == "True")
    for _ in range(2):
        since = status_of(apiserver, "both")["autoscaling"]["lastDecision"]["time"]
        wait_for("a later decision", lambda: decisions_after(since))

    # Every version the API server stored since both had written holds both writers' conditions,
    # and each write left the other writer's conditions exactly as they were.
    versions = [(obj, writer) for obj, writer in apiserver.api.versions(*IS, NS, "both") if obj.get("status")]
    first = next(i for i, (obj, _) in enumerate(versions) if set(conditions(obj)) == every)
    assert [set(conditions(obj)) for obj, _ in versions[first:]] == [every] * (len(versions) - first)
    own = {"pagoda-operator": RECONCILER_CONDITIONS, "pagoda-autoscaler": {"ScalingReady"}}
    for (before, _), (after, writer) in zip(versions[first:], versions[first + 1:]):
        others = every - own.get(writer, set())
        assert {t: c for t, c in conditions(after).items() if t in others} == \
            {t: c for t, c in conditions(before).items() if t in others}, writer
    status_writes = [w for w in apiserver.api.writes if w.path == path_of(IS, "both", "status")]
    assert {(w.method, w.content_type, w.params.get("force")) for w in status_writes} == {("PATCH", "application/apply-patch+yaml", "true")}
    writers = [writer for _, writer in versions[first + 1:]]
    assert writers.count("pagoda-operator") >= 2 and writers.count("pagoda-autoscaler") >= 2
    assert set(writers) <= {"pagoda-operator", "pagoda-autoscaler", None}  # None: kopf's annotations on the main resource
    final = get(apiserver, IS, "both")
    assert condition_owners(final) == {**{t: ["pagoda-operator"] for t in RECONCILER_CONDITIONS}, "ScalingReady": ["pagoda-autoscaler"]}
    assert (conditions(final)["Progressing"]["status"], conditions(final)["ScalingReady"]["reason"]) == ("True", "PrometheusUnavailable")


def test_a_crd_installed_later_is_noticed_without_a_spec_change():
    # Its own cluster: an operator that rechecks missing CRDs every second, not every minute.
    apiserver = BackgroundApiServer()
    operator = Operator(apiserver, recheck_crds_seconds=1)
    operator.start()
    try:
        _crd_installed_later(apiserver)
    finally:
        operator.stop()
        apiserver.close()


def _crd_installed_later(apiserver: BackgroundApiServer) -> None:
    body = tiny("later")
    body["spec"]["monitoring"] = {"serviceMonitor": True}
    create(apiserver, body)
    wait_for("Degraded", lambda: conditions(get(apiserver, IS, "later") or {}).get("Degraded", {}).get("reason") == "ServiceMonitorCRDMissing")
    apiserver.api.declare("monitoring.coreos.com", "v1", "servicemonitors", "ServiceMonitor")
    monitor = wait_for("the ServiceMonitor", lambda: get(apiserver, ("monitoring.coreos.com", "v1", "servicemonitors"), "later"))
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    conds = wait_for("Degraded=False", lambda: conditions(get(apiserver, IS, "later")).get("Degraded", {}).get("status") == "False"
                     and conditions(get(apiserver, IS, "later")))
    assert conds["Degraded"]["reason"] == "AsExpected"
    assert get(apiserver, IS, "later")["metadata"]["generation"] == 1


PODS = ("", "v1", "pods")


def engine_pod(apiserver: BackgroundApiServer, service: str, name: str, download: dict) -> None:
    """Play the kubelet: an engine pod of `service` whose model-download init container is in the
    state `download` (the containerStatus fields besides name)."""
    labels = r.selector_labels(service, "engine")
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"initContainers": [{"name": "model-download", "image": "x"}], "containers": [{"name": "engine", "image": "x"}]}}
    request(apiserver, "POST", path_of(PODS), body)
    status = {"phase": "Pending", "initContainerStatuses": [{"name": "model-download", "ready": False, "restartCount": 1,
                                                            "image": "x", "imageID": "", **download}]}
    request(apiserver, "PATCH", path_of(PODS, name, "status"), {"status": status}, "application/merge-patch+json")


def test_a_failed_model_download_shows_in_ready():
    # Its own cluster: an operator that refreshes not-ready services every second, not every 30.
    apiserver = BackgroundApiServer()
    operator = Operator(apiserver, not_ready_seconds=1)
    operator.start()
    try:
        _failed_download(apiserver)
    finally:
        operator.stop()
        apiserver.close()


def _failed_download(apiserver: BackgroundApiServer) -> None:
    create(apiserver, tiny("dl"))
    wait_for("children", lambda: len(children_of(apiserver, "dl")) == TINY_CHILDREN)
    mark_rolled_out(apiserver, "dl", 1)  # the router is up; the engine's pod is not

    def ready() -> dict:
        return conditions(get(apiserver, IS, "dl")).get("Ready", {})

    wait_for("ReplicasNotReady", lambda: ready().get("reason") == "ReplicasNotReady")

    # A pod whose download succeeded (the engine is still loading) is no failure.
    engine_pod(apiserver, "dl", "dl-engine-healthy", {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}})
    time.sleep(3)  # three timer ticks
    assert ready()["reason"] == "ReplicasNotReady", ready()

    # One whose downloader exited 3: its last line, bounded, is the Ready condition's message.
    why = "pagoda s3: downloading s3://bucket/model refused: InvalidAccessKeyId " + "x" * 1000
    log = "pagoda s3: attempt 1 of 3\n" + why + "\n"
    engine_pod(apiserver, "dl", "dl-engine-failed", {
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": log}}})
    wait_for("ModelDownloadFailed", lambda: ready().get("reason") == "ModelDownloadFailed")
    condition = ready()
    assert condition["status"] == "False"
    assert "pod dl-engine-failed: model-download exited 3: pagoda s3: downloading s3://bucket/model refused: InvalidAccessKeyId" \
        in condition["message"], condition["message"]
    assert "attempt 1 of 3" not in condition["message"]
    assert len(condition["message"]) < 500, len(condition["message"])

    # The pod replaced (its next attempt is running): the condition is what it was before.
    request(apiserver, "DELETE", path_of(PODS, "dl-engine-failed"))
    wait_for("ReplicasNotReady again", lambda: ready().get("reason") == "ReplicasNotReady")

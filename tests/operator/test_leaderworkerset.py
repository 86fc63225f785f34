"""A multi-node replica as a LeaderWorkerSet: the rendered object against the real LWS CRD
(crds/lws.leaderworkersets.yaml, strict field validation; its pod templates also against
Kubernetes' core schema), the leader alone
behind the engine Service and its readiness, GPUs per pod = tensor parallelism per node, and the
kopf operator creating, updating and degrading it against the emulated API server."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from pagoda_operator import handlers, kube
from pagoda_operator import render as r
from pagoda_operator.validation import check
from tests.operator import crd_schema
from tests.operator.apiserver import BackgroundApiServer
from tests.operator.support import load_example
from tests.operator.test_operator_kmock import (IS, NS, Operator, children_of, conditions, create, get, patch_spec, path_of,
                                                request, wait_for)

K8S_VERSION = "1.33.0"
EXAMPLE = "llama-3.1-70b-multinode.yaml"
LWS = ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
LWS_LABEL = "leaderworkerset.sigs.k8s.io"


LWS_CRD = "lws.leaderworkersets.yaml"


def lws_problems(lws: dict) -> list[str]:
    """What the API server would refuse in `lws` (the real CRD's schema, CEL rules, strict fields)."""
    return crd_schema.validate(lws, LWS_CRD).errors


def validate_leaderworkerset(lws: dict) -> None:
    """Against the real LWS v1 CRD; its pod templates' specs also against Kubernetes' core PodSpec."""
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    assert lws_problems(lws) == []
    for role in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][role]
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"lws-{role.lower()}"},
                                      "template": template}, K8S_VERSION, strict=True)


def rendered_lws(body: dict) -> tuple[dict, dict]:
    """(the LeaderWorkerSet, the engine Service) of a valid multi-node spec."""
    checked = check(body)
    assert checked.ok, checked.problems
    out = {(m["kind"], m["metadata"]["name"]): m for m in r.render(body, checked.spec)}
    name = body["metadata"]["name"]
    return out[("LeaderWorkerSet", f"{name}-engine")], out[("Service", f"{name}-engine")]


def test_the_two_node_example_validates_against_the_leaderworkerset_schema():
    lws, _ = rendered_lws(load_example(EXAMPLE))
    validate_leaderworkerset(lws)
    # The schema bites: what the API server would refuse is refused here too.
    for path, value in ((("leaderWorkerTemplate", "restartPolicy"), "RecreateGroup"),
                        (("leaderWorkerTemplate", "size"), "2"),
                        (("startupPolicy",), "WorkersFirst"),
                        (("leaderWorkerTemplate", "restartpolicy"), "Default"),
                        (("rolloutStrategy", "type"), "Recreate")):
        bad = copy.deepcopy(lws)
        target = bad["spec"]
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert lws_problems(bad), path
    worker_without_containers = copy.deepcopy(lws)
    del worker_without_containers["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    assert lws_problems(worker_without_containers)


def _pod_labels(lws: dict, role: str, worker_index: int) -> dict[str, str]:
    """A group's pod labels as the LWS controller sets them: the template's and its indices."""
    template = lws["spec"]["leaderWorkerTemplate"][f"{role}Template"]
    return {**template["metadata"]["labels"], f"{LWS_LABEL}/group-index": "0", f"{LWS_LABEL}/worker-index": str(worker_index)}


def test_the_leader_alone_serves_behind_the_engine_service_and_is_probed():
    lws, service = rendered_lws(load_example(EXAMPLE))
    selector = service["spec"]["selector"]
    leader, worker = _pod_labels(lws, "leader", 0), _pod_labels(lws, "worker", 1)
    assert selector.items() <= leader.items()
    assert not selector.items() <= worker.items()
    # Workers resolve the leader through this Service before anything is ready.
    assert service["spec"]["publishNotReadyAddresses"] is True and service["spec"]["clusterIP"] == "None"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    (leader_c,), (worker_c,) = lwt["leaderTemplate"]["spec"]["containers"], lwt["workerTemplate"]["spec"]["containers"]
    assert leader_c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker_c)
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"


@pytest.mark.parametrize("tensor,pipeline,nodes", [(8, 1, 2), (4, 2, 2), (2, 4, 4), (8, 2, 2)])
def test_gpus_per_pod_are_the_ranks_of_one_node(tensor, pipeline, nodes):
    body = load_example(EXAMPLE)
    body["spec"]["topology"] = {"tensor": tensor, "pipeline": pipeline, "nodes": nodes}
    del body["spec"]["resources"]["gpusPerPod"]  # derived: tensor × pipeline / nodes
    lws, _ = rendered_lws(body)
    validate_leaderworkerset(lws)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == nodes
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = lwt[role]["spec"]["containers"]
        per_pod = str(tensor * pipeline // nodes)
        assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] == per_pod
        args = container["args"]
        assert args[args.index("--tensor-parallel-size") + 1] == str(tensor)
        assert args[args.index("--pipeline-parallel-size") + 1] == str(pipeline)
        assert args[args.index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
        assert ("--headless" in args) == (role == "workerTemplate")


# --- the operator against the emulated API server ------------------------------------------------


def multinode(name: str) -> dict:
    body = load_example(EXAMPLE)
    body["metadata"] = {"name": name, "namespace": NS}
    body["spec"]["monitoring"] = {"serviceMonitor": False}  # one missing CRD at a time
    return body


def test_without_the_crd_the_service_is_degraded_then_created_updated_and_ready_once_lws_is_installed(apiserver_missing_crds):
    apiserver = apiserver_missing_crds
    create(apiserver, multinode("big"))
    conds = wait_for("Degraded", lambda: conditions(get(apiserver, IS, "big") or {}).get("Degraded") and conditions(get(apiserver, IS, "big")))
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "LeaderWorkerSetMissing")
    assert "the LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1) is not installed" in conds["Degraded"]["message"]
    assert "install LWS" in conds["Degraded"]["message"]
    assert conds["Validated"]["status"] == "True"
    assert (conds["Ready"]["status"], conds["Ready"]["reason"]) == ("False", "EngineMissing")
    children = children_of(apiserver, "big")
    assert ("Deployment", "big") in children and ("Service", "big-engine") in children  # the rest is applied
    assert ("Deployment", "big-engine") not in children

    # Create: LWS installed later, noticed by the recheck without a spec change.
    apiserver.api.declare(*LWS, "LeaderWorkerSet")
    lws = wait_for("the LeaderWorkerSet", lambda: get(apiserver, LWS, "big-engine"))
    validate_leaderworkerset({k: v for k, v in lws.items() if k in ("apiVersion", "kind", "spec")} | {"metadata": {}})
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    conds = wait_for("Degraded=False", lambda: conditions(get(apiserver, IS, "big")).get("Degraded", {}).get("status") == "False"
                     and conditions(get(apiserver, IS, "big")))
    assert conds["Degraded"]["reason"] == "AsExpected"

    # Update: a spec change reaches both templates, and replicas the LWS.
    patch_spec(apiserver, "big", {"engine": {"maxNumSeqs": 64}, "replicas": 2})

    def updated() -> dict | None:
        obj = get(apiserver, LWS, "big-engine")
        lwt = obj["spec"]["leaderWorkerTemplate"]
        args = [lwt[role]["spec"]["containers"][0]["args"] for role in ("leaderTemplate", "workerTemplate")]
        return obj if obj["spec"]["replicas"] == 2 and all("--max-num-seqs" in a and a[a.index("--max-num-seqs") + 1] == "64" for a in args) else None

    lws = wait_for("the updated LeaderWorkerSet", updated)
    assert lws["metadata"]["generation"] == 2
    templates = lws["spec"]["leaderWorkerTemplate"]
    assert templates["leaderTemplate"]["metadata"]["annotations"] == templates["workerTemplate"]["metadata"]["annotations"]

    # The LWS controller reports both groups ready: the InferenceService is Ready.
    request(apiserver, "PATCH", path_of(LWS, "big-engine", "status"), {"status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2}},
            "application/merge-patch+json")
    request(apiserver, "PATCH", path_of(("apps", "v1", "deployments"), "big", "status"),
            {"status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, "application/merge-patch+json")
    conds = wait_for("Ready", lambda: conditions(get(apiserver, IS, "big")).get("Ready", {}).get("status") == "True"
                     and conditions(get(apiserver, IS, "big")))
    assert conds["Ready"]["message"] == "2/2 engine replicas ready."


def test_a_404_on_applying_the_leaderworkerset_degrades_instead_of_retrying(monkeypatch):
    """The kind was listed as served (a discovery that is stale, a CRD removed meanwhile) but the
    apply gets a 404: the same Degraded reason as a missing CRD, not an ApplyFailed retry loop."""
    async def always_served(*_args, **_kwargs) -> bool:
        return True

    monkeypatch.setattr(kube, "served", always_served)
    apiserver = BackgroundApiServer()
    operator = Operator(apiserver, recheck_crds_seconds=handlers.MISSING_CRD_RECHECK_SECONDS)
    operator.start()
    try:
        create(apiserver, multinode("stale"))
        conds = wait_for("Degraded", lambda: conditions(get(apiserver, IS, "stale") or {}).get("Degraded")
                         and conditions(get(apiserver, IS, "stale")))
        assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "LeaderWorkerSetMissing")
        lws_applies = [w for w in apiserver.api.writes if "leaderworkersets" in w.path]
        assert lws_applies and all(w.method == "PATCH" for w in lws_applies)
        assert ("Deployment", "stale") in children_of(apiserver, "stale")
    finally:
        operator.stop()
        apiserver.close()

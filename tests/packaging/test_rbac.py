"""Least-privilege RBAC, in the chart and in kustomize alike: every kind the operator's renderer can
emit is covered by a rule with the verbs that writing and pruning it need, the operator holds
exactly what it grants to the routers' Roles, and nothing else is granted."""

from __future__ import annotations

import pytest
from packaging_support import CHART_DIR, KUSTOMIZE_DIR, group_of, load_yaml_stream, rules_of

render = pytest.importorskip("pagoda_operator.render", reason="the operator package is not installed")

# Writing a child is server-side apply: a PATCH that creates the object when it is missing.
WRITE = {"create", "patch"}
# handlers.prune lists every child kind by label and deletes what the spec no longer asks for.
PRUNE = {"list", "delete"}
READ = {"get", "list", "watch"}
# Children the operator also reads back (handlers._engine_and_router) and kopf watches
# (refresh_from_child), to compute the owner's conditions.
READ_BACK_KINDS = {"Deployment", "LeaderWorkerSet"}
# Children kopf watches and the operator never reads alone: a gateway's verdicts on the pool
# (pool_status.py) go into the owner's status.
WATCHED_KINDS = {"InferencePool"}
FORBIDDEN_VERBS = {"*", "escalate", "bind", "impersonate", "deletecollection"}
# What the operator needs beyond its children, with the reason it needs it.
EXTRA_GRANTS = {
    ("pagoda.dev", "inferenceservices"): {"get", "list", "watch", "patch"},  # kopf; read before status
    ("pagoda.dev", "inferenceservices/status"): {"patch"},  # server-side apply of the status (kube.apply_status)
    ("pagoda.dev", "inferenceservices/scale"): {"patch"},  # the built-in autoscaler's decisions
    ("pagoda.dev", "inferenceservices/finalizers"): {"update"},  # ownerReferences with blockOwnerDeletion
    ("", "events"): {"create"},  # kopf.event
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},  # kopf follows CRDs
    # handlers.ensure_internal_key: create-once, an AlreadyExists answer meaning it is there; read
    # back by name (get) by the LoRA sync (loras.internal_key) only; never listed or watched.
    ("", "secrets"): {"create", "get"},
    # handlers._download_failure lists the engine pods by label for a failed model download; a
    # pod is never watched, read alone or written.
    ("", "pods"): {"list"},
    # objectives.py: a gateway-mode service's InferenceObjectives, listed at each reconcile and
    # watched, for its endpoint picker's ConfigMap; never written.
    ("llm-d.ai", "inferenceobjectives"): {"list", "watch"},
}
# Only when watching chosen namespaces: kopf lists and follows namespaces to find them.
NAMESPACED_EXTRA_GRANTS = {("", "namespaces"): {"list", "watch"}}


# spec.autoscaling.driver keda | hpa makes the operator write one of these instead of scaling itself.
SCALER_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("autoscaling/v2", "HorizontalPodAutoscaler")}


def emitted_kinds() -> set[tuple[str, str]]:
    """(apiVersion, kind) of everything the operator can apply: the renderer's list and the
    scaler objects. Where the autoscaler's renderer is installed, its output must be SCALER_KINDS."""
    try:
        from pagoda_operator.autoscaler import scaledobjects
    except ImportError:
        return set(render.CHILD_KINDS) | SCALER_KINDS
    from pagoda_operator.validation import check

    scalers = set()
    for driver in ("keda", "hpa"):
        body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "s", "namespace": "default"},
                "spec": {"model": {"builtinTiny": True}, "autoscaling": {"driver": driver, "minReplicas": 1, "maxReplicas": 4,
                                          "prometheusURL": "http://prometheus.monitoring:9090"}}}
        checked = check(body)
        assert checked.ok, checked.problems
        scalers |= {(o["apiVersion"], o["kind"]) for o in scaledobjects.render_scaler(body, checked.spec)}
    assert scalers == SCALER_KINDS
    return set(render.CHILD_KINDS) | scalers


def plural(kind: str) -> str:
    """The resource name of a built-in or well-known kind (all of ours follow English -s/-es/-ies)."""
    lower = kind.lower()
    if lower.endswith("y"):
        return lower[:-1] + "ies"
    return lower + ("es" if lower.endswith("s") else "s")


def grants(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def chart_objects(helm, values: dict | None = None) -> list[dict]:
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values or {}, name="pagoda", namespace="pagoda-system")
    return [o for name, text in rendered.items() if name.endswith(".yaml") for o in load_yaml_stream(text)]


def kustomize_objects() -> list[dict]:
    # The generated files themselves (their freshness is tested in test_kustomize.py), so this
    # test needs neither kubectl nor the CRDs.
    return load_yaml_stream((KUSTOMIZE_DIR / "base" / "operator.yaml").read_text())


def operator_grants(objects: list[dict]) -> dict[tuple[str, str], set[str]]:
    """Everything bound to the operator's ServiceAccount, through any binding."""
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    bound = [
        roles[(b["roleRef"]["kind"], b["roleRef"]["name"])]
        for b in objects
        if b["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s["kind"] == "ServiceAccount" and s["name"] == "pagoda-operator" for s in b["subjects"])
    ]
    return grants(rules_of(bound))


@pytest.fixture(params=["chart", "chart-namespaced", "kustomize"])
def installed(request):
    if request.param == "kustomize":
        return kustomize_objects()
    helm = request.getfixturevalue("helm")
    values = {"operator": {"watchNamespaces": ["team-a"]}} if request.param == "chart-namespaced" else {}
    return chart_objects(helm, values)


@pytest.fixture
def needed(request, installed) -> dict[tuple[str, str], set[str]]:
    """Exactly what the operator needs in this installation."""
    out = {(group_of(v), plural(k)): WRITE | PRUNE | (READ if k in READ_BACK_KINDS else set())
           | ({"watch"} if k in WATCHED_KINDS else set()) for v, k in emitted_kinds()}
    out |= EXTRA_GRANTS
    # RBAC lets nobody grant what they do not hold: the operator holds what the routers' Roles grant.
    for key, verbs in router_role_grants().items():
        assert key not in out, f"{key} is both a child kind and a router grant"
        out[key] = verbs
    if "namespaced" in request.node.callspec.params["installed"]:
        out |= NAMESPACED_EXTRA_GRANTS
    return out


def test_every_kind_the_renderer_emits_is_writable(installed):
    granted = operator_grants(installed)
    assert render.CHILD_KINDS, "the renderer lists no kinds"
    for api_version, kind in emitted_kinds():
        key = (group_of(api_version), plural(kind))
        assert key in granted, f"no rule lets the operator write {kind} ({api_version})"
        assert WRITE <= granted[key], f"{kind}: missing verbs {WRITE - granted[key]}"


def test_grants_are_exactly_what_the_operator_needs(installed, needed):
    granted = operator_grants(installed)
    for key, verbs in granted.items():
        assert key in needed, f"the operator is granted {key}, which it does not use"
        assert verbs == needed[key], f"{key}: granted {sorted(verbs)}, needed {sorted(needed[key])}"
    assert set(granted) == set(needed), f"not granted: {set(needed) - set(granted)}"


def test_no_wildcards_or_escalation_anywhere(installed):
    for rule in rules_of(installed):
        for field in ("apiGroups", "resources"):
            assert "*" not in rule[field], rule
        assert not FORBIDDEN_VERBS & set(rule["verbs"]), rule


def test_the_internal_key_secret_is_created_and_read_by_name_only(installed):
    """The operator creates each service's internal-key Secret (handlers.ensure_internal_key) and
    reads it back by name for the LoRA sync (loras.internal_key): no rule lets it list or watch
    Secrets of any namespace."""
    body, _ = _tiny()
    secret = render.render_internal_key_secret(body, "k")
    key = (group_of(secret["apiVersion"]), plural(secret["kind"]))
    assert key == ("", "secrets")
    assert operator_grants(installed)[key] == {"create", "get"}
    for rule in rules_of(installed):
        if "secrets" in rule["resources"]:
            assert rule["verbs"] == ["create", "get"], rule


def test_crd_subresources_are_the_ones_granted(inferenceservice_crd):
    """The scale and status grants exist because the CRD has those subresources."""
    (version,) = [v for v in inferenceservice_crd["spec"]["versions"] if v.get("storage")]
    assert set(version["subresources"]) == {"status", "scale"}
    plural_name = inferenceservice_crd["spec"]["names"]["plural"]
    for sub in version["subresources"]:
        assert ("pagoda.dev", f"{plural_name}/{sub}") in EXTRA_GRANTS


def _tiny(namespace: str = "default") -> tuple[dict, object]:
    from pagoda_operator.validation import check

    body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "t", "namespace": namespace, "uid": "u"},
            "spec": {"model": {"builtinTiny": True}}}
    checked = check(body)
    assert checked.ok, checked.problems
    return body, checked.spec


def router_role_grants() -> dict[tuple[str, str], set[str]]:
    """What the Role the operator renders for a router grants."""
    body, spec = _tiny()
    (role,) = [o for o in render.render(body, spec) if o["kind"] == "Role"]
    return grants(role["rules"])


def test_router_role_is_read_only_endpointslices():
    # `pagoda route --k8s-service` lists and watches the engine Service's EndpointSlices, nothing else.
    assert router_role_grants() == {("discovery.k8s.io", "endpointslices"): READ}


def test_router_grant_is_held_exactly_where_children_are_written(installed):
    """The endpointslices rule sits in the role that writes the children, so it is bound cluster-wide
    or in each watched namespace alike: wherever the operator creates a router's Role."""
    holding = {o["metadata"]["name"] for o in installed if o["kind"] in ("Role", "ClusterRole")
               and ("discovery.k8s.io", "endpointslices") in grants(o["rules"])}
    writing = {o["metadata"]["name"] for o in installed if o["kind"] in ("Role", "ClusterRole")
               and ("rbac.authorization.k8s.io", "roles") in grants(o["rules"])}
    assert holding == writing and len(holding) == 1


def test_installers_create_no_router_accounts(installed):
    """The operator creates each router's account beside its InferenceService; an installer-made
    account in chosen namespaces would be the per-namespace setup this design removes."""
    assert [o["metadata"]["name"] for o in installed if o["kind"] == "ServiceAccount"] == ["pagoda-operator"]
    assert not [o for o in installed if o["kind"] == "Role"]


@pytest.mark.parametrize("namespace", ["default", "team-z"])
def test_rendered_router_runs_as_its_own_account_in_its_namespace(namespace):
    body, spec = _tiny(namespace)
    out = {(o["kind"], o["metadata"]["name"]): o for o in render.render(body, spec)}
    account = out[("ServiceAccount", "t-router")]
    assert account["metadata"]["namespace"] == namespace
    assert out[("Deployment", "t")]["spec"]["template"]["spec"]["serviceAccountName"] == "t-router"
    binding = out[("RoleBinding", "t-router")]
    assert binding["metadata"]["namespace"] == namespace
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "t-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "t-router", "namespace": namespace}]
    assert out[("Role", "t-router")]["metadata"]["namespace"] == namespace

"""The NetworkPolicies the operator renders per InferenceService select what they mean: the
engine policy's pods are the rendered engine pods (Deployment and LeaderWorkerSet leaders and
workers alike), its peers are the service's router pods, its own engine pods, the operator's pod
as the chart and kustomize install it (in its namespace) and Prometheus; the router policy takes
any pod of the cluster. Matching follows the NetworkPolicy API: a peer with a podSelector alone
means pods of the policy's namespace; with a namespaceSelector, pods of the namespaces it selects.
"""

from __future__ import annotations

import pytest
import yaml
from packaging_support import CHART_DIR, EXAMPLES_DIR, KUSTOMIZE_DIR, load_yaml_stream
from pod_security import pod_templates

render = pytest.importorskip("pagoda_operator.render", reason="the operator package is not installed")
from pagoda_operator.validation import check  # noqa: E402  (after the skip above)

EXAMPLES = sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml"))
NAMESPACE = "team-a"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"matchExpressions are not used: {selector}"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def namespace_labels(name: str, **extra: str) -> dict[str, str]:
    """A namespace's labels: the API server sets kubernetes.io/metadata.name on every one."""
    return {"kubernetes.io/metadata.name": name, **extra}


def admitted(policy: dict, pod_labels: dict[str, str], pod_namespace: dict[str, str], port: int) -> bool:
    """Does `policy` let a pod (its labels, its namespace's labels) reach the pods it selects on `port`?"""
    policy_namespace = policy["metadata"]["namespace"]
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports is not None and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
            continue
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                namespace_ok = selects(peer["namespaceSelector"], pod_namespace)
            else:
                namespace_ok = pod_namespace["kubernetes.io/metadata.name"] == policy_namespace
            if namespace_ok and selects(peer.get("podSelector", {}), pod_labels):
                return True
    return False


def children(filename: str, peers=None, **spec_changes) -> list[dict]:
    body = yaml.safe_load((EXAMPLES_DIR / filename).read_text())
    body["metadata"].update(namespace=NAMESPACE, uid="u")
    body["spec"].update(spec_changes)
    checked = check(body)
    assert checked.renderable, checked.problems
    return render.render(body, checked.spec, None, peers)


def policies(manifests: list[dict]) -> dict[str, dict]:
    return {m["metadata"]["labels"]["app.kubernetes.io/component"]: m for m in manifests if m["kind"] == "NetworkPolicy"}


def pods_of(manifests: list[dict], component: str) -> list[dict[str, str]]:
    """The labels of every pod template of the component's workloads."""
    return [pod["metadata"]["labels"] for m in manifests for _, pod in pod_templates(m)
            if pod["metadata"]["labels"]["app.kubernetes.io/component"] == component]


def chart_operator_pod() -> tuple[dict[str, str], dict[str, str]]:
    """(labels, environment) of the operator's pod from the chart, as kustomize installs it too."""
    (deployment,) = [o for o in load_yaml_stream((KUSTOMIZE_DIR / "base" / "operator.yaml").read_text())
                     if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return pod["metadata"]["labels"], {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("filename", EXAMPLES)
def test_the_engine_policy_selects_the_engine_pods_and_admits_only_its_peers(filename):
    manifests = children(filename)
    policy = policies(manifests)["engine"]
    engines, routers = pods_of(manifests, "engine"), pods_of(manifests, "router")
    assert engines and routers
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for engine in engines:
        assert selects(policy["spec"]["podSelector"], engine)
    here = namespace_labels(NAMESPACE)
    port = render.ENGINE_PORT
    for router in routers:
        assert admitted(policy, router, here, port)
        assert not admitted(policy, router, here, 6379)  # the HTTP port only
    # Engine pods reach each other on any port: rendezvous, NCCL and KV transfers pick theirs at run time.
    for engine in engines:
        assert admitted(policy, engine, here, port) and admitted(policy, engine, here, 40123)
    # A future endpoint picker of the service, by its component label.
    picker = {**routers[0], "app.kubernetes.io/component": render.ENDPOINT_PICKER_COMPONENT}
    assert admitted(policy, picker, here, port)
    other = {**routers[0], "app.kubernetes.io/instance": "other"}
    if any(m["kind"] == "InferencePool" for m in manifests):
        # router.mode: gateway: the gateway's data plane, wherever it runs, sends requests to the
        # engines' HTTP port; the KV events only the service's picker reads.
        for pod, where in ((other, here), ({"app": "client"}, here), (routers[0], namespace_labels("team-b"))):
            assert admitted(policy, pod, where, port)
            assert not admitted(policy, pod, where, render.KV_EVENTS_PORT)
        assert admitted(policy, picker, here, render.KV_EVENTS_PORT)
        return
    # Not another service's router, not a client pod, not the router of this name in another namespace.
    assert not admitted(policy, other, here, port)
    assert not admitted(policy, {"app": "client"}, here, port)
    assert not admitted(policy, routers[0], namespace_labels("team-b"), port)


def test_the_router_policy_admits_any_pod_of_the_cluster_on_its_port():
    manifests = children("tiny-cpu.yaml")
    policy = policies(manifests)["router"]
    for router in pods_of(manifests, "router"):
        assert selects(policy["spec"]["podSelector"], router)
    assert not any(selects(policy["spec"]["podSelector"], e) for e in pods_of(manifests, "engine"))
    for namespace in (namespace_labels(NAMESPACE), namespace_labels("ingress-nginx")):
        assert admitted(policy, {"app.kubernetes.io/name": "ingress-nginx"}, namespace, render.ROUTER_PORT)
    assert not admitted(policy, {}, namespace_labels(NAMESPACE), 9999)


def test_the_operator_installed_by_the_chart_and_kustomize_reaches_the_engines():
    labels, env = chart_operator_pod()
    # The operator's namespace comes from its pod (POD_NAMESPACE), the Prometheus selectors from the chart's values.
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    peers = render.NetworkPeers.from_env({"POD_NAMESPACE": "pagoda-system", **{k: v for k, v in env.items() if isinstance(v, str)}})
    policy = policies(children("llama-3.1-8b.yaml", peers))["engine"]
    assert admitted(policy, labels, namespace_labels("pagoda-system"), render.ENGINE_PORT)
    # The same labels in another namespace are not the operator.
    assert not admitted(policy, labels, namespace_labels("team-b"), render.ENGINE_PORT)
    # Prometheus as the Prometheus operator runs it, in the namespace the chart's values name.
    prometheus = {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"}
    assert admitted(policy, prometheus, namespace_labels("monitoring"), render.ENGINE_PORT)
    assert not admitted(policy, prometheus, namespace_labels("team-b"), render.ENGINE_PORT)


def test_prometheus_selectors_are_set_per_installation_and_checked():
    peers = render.NetworkPeers.from_env({"PAGODA_OPERATOR_NAMESPACE": "ops",
                                          "PAGODA_PROMETHEUS_NAMESPACE_SELECTOR": "team=observability",
                                          "PAGODA_PROMETHEUS_POD_SELECTOR": "app=prom, role=scraper"})
    policy = policies(children("tiny-cpu.yaml", peers))["engine"]
    observability = namespace_labels("obs", team="observability")
    assert admitted(policy, {"app": "prom", "role": "scraper"}, observability, render.ENGINE_PORT)
    assert not admitted(policy, {"app": "prom"}, observability, render.ENGINE_PORT)
    assert admitted(policy, dict(render.OPERATOR_POD_LABELS), namespace_labels("ops"), render.ENGINE_PORT)
    # Empty: Prometheus pods of that label in any namespace.
    anywhere = render.NetworkPeers.from_env({"PAGODA_PROMETHEUS_NAMESPACE_SELECTOR": ""})
    policy = policies(children("tiny-cpu.yaml", anywhere))["engine"]
    assert admitted(policy, {"app.kubernetes.io/name": "prometheus"}, namespace_labels("elsewhere"), render.ENGINE_PORT)
    for variable, value in (("PAGODA_PROMETHEUS_POD_SELECTOR", "app"), ("PAGODA_PROMETHEUS_NAMESPACE_SELECTOR", "a=b c"),
                            ("PAGODA_OPERATOR_NAMESPACE", "Ops_Team")):
        with pytest.raises(ValueError, match=variable):
            render.NetworkPeers.from_env({variable: value})


def test_spec_network_policy_false_renders_none():
    assert policies(children("tiny-cpu.yaml", networkPolicy=False)) == {}


def test_the_chart_passes_its_prometheus_values_as_selectors(helm):
    # Helm merges maps with the defaults: null removes the default's key.
    values = {"networkPolicy": {"prometheus": {"namespaceSelector": {"team": "obs", "kubernetes.io/metadata.name": "mon"},
                                               "podSelector": {"app.kubernetes.io/name": None}}}}
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values, name="pagoda", namespace="pagoda-system")
    (deployment,) = [o for name, text in rendered.items() if name.endswith(".yaml")
                     for o in load_yaml_stream(text) if o["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["PAGODA_PROMETHEUS_NAMESPACE_SELECTOR"] == "kubernetes.io/metadata.name=mon,team=obs"
    assert env["PAGODA_PROMETHEUS_POD_SELECTOR"] == ""
    peers = render.NetworkPeers.from_env(env)
    assert dict(peers.prometheus_namespace_labels) == {"team": "obs", "kubernetes.io/metadata.name": "mon"}
    assert peers.prometheus_pod_labels == ()

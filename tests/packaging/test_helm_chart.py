"""The Helm chart charts/pagoda: its values schema, and what Helm's own engine renders from it.

Rendering and linting go through helm-python-sdk, which embeds Helm's Go SDK (the same template
engine and schema check as the `helm` binary, which cannot be downloaded here).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml
from packaging_support import CHART_DIR, EXAMPLES_DIR, IMAGES, load_yaml_stream, parse_dockerfile

SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())
VALUES = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
APP_VERSION = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]
RELEASE, NAMESPACE = "pagoda", "pagoda-system"


def render(helm, values: dict | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values or {}, name=name, namespace=namespace)
    return [obj for template, text in sorted(rendered.items()) if template.endswith(".yaml") for obj in load_yaml_stream(text)]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def operator_container(objects: list[dict]) -> dict:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


# --- values and their schema -------------------------------------------------------------------


def test_default_values_satisfy_the_schema():
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.Draft7Validator(SCHEMA).validate(VALUES)


def _schema_at(schema: dict, key: str) -> dict:
    node = schema["properties"][key]
    return SCHEMA["definitions"][node["$ref"].rsplit("/", 1)[1]] if "$ref" in node else node


def _assert_typed(values: dict, schema: dict, path: str) -> None:
    assert schema.get("additionalProperties") is False, f"{path or '<root>'} accepts unknown keys"
    for key, value in values.items():
        assert key in schema.get("properties", {}), f"{path}.{key} has no schema"
        node = _schema_at(schema, key)
        assert "type" in node, f"{path}.{key} has no type"
        if isinstance(value, dict) and "properties" in node:
            _assert_typed(value, node, f"{path}.{key}")


def test_every_value_is_typed_and_unknown_keys_are_refused():
    _assert_typed(VALUES, SCHEMA, "")


BAD_VALUES = [
    ({"operator": {"logLevel": "loud"}}, "/operator/logLevel"),
    ({"operator": {"image": {"repository": "", "tag": "x", "pullPolicy": "Always"}}}, "/operator/image/repository"),
    ({"operator": {"image": {"repository": "r", "tag": "x", "pullPolicy": "Sometimes"}}}, "/operator/image/pullPolicy"),
    ({"operator": {"watchNamespaces": ["Not_A_Namespace"]}}, "/operator/watchNamespaces/0"),
    ({"operator": {"healthPort": 80}}, "/operator/healthPort"),
    ({"operator": {"resources": {"limits": {"memory": "lots"}}}}, "/operator/resources/limits/memory"),
    ({"operator": {"replicas": 2}}, "replicas"),
    # Removed: the operator now creates each router's account itself.
    ({"router": {"namespaces": ["default"]}}, "router"),
    ({"monitoring": {"podMonitor": {"enabled": "yes"}}}, "/monitoring/podMonitor/enabled"),
    ({"monitoring": {"podMonitor": {"interval": "soon"}}}, "/monitoring/podMonitor/interval"),
    ({"monitoring": {"grafanaDashboard": {"enabled": "yes"}}}, "/monitoring/grafanaDashboard/enabled"),
    ({"networkPolicy": {"prometheus": {"podSelector": {"app": "not valid!"}}}}, "/networkPolicy/prometheus/podSelector/app"),
    ({"networkPolicy": {"prometheus": {"namespaceSelector": {"bad key!": "x"}}}}, "'bad key!'"),
    ({"networkPolicy": {"egress": True}}, "/networkPolicy"),
    ({"typo": True}, "typo"),
]


@pytest.mark.parametrize("values, where", BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_bad_values_are_refused_by_helm(helm, values, where):
    with helm.Chart.load(CHART_DIR) as chart:
        with pytest.raises(helm.HelmValuesError) as refused:
            chart.validate_schema(values)
        # Helm also refuses to render them (install and template validate first).
        with pytest.raises(helm.HelmError):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert where in str(refused.value)


def test_chart_lints_clean(helm):
    report = helm.lint(CHART_DIR, strict=True, namespace=NAMESPACE, kube_version="v1.34.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


# --- rendered manifests ------------------------------------------------------------------------

VARIANTS = {
    "defaults": {},
    "namespaced": {"operator": {"watchNamespaces": ["team-a", "team-b"], "logLevel": "debug"}},
    "everything": {
        "operator": {
            "image": {"repository": "registry.example/pagoda-operator", "tag": "1.2.3", "pullPolicy": "Always"},
            "imagePullSecrets": [{"name": "regcred"}],
            "extraArgs": ["--log-format=json"],
            "extraEnv": [{"name": "A", "value": "1"}],
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
            "podAnnotations": {"a": "b"},
            "podLabels": {"team": "ml"},
            "priorityClassName": "system-cluster-critical",
            "healthPort": 9090,
            "metricsPort": 9100,
        },
        "serviceAccount": {"name": "custom-sa", "annotations": {"x": "y"}},
        "monitoring": {"podMonitor": {"enabled": True, "interval": "30s", "labels": {"release": "prom"}},
                       "operatorServiceMonitor": {"enabled": True, "interval": "20s", "labels": {"release": "prom"}},
                       "grafanaDashboard": {"enabled": True, "namespace": "monitoring", "labels": {"team": "ml"},
                                            "annotations": {"grafana_folder": "Pagoda"}}},
    },
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_objects_are_valid_kubernetes(helm, validate_manifest, variant):
    objects = render(helm, VARIANTS[variant])
    assert objects
    for obj in objects:
        validate_manifest(obj)
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"


def test_operator_runs_locked_down_with_kopf_probes(helm):
    objects = render(helm)
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objects)
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert container["command"] == ["pagoda-operator", "run"]
    assert container["args"] == ["--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz",
                                 "--metrics-port=8081"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        http = container[probe]["httpGet"]
        assert http["path"] == "/healthz" and ports[http["port"]] == 8080
    assert container["image"] == f"pagoda/operator:{APP_VERSION}"
    assert pod["serviceAccountName"] == "pagoda-operator"


def test_engine_images_reach_the_operator_as_its_defaults(helm):
    """pagoda_operator.render.Images reads these two variables."""
    env = {e["name"]: e.get("value") for e in operator_container(render(helm))["env"]}
    assert env["PAGODA_ENGINE_IMAGE"] == f"pagoda/engine:{APP_VERSION}"
    assert env["PAGODA_ENGINE_CPU_IMAGE"] == f"pagoda/engine-cpu:{APP_VERSION}"
    images = {"gpu": {"repository": "r.example/engine", "tag": "cu13"}, "cpu": {"repository": "r.example/cpu", "tag": "7"}}
    env = {e["name"]: e.get("value") for e in operator_container(render(helm, {"engineImages": images}))["env"]}
    assert (env["PAGODA_ENGINE_IMAGE"], env["PAGODA_ENGINE_CPU_IMAGE"]) == ("r.example/engine:cu13", "r.example/cpu:7")
    operator_render = pytest.importorskip("pagoda_operator.render")
    assert operator_render.Images.from_env(env) == operator_render.Images(engine="r.example/engine:cu13", engine_cpu="r.example/cpu:7")


def test_pod_runs_as_the_uid_the_operator_image_declares(helm):
    """kubelet's runAsNonRoot check and file ownership need the chart and image to agree."""
    user = [i.args for i in parse_dockerfile(IMAGES / "operator.Dockerfile") if i.keyword == "USER"][-1]
    uid, gid = (int(x) for x in user.split(":"))
    (deployment,) = by_kind(render(helm), "Deployment")
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid)


def test_values_reach_the_operator_pod(helm):
    objects = render(helm, VARIANTS["everything"])
    (deployment,) = by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container(objects)
    assert container["image"] == "registry.example/pagoda-operator:1.2.3"
    assert container["imagePullPolicy"] == "Always"
    assert container["args"][-3:] == ["--liveness=http://0.0.0.0:9090/healthz", "--metrics-port=9100", "--log-format=json"]
    assert {"name": "A", "value": "1"} in container["env"]
    assert pod["serviceAccountName"] == "custom-sa"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert deployment["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    (monitor,) = by_kind(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["podMetricsEndpoints"][0]["interval"] == "30s"


def test_all_namespaces_binds_the_operator_role_cluster_wide(helm):
    objects = render(helm)
    bindings = {b["roleRef"]["name"]: b for b in by_kind(objects, "ClusterRoleBinding")}
    assert set(bindings) == {"pagoda-operator", "pagoda-operator-cluster"}
    assert not by_kind(objects, "RoleBinding") or all(
        b["roleRef"]["kind"] == "Role" for b in by_kind(objects, "RoleBinding")
    )
    for binding in bindings.values():
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pagoda-operator", "namespace": NAMESPACE}]


def test_watched_namespaces_get_the_operator_role_only_there(helm):
    objects = render(helm, VARIANTS["namespaced"])
    container = operator_container(objects)
    assert container["args"][:2] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--all-namespaces" not in container["args"] and "--debug" in container["args"]
    cluster_bindings = [b["roleRef"]["name"] for b in by_kind(objects, "ClusterRoleBinding")]
    assert cluster_bindings == ["pagoda-operator-cluster"]
    operator_bindings = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["name"] == "pagoda-operator"]
    assert sorted(b["metadata"]["namespace"] for b in operator_bindings) == ["team-a", "team-b"]
    assert all(b["roleRef"]["kind"] == "ClusterRole" for b in operator_bindings)


def test_pod_monitor_only_when_enabled(helm):
    assert not by_kind(render(helm), "PodMonitor")
    (monitor,) = by_kind(render(helm, {"monitoring": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "pagoda-operator"}


def test_operator_metrics_behind_a_service_and_a_service_monitor_that_honours_their_labels(helm):
    objects = render(helm, VARIANTS["everything"])
    (deployment,) = by_kind(objects, "Deployment")
    ports = {p["name"]: p["containerPort"] for p in operator_container(objects)["ports"]}
    assert ports["metrics"] == 9100
    (service,) = by_kind(objects, "Service")
    assert service["metadata"]["name"] == "pagoda-operator-metrics"
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"}]
    (monitor,) = by_kind(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # The series name the InferenceService they describe (namespace, service): the target's
    # own labels (the operator's namespace and Service) must not replace them.
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "honorLabels": True, "interval": "20s"}]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    # Off by default (the Prometheus operator's CRD may be absent); metricsPort 0 turns it all off.
    assert not by_kind(render(helm), "ServiceMonitor")
    off = render(helm, {"operator": {"metricsPort": 0}, "monitoring": {"operatorServiceMonitor": {"enabled": True}}})
    assert not by_kind(off, "Service") and not by_kind(off, "ServiceMonitor")
    assert not [a for a in operator_container(off)["args"] if a.startswith("--metrics-port")]


def test_grafana_dashboard_only_when_enabled_and_labelled_for_the_sidecar(helm):
    assert not by_kind(render(helm), "ConfigMap")
    (dashboard,) = by_kind(render(helm, {"monitoring": {"grafanaDashboard": {"enabled": True}}}), "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["namespace"] == NAMESPACE
    shipped = json.loads((CHART_DIR / "dashboards" / "pagoda.json").read_text())
    assert json.loads(dashboard["data"]["pagoda.json"]) == shipped
    (elsewhere,) = by_kind(render(helm, {"monitoring": {"grafanaDashboard": {
        "enabled": True, "namespace": "monitoring", "labels": {"team": "ml"},
        "annotations": {"grafana_folder": "Pagoda"}}}}), "ConfigMap")
    assert elsewhere["metadata"]["namespace"] == "monitoring"
    assert {"grafana_dashboard": "1", "team": "ml"}.items() <= elsewhere["metadata"]["labels"].items()
    assert elsewhere["metadata"]["annotations"] == {"grafana_folder": "Pagoda"}


def test_chart_ships_the_generated_crd(helm, inferenceservice_crd):
    with helm.Chart.load(CHART_DIR) as chart:
        shipped = [o for c in chart.crds for o in load_yaml_stream(c["data"])]
    assert inferenceservice_crd in shipped, "charts/pagoda/crds is stale: run `make crds`"


def test_pod_monitor_selects_the_pods_the_operator_renders(helm):
    """The PodMonitor's selector and port name must match the engine and router pods as
    pagoda_operator.render writes them, or Prometheus scrapes nothing."""
    operator_render = pytest.importorskip("pagoda_operator.render")
    from pagoda_operator.validation import check

    (monitor,) = by_kind(render(helm, {"monitoring": {"podMonitor": {"enabled": True}}}), "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    body = yaml.safe_load((EXAMPLES_DIR / "tiny-cpu.yaml").read_text())
    checked = check(body)
    assert checked.ok, checked.problems
    pods = [o["spec"]["template"] for o in operator_render.render(body, checked.spec) if o["kind"] == "Deployment"]
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods} == {"engine", "router"}
    for pod in pods:
        assert selector.items() <= pod["metadata"]["labels"].items()
        assert port in {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}

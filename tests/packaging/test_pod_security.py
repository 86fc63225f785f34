"""Every pod Pagoda runs passes the "restricted" Pod Security Standard: the engine, router and init
containers the operator renders for each example, and the operator's own pod from the Helm chart
and kustomize. The checker (pod_security.py) is proven first to refuse each control's violation."""

from __future__ import annotations

import copy

import pytest
import yaml
from packaging_support import CHART_DIR, EXAMPLES_DIR, KUSTOMIZE_DIR, load_yaml_stream
from pod_security import pod_templates, restricted_violations

render = pytest.importorskip("pagoda_operator.render", reason="the operator package is not installed")
from pagoda_operator.validation import check  # noqa: E402  (after the skip above)

EXAMPLES = sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml"))

COMPLIANT = {
    "metadata": {"labels": {"app": "x"}},
    "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [{"name": "init", "image": "i", "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}],
        "containers": [{"name": "main", "image": "i", "ports": [{"containerPort": 80}], "securityContext": {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}}],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "keys", "secret": {"secretName": "k"}},
                    {"name": "claim", "persistentVolumeClaim": {"claimName": "c"}}],
    },
}


def _main(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


def _init(pod: dict) -> dict:
    return pod["spec"]["initContainers"][0]


# (what is changed, the control that refuses it)
VIOLATIONS = {
    "host-network": (lambda p: p["spec"].update(hostNetwork=True), "host namespaces"),
    "host-pid": (lambda p: p["spec"].update(hostPID=True), "host namespaces"),
    "host-ipc": (lambda p: p["spec"].update(hostIPC=True), "host namespaces"),
    "host-process": (lambda p: p["spec"]["securityContext"].update(windowsOptions={"hostProcess": True}), "HostProcess"),
    "privileged": (lambda p: _main(p)["securityContext"].update(privileged=True), "privileged"),
    "host-path": (lambda p: p["spec"]["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "hostPath volumes"),
    "host-port": (lambda p: _main(p)["ports"][0].update(hostPort=80), "host ports"),
    "apparmor-unconfined": (lambda p: _main(p)["securityContext"].update(appArmorProfile={"type": "Unconfined"}), "AppArmor"),
    "apparmor-annotation": (lambda p: p["metadata"].update(annotations={
        "container.apparmor.security.beta.kubernetes.io/main": "unconfined"}), "AppArmor"),
    "selinux-type": (lambda p: _main(p)["securityContext"].update(seLinuxOptions={"type": "spc_t"}), "SELinux"),
    "selinux-user": (lambda p: p["spec"]["securityContext"].update(seLinuxOptions={"user": "root"}), "SELinux"),
    "proc-mount": (lambda p: _main(p)["securityContext"].update(procMount="Unmasked"), "/proc mount type"),
    "unsafe-sysctl": (lambda p: p["spec"]["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]), "sysctls"),
    "volume-type": (lambda p: p["spec"]["volumes"].append({"name": "n", "nfs": {"server": "s", "path": "/"}}), "volume types"),
    "privilege-escalation": (lambda p: _init(p)["securityContext"].pop("allowPrivilegeEscalation"), "privilege escalation"),
    "privilege-escalation-true": (lambda p: _main(p)["securityContext"].update(allowPrivilegeEscalation=True), "privilege escalation"),
    "root-allowed": (lambda p: p["spec"]["securityContext"].pop("runAsNonRoot"), "running as non-root"),
    "root-container": (lambda p: _main(p)["securityContext"].update(runAsNonRoot=False), "running as non-root"),
    "uid-0-pod": (lambda p: p["spec"]["securityContext"].update(runAsUser=0), "running as non-root user"),
    "uid-0-container": (lambda p: _init(p)["securityContext"].update(runAsUser=0), "running as non-root user"),
    "seccomp-missing": (lambda p: p["spec"]["securityContext"].pop("seccompProfile"), "seccomp"),
    "seccomp-unconfined": (lambda p: _main(p)["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccomp"),
    "capabilities-kept": (lambda p: _init(p)["securityContext"].pop("capabilities"), "capabilities"),
    "capability-added": (lambda p: _main(p)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]), "capabilities"),
}


def test_the_checker_passes_a_restricted_pod():
    assert restricted_violations(COMPLIANT) == []
    # Set on every container instead of the pod, non-root and seccomp pass all the same.
    per_container = copy.deepcopy(COMPLIANT)
    per_container["spec"]["securityContext"] = {}
    for c in [*per_container["spec"]["initContainers"], *per_container["spec"]["containers"]]:
        c["securityContext"].update(runAsNonRoot=True, seccompProfile={"type": "Localhost", "localhostProfile": "p.json"})
    assert restricted_violations(per_container) == []


@pytest.mark.parametrize("violation", VIOLATIONS)
def test_the_checker_refuses_each_violation(violation):
    change, control = VIOLATIONS[violation]
    pod = copy.deepcopy(COMPLIANT)
    change(pod)
    problems = restricted_violations(pod)
    assert any(p.startswith(f"{control}:") for p in problems), problems


def _rendered_pods(body: dict) -> list[tuple[str, dict]]:
    checked = check(body)
    assert checked.renderable, checked.problems
    return [pod for manifest in render.render(body, checked.spec) for pod in pod_templates(manifest)]


def _example(filename: str) -> dict:
    body = yaml.safe_load((EXAMPLES_DIR / filename).read_text())
    body["metadata"].update(namespace="default", uid="u")
    return body


@pytest.mark.parametrize("filename", EXAMPLES)
def test_every_pod_the_operator_renders_for_an_example_is_restricted(filename):
    pods = _rendered_pods(_example(filename))
    assert {where.split("/")[0] for where, _ in pods} >= {"Deployment"}  # the router, and the engine's workload
    for where, pod in pods:
        assert restricted_violations(pod) == [], where


@pytest.mark.parametrize("changes", [
    {"router": {"apiKeySecretRef": {"name": "client-keys"}}},
    {"kvCache": {"tiers": [{"type": "disk", "size": "10Gi", "volume": {"ephemeral": {}}}]}},
    {"engine": {"compileCache": {"persistentVolumeClaim": {"claimName": "kernels"}}}},
    {"model": {"uri": "pvc://weights/llama", "download": {}}},  # no hf:// token for a claim's model
], ids=["client-keys", "disk-tier", "shared-compile-cache", "model-claim"])
def test_pods_with_the_optional_volumes_are_restricted_too(changes):
    body = _example("llama-3.1-8b.yaml")
    for key, value in changes.items():
        body["spec"][key] = {**body["spec"].get(key, {}), **value}
    for where, pod in _rendered_pods(body):
        assert restricted_violations(pod) == [], where


@pytest.mark.parametrize("values", [{}, {"operator": {"watchNamespaces": ["team-a"]}}], ids=["default", "namespaced"])
def test_the_charts_pods_are_restricted(helm, values):
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render(values, name="pagoda", namespace="pagoda-system")
    objects = [o for name, text in rendered.items() if name.endswith(".yaml") for o in load_yaml_stream(text)]
    pods = [pod for o in objects for pod in pod_templates(o)]
    assert pods, "the chart runs no pod"
    for where, pod in pods:
        assert restricted_violations(pod) == [], where


def test_the_kustomize_base_pods_are_restricted():
    # The generated base (its freshness against the chart: test_kustomize.py); the overlays add
    # InferenceServices, whose pods the operator renders (the examples above).
    objects = load_yaml_stream((KUSTOMIZE_DIR / "base" / "operator.yaml").read_text())
    pods = [pod for o in objects for pod in pod_templates(o)]
    assert pods, "the kustomize base runs no pod"
    for where, pod in pods:
        assert restricted_violations(pod) == [], where

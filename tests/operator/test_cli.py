"""`pagoda-operator run` and `crds` as a user runs them: a real process, a kubeconfig, an API
server (the emulator from apiserver.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml

from pagoda_operator import crd
from tests.operator.apiserver import BackgroundApiServer
from tests.operator.support import EXAMPLES_DIR, load_example, write_kubeconfig
from tests.operator.test_operator_kmock import NS, TINY_CHILDREN, children_of, conditions, create, get, wait_for

CLI = [sys.executable, "-m", "pagoda_operator.cli"]


@pytest.fixture
def apiserver():
    server = BackgroundApiServer()
    yield server
    server.close()


def test_run_reconciles_with_the_kubeconfig_it_is_given(apiserver, tmp_path):
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PAGODA_ENGINE_CPU_IMAGE": "registry.example/engine-cpu:1"}
    operator = subprocess.Popen([*CLI, "run", "--all-namespaces", "--standalone", "--quiet"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        body = load_example("tiny-cpu.yaml")
        body["metadata"] = {"name": "cli", "namespace": NS}
        create(apiserver, body)
        children = wait_for("children", lambda: len(children_of(apiserver, "cli")) == TINY_CHILDREN and children_of(apiserver, "cli"), timeout=60)
        pod = children[("Deployment", "cli-engine")]["spec"]["template"]["spec"]
        assert pod["containers"][0]["image"] == "registry.example/engine-cpu:1"
        wait_for("status", lambda: conditions(get(apiserver, ("pagoda.dev", "v1alpha1", "inferenceservices"), "cli")).get("Validated"))
        # The token from the kubeconfig reached the API server on the operator's own requests.
        assert any(req.headers.get("Authorization") == "Bearer unused" and "apply-patch" in req.headers.get("Content-Type", "")
                   for req in list(apiserver.api._requests))
    finally:
        operator.send_signal(signal.SIGTERM)
        try:
            output, _ = operator.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            operator.kill()
            output, _ = operator.communicate()
    assert operator.returncode == 0, output


def test_crds_writes_both_directories_and_check_detects_staleness(tmp_path):
    out, chart = tmp_path / "crds", tmp_path / "chart-crds"
    subprocess.run([*CLI, "crds", "--out", str(out), "--chart", str(chart)], check=True, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["inferenceservices.pagoda.dev.yaml", "kustomization.yaml"]
    assert sorted(p.name for p in chart.iterdir()) == ["inferenceservices.pagoda.dev.yaml"]
    assert yaml.safe_load((out / crd.CRD_FILENAME).read_text()) == crd.crd()
    check = [*CLI, "crds", "--out", str(out), "--chart", str(chart), "--check"]
    assert subprocess.run(check, capture_output=True).returncode == 0
    (chart / crd.CRD_FILENAME).write_text("stale\n")
    result = subprocess.run(check, capture_output=True, text=True)
    assert result.returncode == 1 and "stale:" in result.stderr and "chart-crds" in result.stderr


def test_render_reports_a_file_without_an_inference_service(tmp_path):
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    result = subprocess.run([*CLI, "render", "-f", str(path)], capture_output=True, text=True)
    assert result.returncode == 2 and "no InferenceService (pagoda.dev/v1alpha1)" in result.stderr


@pytest.mark.parametrize("verb", [["render", "-f", str(EXAMPLES_DIR / "tiny-cpu.yaml")], ["run", "--standalone"]], ids=["render", "run"])
def test_a_bad_network_peer_setting_stops_the_command_naming_the_variable(verb):
    env = {**os.environ, "PAGODA_PROMETHEUS_POD_SELECTOR": "app.kubernetes.io/name"}  # no =value
    result = subprocess.run([*CLI, *verb], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert f"pagoda-operator {verb[0]}: PAGODA_PROMETHEUS_POD_SELECTOR: 'app.kubernetes.io/name' is not a label equality" in result.stderr


def test_render_uses_the_installations_network_peers():
    env = {**os.environ, "POD_NAMESPACE": "ops", "PAGODA_PROMETHEUS_NAMESPACE_SELECTOR": "team=obs"}
    result = subprocess.run([*CLI, "render", "-f", str(EXAMPLES_DIR / "tiny-cpu.yaml")], capture_output=True, text=True, env=env,
                            check=True)
    (policy,) = [d for d in yaml.safe_load_all(result.stdout) if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "tiny-engine"]
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"] if "namespaceSelector" in peer]
    assert [p["namespaceSelector"]["matchLabels"] for p in peers] == [{"kubernetes.io/metadata.name": "ops"}, {"team": "obs"}]

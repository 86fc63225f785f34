"""e2e/cluster/run.sh runs only where a cluster exists; here its syntax and its refusals are checked:
it must stop early, with a message that says what is wrong, before touching any cluster."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest
from packaging_support import ROOT

SCRIPT = ROOT / "e2e" / "cluster" / "run.sh"


def run_script(env_overrides: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "PAGODA_E2E_"))}
    env.update(env_overrides)
    return subprocess.run(["bash", str(SCRIPT)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_script_is_valid_bash_with_strict_mode():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    assert "set -euo pipefail" in SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK), "run.sh must be executable"


def test_refuses_to_run_without_a_kubeconfig(tmp_path):
    result = run_script({}, tmp_path)
    assert result.returncode != 0
    assert "KUBECONFIG" in result.stderr


def test_refuses_an_unknown_installer(tmp_path):
    result = run_script({"KUBECONFIG": str(tmp_path / "none"), "PAGODA_E2E_INSTALLER": "ansible"}, tmp_path)
    assert result.returncode != 0
    assert "must be kustomize or helm, not 'ansible'" in result.stderr


def test_stops_with_a_clear_message_when_the_cluster_is_unreachable(kubectl, tmp_path):
    if not (ROOT / "crds" / "kustomization.yaml").exists() or not (ROOT / "examples" / "tiny-cpu.yaml").exists():
        pytest.skip("crds/ and examples/tiny-cpu.yaml are not generated yet")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:{port}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""
    )
    result = run_script({"KUBECONFIG": str(kubeconfig)}, tmp_path)
    assert result.returncode == 1
    assert f"cannot reach the cluster of KUBECONFIG={kubeconfig}" in result.stderr
    assert "installing" not in result.stderr, "it must not start installing"

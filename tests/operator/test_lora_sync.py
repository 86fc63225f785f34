"""spec.loras at run time (loras.py) against a real `pagoda serve` (the built-in tiny Llama with
two PEFT adapters written by PEFT, runtime updating on, the internal key required): the sync
loads what the engine lacks, reloads what moved, unloads what the spec dropped, reports the
engine's refusal, and through the operator (kopf on the emulated API server, the engine pod's
address in its Pod object) a changed spec.loras reaches the engine and status.loras without
touching the pod template. One engine for the module."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))
from pagoda_e2e import free_port, start_engine  # noqa: E402

from lora_adapters import ADAPTERS, write_adapter  # noqa: E402
from pagoda_engine.tiny import build_tiny_model  # noqa: E402
from pagoda_operator import loras, render  # noqa: E402

KEY = "internal-key-of-the-test"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-sync")
    model_dir = build_tiny_model(root / "model", arch="llama", seed=3)
    paths = {name: write_adapter(model_dir, root / name, *ADAPTERS[name], seed=i + 1)
             for i, name in enumerate(("qv", "mlp"))}
    port = free_port()
    proc = start_engine(port, root / "serve.log", env={"PAGODA_ALLOW_RUNTIME_LORA_UPDATING": "1", "PAGODA_API_KEY": KEY},
                        extra=["--model", str(model_dir), "--served-model-name", "base", "--dtype", "float32",
                               "--num-kv-pages", "256", "--max-model-len", "256", "--enable-lora", "--max-loras", "2",
                               "--max-lora-rank", "16", "--lora-modules", f"started={paths['qv']}"])
    yield f"http://127.0.0.1:{port}", port, paths, root
    proc.stop()


def served(url: str) -> dict[str, str]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
        return {m.id: m.root for m in client.models.list().data if getattr(m, "parent", None)}


def complete(url: str, model: str) -> str:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client:
        return client.completions.create(model=model, prompt="hello", max_tokens=2, temperature=0).model


async def test_the_sync_makes_the_engine_serve_exactly_the_adapters_asked_for(engine):
    url, _, paths, root = engine
    async with httpx.AsyncClient(timeout=60) as http:
        assert await loras.sync_engine(http, url, KEY, {"started": paths["qv"], "added": paths["mlp"]}) == \
            {"started": None, "added": None}
        assert served(url) == {"started": paths["qv"], "added": paths["mlp"]}
        assert complete(url, "added") == "added"
        # Another path under a name it serves: unloaded, then loaded from there.
        assert await loras.sync_engine(http, url, KEY, {"started": paths["qv"], "added": paths["qv"]}) == \
            {"started": None, "added": None}
        assert served(url) == {"started": paths["qv"], "added": paths["qv"]}
        # Dropped from the spec: unloaded; one the engine refuses: its reason.
        missing = str(root / "no-such-adapter")
        outcome = await loras.sync_engine(http, url, KEY, {"added": paths["mlp"], "broken": missing})
        assert outcome["added"] is None
        assert outcome["broken"].startswith("400: ") and "broken" in outcome["broken"], outcome
        assert served(url) == {"added": paths["mlp"]}
        with pytest.raises(httpx.HTTPStatusError):  # the engine's key is required
            await loras.sync_engine(http, url, "not-the-key", {})


def test_a_changed_spec_reaches_the_engine_and_the_status_without_a_restart(engine):
    from tests.operator.apiserver import BackgroundApiServer
    from tests.operator.test_operator_kmock import (DEPLOYMENTS, IS, NS, SECRETS, Operator, create, get, patch_spec,
                                                    path_of, request, status_of, wait_for)

    url, port, paths, _ = engine
    apiserver = BackgroundApiServer()
    operator = Operator(apiserver, lora_sync_seconds=0.5)
    operator.start()
    try:
        # The internal key the engine was started with (the operator keeps a Secret that exists).
        request(apiserver, "POST", path_of(SECRETS), {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": render.internal_key_secret_name("ls"), "namespace": NS},
            "data": {render.INTERNAL_KEY_SECRET_KEY: base64.b64encode(KEY.encode()).decode()}})
        body = {"apiVersion": "pagoda.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "ls", "namespace": NS},
                "spec": {"model": {"builtinTiny": True, "name": "base"}, "resources": {"gpusPerPod": 0},
                         "engine": {"maxLoras": 2},
                         "loras": [{"name": "first", "uri": f"file://{paths['mlp']}"}],
                         "monitoring": {"serviceMonitor": False}}}
        create(apiserver, body)
        template = wait_for("the engine", lambda: get(apiserver, DEPLOYMENTS, "ls-engine"))["spec"]["template"]
        # Its pod, ready, at the engine's address (the one ready pod of the service).
        pod_labels = template["metadata"]["labels"]
        request(apiserver, "POST", path_of(("", "v1", "pods")), {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ls-engine-0", "namespace": NS, "labels": pod_labels},
            "spec": {"containers": [{"name": "engine", "image": "x",
                                     "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}]}})
        request(apiserver, "PATCH", path_of(("", "v1", "pods"), "ls-engine-0", "status"), {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}},
            "application/merge-patch+json")

        def loras_status() -> list | None:
            return status_of(apiserver, "ls").get("loras")

        assert wait_for("first served", lambda: (s := loras_status()) and s[0].get("readyReplicas") == 1 and s) == [
            {"name": "first", "uri": f"file://{paths['mlp']}", "readyReplicas": 1}]
        assert served(url)["first"] == paths["mlp"]

        patch_spec(apiserver, "ls", {"loras": [{"name": "second", "uri": f"file://{paths['qv']}"}]})
        wait_for("second served", lambda: [e["name"] for e in loras_status() or [] if e.get("readyReplicas") == 1] == ["second"])
        assert served(url) == {"second": paths["qv"]}  # first unloaded, and the engine's own adapters too
        assert get(apiserver, DEPLOYMENTS, "ls-engine")["spec"]["template"] == template  # no restart
        assert get(apiserver, IS, "ls")
    finally:
        operator.stop()
        apiserver.close()

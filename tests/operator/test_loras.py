"""spec.loras: LoRA adapters rendered as the engine's flags (`--enable-lora --lora-modules
name=path`, `--max-loras`, `--max-lora-rank` from spec.engine) with their volumes (an init
container per hf:// or s3:// adapter, as the model's; a pvc:// adapter's claim mounted once) and
PAGODA_ALLOW_RUNTIME_LORA_UPDATING, read back by the real `pagoda serve` configuration; and the
refusals."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest

from pagoda_engine import serve
from pagoda_engine.config import config_from_args
from pagoda_engine.lora import parse_lora_modules
from pagoda_operator import loras, render
from pagoda_operator.conditions import model_download_failure
from pagoda_operator.validation import check
from tests.operator.support import load_example, with_spec
from tests.operator.test_engine_contract import _parser, pod_args

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-loras.yaml"


def _body(**spec_changes) -> dict:
    return with_spec(load_example("tiny-loras.yaml", namespace="team-a", uid="u"), **spec_changes)


def _engine(body: dict) -> tuple[dict, dict]:
    """(the engine pod's spec, its engine container) of a valid body."""
    checked = check(body)
    assert checked.ok, checked.problems
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render.render(body, checked.spec)}
    for manifest in objects.values():
        kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    pod = objects[("Deployment", f"{body['metadata']['name']}-engine")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def _config(container: dict):
    return config_from_args(_parser(serve.add_arguments).parse_args(pod_args(container, "engine")))


def test_adapters_on_a_claim_become_the_engines_lora_flags_and_one_mount():
    pod, container = _engine(_body())
    config = _config(container)
    assert config.model.enable_lora and (config.model.max_loras, config.model.max_lora_rank) == (2, 8)
    # Loaded at run time by the operator (loras.py), so the template does not name them.
    assert not config.model.lora_modules
    assert loras.wanted_adapters(check(_body()).spec) == {"tiny-sql": "/lora-claims/tiny-adapters/sql",
                                                          "tiny-chat": "/lora-claims/tiny-adapters/chat"}
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"name": "lora-pvc-tiny-adapters",
                       "persistentVolumeClaim": {"claimName": "tiny-adapters", "readOnly": True}}]
    assert {"name": "lora-pvc-tiny-adapters", "mountPath": "/lora-claims/tiny-adapters", "readOnly": True} in container["volumeMounts"]
    assert {"name": render.LORA_RUNTIME_ENV, "value": "1"} in container["env"]
    assert "initContainers" not in pod


def test_hf_and_s3_adapters_are_downloaded_where_the_engine_reads_them():
    adapters = [{"name": "sql", "uri": "hf://org/sql-lora@v2"}, {"name": "fin", "uri": "s3://bucket/adapters/fin"},
             {"name": "local", "uri": "file:///opt/adapters/local"}]
    pod, container = _engine(_body(loras=adapters))
    # The downloaded ones start with the engine; file:// is loaded at run time, as pvc:// is.
    paths = {m.name: m.path for m in parse_lora_modules(_config(container).model.lora_modules)}
    assert paths == {"sql": "/loras/org/sql-lora", "fin": "/loras/bucket/adapters/fin"}
    assert loras.wanted_adapters(check(_body(loras=adapters)).spec)["local"] == "/opt/adapters/local"
    hf, s3 = pod["initContainers"]
    assert hf["name"] == "lora-download-0" and s3["name"] == "lora-download-1"
    env = {e["name"]: e.get("value") for e in hf["env"]}
    assert (env["MODEL_REPO"], env["MODEL_REVISION"], env["MODEL_DIR"]) == ("org/sql-lora", "v2", paths["sql"])
    assert s3["command"][3:5] == ["s3://bucket/adapters/fin", paths["fin"]]
    for init in (hf, s3):
        assert init["volumeMounts"][0] == {"name": "lora-cache", "mountPath": render.LORAS_DIR}
    assert {"name": "lora-cache", "mountPath": render.LORAS_DIR, "readOnly": True} in container["volumeMounts"]


def test_a_failed_adapter_download_shows_as_the_models_does():
    failed = {"name": "lora-download-1", "state": {"terminated": {"exitCode": 1, "message": "no such repo org/x\n"}}}
    pod = {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [failed]}}
    assert model_download_failure([pod]) == "pod p: lora-download-1 exited 1: no such repo org/x"


def test_adapters_with_speculative_decoding_render_both_and_the_engine_takes_them():
    body = _body()
    body["spec"]["engine"]["speculative"] = {"method": "ngram", "numSpeculativeTokens": 3}
    _, container = _engine(body)
    config = _config(container)  # the engine's own validation of the pair
    assert config.model.enable_lora
    assert (config.speculative_config.method, config.speculative_config.num_speculative_tokens) == ("ngram", 3)


def test_without_adapters_no_lora_flag_is_rendered():
    _, container = _engine(_body(loras=[], engine={}))  # no adapters: no LoRA at all
    assert not _config(container).model.enable_lora
    assert render.LORA_RUNTIME_ENV not in {e["name"] for e in container["env"]}


@pytest.mark.parametrize("changes, says", [
    ({"loras": [{"name": "a", "uri": "pvc://c/a"}, {"name": "a", "uri": "pvc://c/b"}]}, "loras: the name 'a' is given twice"),
    ({"loras": [{"name": "tiny", "uri": "pvc://c/a"}]}, "loras: 'tiny' is model.name"),
    ({"loras": [], "engine": {"maxLoras": 2}}, "engine.maxLoras: needs spec.loras"),
    ({"engine": {"extraArgs": ["--max-loras", "3"]}}, "engine.extraArgs --max-loras: set engine.maxLoras instead"),
    ({"engine": {"extraArgs": ["--lora-modules", "x=/y"]}}, "engine.extraArgs --lora-modules: set spec.loras instead"),
    ({"engine": {"apiServerCount": 2}}, "loras: engine.apiServerCount 2"),
    ({"loras": [{"name": "a", "uri": "ftp://x/y"}]}, "spec.loras[0].uri"),
])
def test_what_the_engine_cannot_serve_is_refused_naming_the_field(changes, says):
    body = _body()
    for key, value in changes.items():
        body["spec"][key] = copy.deepcopy(value)
    checked = check(body)
    assert not checked.ok and any(says in p for p in checked.problems), checked.problems

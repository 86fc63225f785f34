"""An s3:// model: the spec that asks for one, the init container that downloads it into the
model cache, and the engine that reads it from there. (The downloader itself runs against a real
S3 server in tests/engine/test_s3_download.py, from the command line rendered here.)"""

from __future__ import annotations

import kubernetes_validate
import pytest

from pagoda_operator import render as r
from pagoda_operator.validation import check
from tests.operator.support import load_example, with_spec
from tests.operator.test_render import K8S_VERSION, engine_container, rendered

URI = "s3://acme-models/llama/3.1-8b-instruct"


def s3_service(**download) -> dict:
    body = with_spec(load_example("llama-3.1-8b.yaml"), model__uri=URI, model__download=download or None)
    return body


def engine_pod(body: dict) -> dict:
    return rendered(body)[("Deployment", "llama-8b-engine")]["spec"]["template"]


def test_an_s3_model_is_downloaded_by_an_init_container_into_the_model_cache():
    template = engine_pod(s3_service(s3SecretRef={"name": "minio-reader"}, retries=5, timeoutSeconds=900))
    pod, engine = template["spec"], engine_container(template)
    (init,) = pod["initContainers"]
    assert init["name"] == "model-download" and init["image"] == engine["image"]
    assert init["command"] == ["python", "-m", "pagoda_engine.s3_download", URI, "/models/acme-models/llama/3.1-8b-instruct",
                               "--retries", "5", "--attempt-timeout", "900"]
    # where it downloads is where the engine reads
    assert engine["args"][engine["args"].index("--model") + 1] == init["command"][4]
    assert init["env"] == [
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "minio-reader", "key": "AWS_ACCESS_KEY_ID"}}},
        {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "minio-reader",
                                                                         "key": "AWS_SECRET_ACCESS_KEY"}}},
        *({"name": key, "valueFrom": {"secretKeyRef": {"name": "minio-reader", "key": key, "optional": True}}}
          for key in ("AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION")),
    ]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # the model cache, and /tmp: the root filesystem is read-only (`render.WRITABLE_DIRS`)
    assert init["volumeMounts"] == [{"name": "model-cache", "mountPath": "/models"}, {"name": "tmp", "mountPath": "/tmp"}]
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/models", "readOnly": True} in engine["volumeMounts"]
    kubernetes_validate.validate(rendered(s3_service(s3SecretRef={"name": "minio-reader"}))[
        ("Deployment", "llama-8b-engine")], K8S_VERSION, strict=True)


def test_an_hf_download_also_hands_its_last_line_to_the_pod_status():
    # conditions.model_download_failure reads it from there into the Ready condition.
    (init,) = engine_pod(load_example("llama-3.1-8b.yaml"))["spec"]["initContainers"]
    assert init["command"][:2] == ["sh", "-c"] and init["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_without_a_secret_the_download_runs_as_the_pods_service_account():
    template = engine_pod(s3_service())
    (init,) = template["spec"]["initContainers"]
    assert "env" not in init  # boto3's chain: the service account's role (IRSA, Pod Identity)
    assert init["command"][-4:] == ["--retries", "3", "--attempt-timeout", "3600"]


def test_a_cache_claim_keeps_an_s3_download_across_pods():
    pod = engine_pod(s3_service(cacheClaimName="model-cache"))["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in pod["volumes"]


@pytest.mark.parametrize("uri, path", [
    ("s3://acme-models", "/models/acme-models"),
    ("s3://acme-models/", "/models/acme-models"),
    ("s3://acme.models-2/a/b/", "/models/acme.models-2/a/b"),
])
def test_the_model_path_is_the_bucket_and_prefix_below_the_cache(uri, path):
    body = with_spec(load_example("llama-3.1-8b.yaml"), model__uri=uri, model__download=None)
    assert r.model_path(check(body).spec) == path


@pytest.mark.parametrize("changes, problem", [
    ({"model__uri": "s3://Acme_Models/x"}, "spec.model.uri"),
    ({"model__uri": "s3://ab/x"}, "spec.model.uri"),  # a bucket name has 3 characters at least
    ({"model__uri": URI, "model__download": {"tokenSecretRef": {"name": "hf-token"}}},
     "model.download.tokenSecretRef: only an hf:// model is downloaded with it"),
    ({"model__uri": "hf://org/model", "model__download": {"s3SecretRef": {"name": "s3"}}},
     "model.download.s3SecretRef: only an s3:// model is downloaded with it"),
    ({"model__uri": "pvc://weights", "model__download": {"s3SecretRef": {"name": "s3"}}},
     "model.download.s3SecretRef: only an s3:// model is downloaded with it"),
    ({"model__uri": URI, "model__download": {"s3SecretRef": {"name": "Not_A_Name"}}}, "s3SecretRef.name"),
])
def test_a_wrong_s3_spec_is_refused_naming_the_field(changes, problem):
    checked = check(with_spec(load_example("llama-3.1-8b.yaml"), **changes))
    assert any(problem in p for p in checked.problems), checked.problems

"""Property-based fuzzing with schemathesis, driven by the OpenAPI schema each server publishes:
against a real `pagoda serve` and a real `pagoda route` in front of it, generated requests
(valid ones, and ones that break the schema) never get a 5xx or a broken connection, and every
response has a documented status and content type and matches its documented schema.

Bounded: EXAMPLES generated requests per operation and server (4 POST operations x 2 servers),
about 20 s on a 2-core machine."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from conftest import DEFAULT_ARGS, launch
from pagoda_e2e import free_port, start_router

EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # A short context keeps every valid request cheap to serve.
    srv = launch(tmp_path_factory.mktemp("serve"), *DEFAULT_ARGS, "--max-model-len", "32")
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def router_url(engine, tmp_path_factory):
    port = free_port()
    proc = start_router(port, [engine.url], tmp_path_factory.mktemp("route") / "route.log",
                        ["--health-interval", "0.5"])
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/v1/models", timeout=30)
    yield url
    proc.stop()


_fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def fuzz(base_url: str) -> None:
    """Every POST operation of the schema `base_url` publishes, EXAMPLES generated cases each.
    (schemathesis's Python API: its pytest plugin does not load under this pytest.)"""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json").include(method="POST")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize",
                                             "/detokenize"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @_fuzz
        def run(case):
            case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=60)

        run()


def test_pagoda_serve_survives_and_matches_its_schema(engine):
    fuzz(engine.url)


def test_pagoda_route_survives_and_matches_its_schema(router_url):
    fuzz(router_url)


def test_the_published_schema_describes_the_request_bodies(engine, router_url):
    import httpx

    for url in (engine.url, router_url):
        paths = httpx.get(url + "/openapi.json").json()["paths"]
        for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions",
                                                                         "ChatCompletionRequest"),
                            ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:
            body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": f"#/components/schemas/{model}"}, (url, path, body)

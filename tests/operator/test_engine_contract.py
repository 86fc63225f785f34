"""The operator's command lines against the real `pagoda serve` and `pagoda route` parsers: every
flag the renderer writes is one the engine and router accept, with the meaning intended."""

from __future__ import annotations

import argparse

import pytest

from pagoda_operator import render as r
from pagoda_operator.validation import check
from tests.operator.support import EXAMPLE_FILES, load_example

api_server = pytest.importorskip("pagoda_engine.api.server.api_server")
router_app = pytest.importorskip("pagoda_engine.router.app")
from pagoda_engine.config import config_from_args  # noqa: E402

def _parser(add_arguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return parser


def _children(filename: str) -> list[dict]:
    body = load_example(filename)
    checked = check(body)
    assert checked.ok, checked.problems
    return r.render(body, checked.spec)


def _engine_args(children: list[dict]) -> list[str]:
    workload = next(m for m in children if m["metadata"]["name"].endswith("-engine") and m["kind"] in ("Deployment", "LeaderWorkerSet"))
    template = workload["spec"]["template"] if workload["kind"] == "Deployment" else workload["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["pagoda", "serve"]
    return container["args"]


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_pagoda_serve_accepts_the_rendered_arguments(filename):
    children = _children(filename)
    args = _engine_args(children)
    parsed, unknown = _parser(api_server.add_arguments).parse_known_args(args)
    assert unknown == []
    spec = check(load_example(filename)).spec
    assert parsed.port == 8000 and parsed.host == "0.0.0.0"
    assert parsed.served_model_name == (spec.model.name or load_example(filename)["metadata"]["name"])
    assert parsed.model == r.model_path(spec)
    assert (parsed.tensor_parallel_size, parsed.pipeline_parallel_size) == (spec.topology.tensor, spec.topology.pipeline)
    assert parsed.block_size == spec.kv_cache.page_size
    assert parsed.enable_prefix_caching is spec.engine.prefix_caching
    assert parsed.max_model_len == spec.model.max_model_len
    assert parsed.device == ("cpu" if spec.resources.gpus_per_pod == 0 else "auto")
    assert parsed.data_parallel_size == spec.topology.data
    assert parsed.enable_expert_parallel is spec.topology.expert
    tier_types = {tier.type for tier in spec.kv_cache.tiers}
    assert (parsed.kv_offload_cpu_gb > 0) == ("cpu" in tier_types)
    assert (parsed.kv_offload_disk_path is not None) == ("disk" in tier_types)
    assert (parsed.kv_offload_remote_url is not None) == ("remote" in tier_types)
    config_from_args(parsed)  # the engine's own checks of the values pass too


@pytest.mark.parametrize("filename", EXAMPLE_FILES)
def test_pagoda_route_accepts_the_rendered_arguments(filename):
    router = next(m for m in _children(filename) if m["kind"] == "Deployment" and not m["metadata"]["name"].endswith("-engine"))
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["pagoda", "route"]
    parsed = _parser(router_app.add_arguments).parse_args(container["args"])
    name = router["metadata"]["name"]
    assert parsed.k8s_service == f"default/{name}-engine"
    assert parsed.port == 8000
    assert parsed.policy == check(load_example(filename)).spec.router.policy

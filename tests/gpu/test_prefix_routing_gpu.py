"""Precise prefix routing on two GPUs (issue 52): `pagoda bench prefix-routing`'s mechanics with a
small Llama on one GPU per engine, KV events over ZMQ, the router's approximate and precise
policies on the same multi-tenant prefix workload. Every request completes under both, and the
precise router's prefix-cache hit rate is at least the approximate one's (the TTFT and throughput
targets are the benchmark's, docs/benchmarks.md P1). Skipped with fewer than 2 GPUs."""

from __future__ import annotations

import argparse

import pytest
import torch

from gpu_support import requires_gpu
from pagoda_engine import bench

pytestmark = [pytest.mark.gpu, requires_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


def test_precise_routing_hits_the_prefix_cache_at_least_as_often(gpu_model_dir):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["prefix-routing", "--model", str(gpu_model_dir), "--load-format", "auto",
                              "--engines", "2", "--tenants", "8", "--prefix-len", "1024", "--question-len", "32",
                              "--output-len", "16", "--num-prompts", "120", "--request-rate", "8",
                              "--max-model-len", "2048"])
    from pagoda_engine.bench.prefix_routing import run_prefix_routing

    result = run_prefix_routing(args)
    runs = {r["policy"]: r for r in result["runs"]}
    assert runs["approximate"]["completed"] == runs["precise"]["completed"] == 120
    assert runs["precise"]["prefix_cache_hit_rate"] >= runs["approximate"]["prefix_cache_hit_rate"] - 0.02

"""Structured outputs and logit_bias on the GPU (FlashInfer, decode CUDA graphs, the CUDA sampler
with its Gumbel-max and FlashInfer draws): constrained rows follow their grammar and a forced
token comes out, beside unconstrained rows in the same steps, and async scheduling (which runs
steps with constrained rows synchronously) gives the synchronous engine's tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from gpu_support import make_llm, random_prompts, requires_gpu
from pagoda_engine import SamplingParams
from pagoda_engine.sampling_params import StructuredOutputsParams

pytestmark = [pytest.mark.gpu, requires_gpu]

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 100, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    "name": {"type": "string", "maxLength": 5}}, "required": ["id", "tags", "name"], "additionalProperties": False}
REGEX = "[a-z]{5,20}"


def test_constrained_and_free_rows_in_graph_replayed_steps(gpu_model_dir):
    prompts = random_prompts(7, [5, 40, 12, 90, 3, 60, 20])
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0.8, seed=1, top_p=0.9, max_tokens=200,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=1.0, seed=2, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex=REGEX)),
              SamplingParams(temperature=0.7, seed=5, top_k=20, max_tokens=20, logit_bias={42: 100.0}),
              SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
                  choice=["alpha", "beta"]))]
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(gpu_model_dir, async_scheduling=async_scheduling)
        assert llm.core.executor.graphs is not None
        outs = llm.generate(prompts, params)
        texts = [o.outputs[0].text for o in outs]
        for i in (2, 3):
            assert outs[i].outputs[0].finish_reason == "stop", texts[i]
            jsonschema.validate(json.loads(texts[i]), SCHEMA)
        assert re.fullmatch(REGEX, texts[4]), texts[4]
        assert outs[5].outputs[0].token_ids == [42] * 20
        assert texts[6] in ("alpha", "beta")
        kv = llm.core.kv
        assert kv.num_free_pages == kv.pool.num_pages - 1, "pages leaked"
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        del llm
    assert results[1] == results[0]

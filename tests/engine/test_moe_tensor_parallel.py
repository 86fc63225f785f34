"""MoE models under tensor parallelism on CPU (gloo, two real processes): each rank keeps its
slice of every expert's intermediate dimension (and of Qwen2-MoE's shared expert) and the layer
all-reduces once; greedy tokens equal one process's and Hugging Face `generate`'s."""

import pytest

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.tiny import build_tiny_model
from test_generate_vs_hf import hf_greedy

NEW_TOKENS = 8
PROMPTS = [[5, 6, 7], [(3 * i + 1) % 400 + 5 for i in range(30)], [100 + i for i in range(11)]]


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param) / "model", arch=request.param, seed=5)


def test_moe_tp2_greedy_tokens_equal_one_process_and_transformers(moe_dir):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    llm = LLM(str(moe_dir), tensor_parallel_size=2, num_kv_pages=64)
    try:
        tp2 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.close()
    one = [o.outputs[0].token_ids for o in LLM(str(moe_dir), num_kv_pages=64).generate(PROMPTS, params)]
    assert tp2 == one == hf_greedy(moe_dir, PROMPTS, NEW_TOKENS)

"""MoE models across two real processes on CPU (gloo): tensor parallelism (each rank keeps its
slice of every expert's intermediate dimension and of Qwen2-MoE's shared expert) and expert
parallelism (each rank keeps half the experts, whole); either way the layer all-reduces once, and
greedy tokens equal one process's and Hugging Face `generate`'s. A dense model is refused EP."""

import pytest

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.tiny import build_tiny_model
from test_generate_vs_hf import hf_greedy

NEW_TOKENS = 8
PROMPTS = [[5, 6, 7], [(3 * i + 1) % 400 + 5 for i in range(30)], [100 + i for i in range(11)]]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def moe_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param) / "model", arch=request.param, seed=5)


@pytest.fixture(scope="module")
def reference_tokens(moe_dir):
    one = [o.outputs[0].token_ids for o in LLM(str(moe_dir), num_kv_pages=64).generate(PROMPTS, GREEDY)]
    assert one == hf_greedy(moe_dir, PROMPTS, NEW_TOKENS)
    return one


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_two_ranks_give_one_process_greedy_tokens(moe_dir, reference_tokens, expert_parallel):
    llm = LLM(str(moe_dir), tensor_parallel_size=2, enable_expert_parallel=expert_parallel, num_kv_pages=64)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference_tokens
    finally:
        llm.close()


def test_expert_parallelism_is_refused_for_a_dense_model(tmp_path):
    dense = build_tiny_model(tmp_path / "llama", arch="llama")
    with pytest.raises(ModelLoadError, match="needs a mixture-of-experts model"):
        LLM(str(dense), enable_expert_parallel=True, num_kv_pages=16)

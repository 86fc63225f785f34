"""CUDA graphs per pipeline stage, on ONE GPU: PAGODA_DIST_BACKEND=gloo lets the two ranks of
PP=2 (two processes) share the GPU, their transfers passing through host memory (NCCL refuses two
ranks on one device). Over a three-layer bf16 Llama split 2 + 1 (vLLM's split) and 1 + 2
(PAGODA_PP_LAYER_PARTITION), with the default FULL_AND_PIECEWISE mode, PP=2 gives the greedy
tokens of one process with graphs, and both stages replay both kinds of graph: the prompts'
step the piecewise ones, every decode step the whole-forward ones (each rank's own counters).

The prompts (120 tokens) fit one step of the token budget and the batch never changes, so one
process and the pipeline (whose batch queue skips requests in flight) run the same batches: each
stage runs its layers' kernels at the sizes one process runs them."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import gpu_support
from gpu_support import MODEL_CONFIG, requires_gpu
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.worker.parallel_state import DIST_BACKEND_ENV, PP_LAYER_PARTITION_ENV

pytestmark = [pytest.mark.gpu, requires_gpu]

NEW_TOKENS = 16
PROMPTS = gpu_support.random_prompts(4, [3, 17, 40, 60])
# Two processes share the GPU: a small pool; a token budget the prompts fit in one step of, and
# which the piecewise graphs cover (up to 128 tokens).
make_llm = functools.partial(gpu_support.make_llm, num_kv_pages=256, max_num_seqs=16, max_num_batched_tokens=128)


def greedy_ids(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def replays_since(llm: LLM, before: list[dict]) -> list[dict]:
    """Each rank's graph replays since `before` (a single GPU process's warm-up steps replay too)."""
    return [{kind: count - start.get(kind, 0) for kind, count in now.items()}
            for now, start in zip(llm.core.executor.collective_rpc("graph_replays"), before)]


@pytest.fixture(scope="module")
def three_layer_dir(tmp_path_factory, gpu_model_dir):
    out = tmp_path_factory.mktemp("gpu-llama-3-layers")
    gpu_support.save_random_model(out, gpu_model_dir, transformers.LlamaForCausalLM, transformers.LlamaConfig,
                                  **{**MODEL_CONFIG, "num_hidden_layers": 3})
    return out


@pytest.fixture(scope="module")
def expected(three_layer_dir):
    """One process's greedy tokens and graph replays: every step replayed, the prompts' one as
    piecewise graphs, the decode steps as whole-forward ones."""
    with make_llm(three_layer_dir) as one:
        assert one.core.cudagraph_mode == "FULL_AND_PIECEWISE"
        before = one.core.executor.collective_rpc("graph_replays")
        tokens = greedy_ids(one)
        [replays] = replays_since(one, before)
    assert replays == {"decode": NEW_TOKENS - 1, "piecewise": 1, "verify": 0}
    return tokens, replays


@pytest.mark.parametrize("partition, layers, pool", [
    ("", [2, 1], {}),
    # The KV pool measured too: both ranks' pages come out of the one GPU's budget.
    ("1,2", [1, 2], {"num_kv_pages": None, "gpu_memory_utilization": 0.3})])
def test_pp2_on_one_gpu_replays_graphs_on_both_stages_and_gives_one_process_tokens(
        three_layer_dir, expected, monkeypatch, partition, layers, pool):
    tokens, replays = expected
    monkeypatch.setenv(DIST_BACKEND_ENV, "gloo")  # the worker process inherits it
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, partition)
    with make_llm(three_layer_dir, pipeline_parallel_size=2, **pool) as pp2:
        core = pp2.core
        assert core.cudagraph_mode == "FULL_AND_PIECEWISE"  # the default, as on one process
        assert core.executor.worker.pp_group.stages_on_host
        assert core.executor.shares_devices == (torch.cuda.device_count() < 2)
        if pool:
            assert core.num_kv_pages > 256
        stage_layers = [len({n.split(".")[2] for n in names if n.startswith("model.layers.")})
                        for names in core.executor.collective_rpc("parameter_names")]
        assert stage_layers == layers
        before = core.executor.collective_rpc("graph_replays")
        assert greedy_ids(pp2) == tokens
        # Both stages replayed every step, as the one process did (each rank's own counters).
        assert replays_since(pp2, before) == [replays, replays]

"""Pipeline parallelism on CPU (gloo, real processes): the layers split into contiguous stages
(vLLM's split, or PAGODA_PP_LAYER_PARTITION), each stage's ranks build and load only their layers
(the embedding on the first stage, the final norm and LM head on the last, tied embeddings
included) and hold KV pages for those layers only; PP=2, PP=3 with an uneven split and PP=2 × TP=2
give the greedy tokens of one process and of Hugging Face `generate`, under chunked prefill and
prefix-cache hits; a bad split is refused before any process starts; a stage that dies makes the
next step raise EngineDeadError."""

import os
import signal
import time

import pytest

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.errors import EngineDeadError, ModelLoadError
from pagoda_engine.tiny import build_tiny_model
from pagoda_engine.worker.parallel_state import PP_LAYER_PARTITION_ENV, pp_layer_partition
from test_generate_vs_hf import hf_greedy
from test_tensor_parallel import _child_pids, _wait_gone

NEW_TOKENS = 10
SHARED = [(7 * i + 11) % 500 + 5 for i in range(40)]
PROMPTS = [
    [5, 6, 7],
    SHARED + [9, 10, 11, 12, 13],
    [(3 * i + 1) % 400 + 5 for i in range(70)],  # longer than the token budget: prefilled in chunks
    SHARED + [44, 45],
]
BUDGET = 24  # tokens per step: the long prompts are chunked, beside decodes


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, **kwargs)


def _tokens(llm: LLM, prompts, params=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params or _greedy())]


def _stage_params(llm: LLM) -> list[set[str]]:
    """Every rank's parameter names, in rank order."""
    return [set(names) for names in llm.core.executor.collective_rpc("parameter_names")]


def _layers_of(names: set[str]) -> set[int]:
    return {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}


@pytest.fixture(scope="module")
def three_layer_dir(tmp_path_factory):
    """Three layers: PP=2's default split is uneven (2 + 1)."""
    return build_tiny_model(tmp_path_factory.mktemp("pp-llama") / "model", seed=3,
                            config_overrides={"num_hidden_layers": 3})


@pytest.fixture(scope="module")
def expected(three_layer_dir):
    one = _tokens(LLM(str(three_layer_dir), num_kv_pages=128), PROMPTS)
    assert one == hf_greedy(three_layer_dir, PROMPTS, NEW_TOKENS)
    return one


@pytest.fixture(scope="module")
def pp_llm(three_layer_dir):
    llm = LLM(str(three_layer_dir), num_kv_pages=128, pipeline_parallel_size=2, max_num_batched_tokens=BUDGET)
    yield llm
    llm.close()


def test_default_split_is_vllms_and_an_explicit_one_is_taken():
    # n // pp each, the remainder one more per stage from the second-to-last backwards.
    assert pp_layer_partition(3, 2, "") == [(0, 2), (2, 3)]
    assert pp_layer_partition(5, 3, "") == [(0, 2), (2, 4), (4, 5)]
    assert pp_layer_partition(32, 3, "") == [(0, 11), (11, 22), (22, 32)]
    assert pp_layer_partition(4, 2, "") == [(0, 2), (2, 4)]
    assert pp_layer_partition(4, 3, "1,1,2") == [(0, 1), (1, 2), (2, 4)]


@pytest.mark.parametrize("layers, pp, partition, message", [
    (3, 2, "2,2", r"PAGODA_PP_LAYER_PARTITION='2,2' must give each of the 2 pipeline stages .* sum to the model's 3"),
    (3, 2, "3,0", r"at least one layer"),
    (3, 3, "1,2", r"each of the 3 pipeline stages"),
    (3, 2, "1;2", r"comma-separated layer counts"),
    (2, 3, "", r"pipeline_parallel_size 3 exceeds the model's 2 layers"),
])
def test_a_bad_split_is_a_clear_error(layers, pp, partition, message):
    with pytest.raises(ModelLoadError, match=message):
        pp_layer_partition(layers, pp, partition)


def test_pp2_greedy_equals_one_process_and_hf_with_chunked_prefill(pp_llm, expected):
    executor = pp_llm.core.executor
    assert (executor.layout.pp, executor.layout.tp, len(executor.worker_pids)) == (2, 1, 1)
    assert _tokens(pp_llm, PROMPTS) == expected
    assert pp_llm.core.kv.num_free_pages == pp_llm.core.kv.pool.num_pages - 1  # no page leaked


def test_each_stage_holds_only_its_layers_weights_and_kv_pages(pp_llm):
    first, last = _stage_params(pp_llm)
    assert _layers_of(first) == {0, 1} and _layers_of(last) == {2}
    assert "model.embed_tokens.weight" in first and not any(n.startswith(("model.norm", "lm_head")) for n in first)
    assert {"model.norm.weight", "lm_head.weight"} <= last and "model.embed_tokens.weight" not in last
    specs = pp_llm.core.executor.kv_cache_specs(16, pp_llm.core.dtype)
    assert [s.num_layers for s in specs] == [2, 1]
    assert len(pp_llm.core.executor.attn.kv_caches) == 2
    assert pp_llm.core.executor.attn.kv_caches[0].shape[0] == pp_llm.core.num_kv_pages


def test_prefix_cache_hit_under_pp2_gives_same_tokens(pp_llm):
    prompts = [SHARED + [60, 61, 62], SHARED + [70]]
    first = _tokens(pp_llm, prompts)
    hits_before = pp_llm.core.kv.prefix_hits
    again = pp_llm.generate(prompts, _greedy())
    assert pp_llm.core.kv.prefix_hits > hits_before
    assert all(o.num_cached_tokens >= 32 for o in again)
    assert [o.outputs[0].token_ids for o in again] == first


def _logprobs(outputs) -> tuple[list, list[float]]:
    """Every position's (token, rank) keys and their logprobs, sampled positions then prompt ones."""
    keys, values = [], []
    for o in outputs:
        for position in (o.outputs[0].logprobs or []) + (o.prompt_logprobs or [None])[1:]:
            keys.append(sorted(position))
            values += [position[t].logprob for t in sorted(position)]
    return keys, values


def test_pp2_logprobs_match_one_process(pp_llm, three_layer_dir):
    params = _greedy(logprobs=3, prompt_logprobs=3)
    got = pp_llm.generate(PROMPTS[:3], params)
    want = LLM(str(three_layer_dir), num_kv_pages=128).generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    (got_keys, got_values), (want_keys, want_values) = _logprobs(got), _logprobs(want)
    assert got_keys == want_keys and len(got_values) > 100
    assert got_values == pytest.approx(want_values, abs=1e-4)


def test_an_explicit_uneven_split_over_three_stages(tmp_path, monkeypatch):
    model_dir = build_tiny_model(tmp_path / "model", seed=4, config_overrides={"num_hidden_layers": 4})
    want = hf_greedy(model_dir, PROMPTS[:3], NEW_TOKENS)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,1,2")
    with LLM(str(model_dir), num_kv_pages=128, pipeline_parallel_size=3, max_num_batched_tokens=BUDGET) as llm:
        assert [_layers_of(names) for names in _stage_params(llm)] == [{0}, {1}, {2, 3}]
        assert _tokens(llm, PROMPTS[:3]) == want


def test_pp2_times_tp2_gives_one_process_tokens(three_layer_dir, expected):
    with LLM(str(three_layer_dir), num_kv_pages=128, pipeline_parallel_size=2, tensor_parallel_size=2,
             max_num_batched_tokens=BUDGET) as llm:
        params = _stage_params(llm)
        # Ranks 0, 1 are the first stage's TP ranks, 2, 3 the last stage's.
        assert [_layers_of(p) for p in params] == [{0, 1}, {0, 1}, {2}, {2}]
        assert llm.core.executor.model.model.layers[0].self_attn.num_heads == 2  # half the 4 heads
        assert _tokens(llm, PROMPTS) == expected


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3"])
def test_moe_and_tied_embedding_models_under_pp2(tmp_path, arch):
    """Qwen2-MoE (experts and a shared expert per layer); Qwen3 with tied embeddings: the last
    stage, without the embedding, loads its LM head from the checkpoint's embedding."""
    overrides = {"tie_word_embeddings": True} if arch == "qwen3" else {}
    model_dir = build_tiny_model(tmp_path / arch, arch=arch, seed=5, config_overrides=overrides)
    want = hf_greedy(model_dir, PROMPTS[:3], NEW_TOKENS)
    assert _tokens(LLM(str(model_dir), num_kv_pages=128), PROMPTS[:3]) == want
    with LLM(str(model_dir), num_kv_pages=128, pipeline_parallel_size=2, max_num_batched_tokens=BUDGET) as llm:
        first, last = _stage_params(llm)
        assert _layers_of(first) == {0} and _layers_of(last) == {1}
        assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last
        assert _tokens(llm, PROMPTS[:3]) == want


def test_a_bad_split_is_refused_before_any_worker_starts(three_layer_dir, monkeypatch):
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "3,0")
    children_before = _child_pids()
    with pytest.raises(ModelLoadError, match="PAGODA_PP_LAYER_PARTITION='3,0'"):
        LLM(str(three_layer_dir), num_kv_pages=64, pipeline_parallel_size=2)
    assert _child_pids() == children_before


def test_a_dead_stage_fails_the_next_step_with_a_clear_error(three_layer_dir):
    with LLM(str(three_layer_dir), num_kv_pages=64, pipeline_parallel_size=2) as llm:
        assert _tokens(llm, [[5, 6, 7]])
        (worker,) = llm.core.executor.worker_pids
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker 1 (died|is gone)"):
            llm.generate([[5, 6, 7, 8]], _greedy())
        assert time.monotonic() - started < 30  # a failure, not a wait for a collective's timeout
    assert _wait_gone([worker])


def test_the_batch_queue_keeps_one_batch_per_stage_in_flight(pp_llm, expected):
    core = pp_llm.core
    assert core.in_flight.max_batches == 2
    depths = []
    launch = core.runner.launch

    def recording_launch(sched, prev=None):
        depths.append(len(core.in_flight.batch_queue))  # batches already in flight when this one launches
        return launch(sched, prev)

    core.runner.launch = recording_launch
    try:
        assert _tokens(pp_llm, PROMPTS) == expected
    finally:
        del core.runner.launch
    assert max(depths) == 1  # a second batch launched while the first was still in flight
    assert not core.in_flight.batch_queue and core.kv.num_free_pages == core.kv.pool.num_pages - 1


def test_preemption_under_pp2_gives_same_tokens(three_layer_dir, expected):
    # 9 pages of 16 tokens hold fewer than the four requests need at once.
    with LLM(str(three_layer_dir), num_kv_pages=10, pipeline_parallel_size=2, max_num_batched_tokens=BUDGET,
             kv_growth_reservation=False) as llm:
        assert _tokens(llm, PROMPTS) == expected
        assert llm.core.scheduler.num_preemptions > 0
        assert llm.core.kv.num_free_pages == llm.core.kv.pool.num_pages - 1


def test_the_world_group_is_every_rank():
    from pagoda_engine.worker.parallel_state import ParallelLayout

    layout = ParallelLayout(tp=2, pp=2)
    assert layout.groups("world") == [(0, 1, 2, 3)]
    assert layout.groups("pp") == [(0, 2), (1, 3)]


def test_seeded_sampling_with_penalties_on_the_last_stage_matches_one_process(pp_llm, three_layer_dir):
    """The last stage samples: the step's sampling tensors (temperature, top-p, penalty counts)
    reach it, and a seeded request draws the same tokens as in one process."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, repetition_penalty=1.3, max_tokens=NEW_TOKENS,
                             min_tokens=NEW_TOKENS, logprobs=2 if i % 2 else None) for i in range(len(PROMPTS))]
    got = pp_llm.generate(PROMPTS, params)
    want = LLM(str(three_layer_dir), num_kv_pages=128).generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[1].outputs[0].logprobs and got[0].outputs[0].logprobs is None
    (got_keys, got_values), (want_keys, want_values) = _logprobs(got), _logprobs(want)
    assert got_keys == want_keys and got_values == pytest.approx(want_values, abs=1e-4)

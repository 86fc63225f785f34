"""Async scheduling (`async_scheduling=True`: step N+1 is scheduled and launched before step N's
tokens are read) gives exactly what the synchronous engine gives, under every scheduling condition:
same tokens, finish and stop reasons, logprobs, and no page left behind."""

import pytest

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.core.warm_up import WARM_UP_PROMPT_LENS
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.tiny import build_tiny_model

# The prompts (mixed lengths, a shared 40-token prefix), HF's greedy tokens for them and the
# page-leak check are test_generate_vs_hf's; `model_dir` below is its llama case alone.
from test_generate_vs_hf import NEW_TOKENS, PROMPTS, _greedy, hf_tokens  # noqa: F401 (a fixture)
from test_generate_vs_hf import _assert_pool_free as _assert_pages_free
from warm_up_steps import warm_up_step_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "model", arch="llama", seed=3)


def _assert_pool_free(llm: LLM) -> None:
    _assert_pages_free(llm)
    assert not llm.core._prompt_logprobs


def _both(model_dir, params, prompts=PROMPTS, **engine_kwargs):
    """(sync outputs, async outputs, async LLM): each output as a comparable tuple."""
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), dtype="float32", async_scheduling=async_scheduling, **engine_kwargs)
        outs = llm.generate(prompts, params)
        _assert_pool_free(llm)
        results.append([_comparable(o.outputs[0]) for o in outs])
    return results[0], results[1], llm


def _comparable(c) -> tuple:
    def lp(entries):
        if entries is None:
            return None
        return [None if e is None else {t: round(v.logprob, 4) for t, v in e.items()} for e in entries]

    return (c.token_ids, c.finish_reason, c.stop_reason, lp(c.logprobs))


@pytest.mark.parametrize("budget", [8192, 32, 8])
def test_greedy_tokens_equal_sync_and_hf_with_chunked_prefill(model_dir, hf_tokens, budget):
    sync, overlapped, llm = _both(model_dir, _greedy(), num_kv_pages=128, max_num_batched_tokens=budget)
    assert overlapped == sync
    assert [o[0] for o in overlapped] == hf_tokens
    assert llm.core.kv.prefix_hits > 0


def test_preemption_by_tiny_pool_keeps_tokens(model_dir, hf_tokens):
    # 9 usable pages of 4 tokens = 36 tokens: the requests cannot all stay resident (admitted
    # without the growth reservation, so preemption has to make room).
    sync, overlapped, llm = _both(model_dir, _greedy(), num_kv_pages=16, block_size=4, max_model_len=64,
                                  kv_growth_reservation=False)
    assert llm.core.scheduler.num_preemptions > 0
    assert overlapped == sync
    assert [o[0] for o in overlapped] == hf_tokens


def test_stop_tokens_and_max_tokens_finish_identically(model_dir, hf_tokens):
    # Stop on a token each of some requests produces mid-way; others end on max_tokens (1 = the
    # first token is the last), or run into max_model_len.
    params = [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[hf_tokens[0][4]]),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[hf_tokens[2][1], hf_tokens[2][7]]),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=None),  # until max_model_len
    ]
    sync, overlapped, _ = _both(model_dir, params, num_kv_pages=128, max_model_len=64)
    assert overlapped == sync
    reasons = [o[1] for o in overlapped]
    assert reasons[0] == reasons[2] == "stop" and reasons[1] == reasons[3] == "length"
    assert len(overlapped[1][0]) == 1 and len(overlapped[3][0]) == 5
    assert len(PROMPTS[4]) + len(overlapped[4][0]) == 64


def test_seeded_sampling_logprobs_min_tokens_and_penalties_equal_sync(model_dir):
    params = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=NEW_TOKENS, logprobs=3),
        SamplingParams(temperature=0.8, seed=5, top_k=20, top_p=0.9, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=1.0, seed=7, min_p=0.05, min_tokens=6, max_tokens=NEW_TOKENS),
        # Penalties need the output tokens on the host: the step after runs synchronously.
        SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=NEW_TOKENS),
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0),
    ]
    sync, overlapped, _ = _both(model_dir, params, num_kv_pages=128, max_num_batched_tokens=32)
    assert overlapped == sync
    assert overlapped[0][3] is not None and len(overlapped[0][3]) == len(overlapped[0][0])


def test_prompt_logprobs_equal_sync(model_dir):
    results = []
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), dtype="float32", async_scheduling=async_scheduling, num_kv_pages=128,
                  max_num_batched_tokens=16)
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2))
        results.append([[None if e is None else {t: round(v.logprob, 4) for t, v in e.items()}
                         for e in o.prompt_logprobs] for o in outs])
        _assert_pool_free(llm)
    assert results[0] == results[1]
    assert [len(r) for r in results[1]] == [len(p) for p in PROMPTS[:3]]


def _drive(llm: LLM, abort_after: int | None) -> dict[str, list[int]]:
    """Requests straight into the core; one is aborted after `abort_after` steps."""
    core = llm.core
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt,
                                           sampling_params=_greedy()))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    steps = 0
    while core.has_unfinished_requests():
        if steps == abort_after:
            core.abort_requests(["r1"])
        for out in core.step().outputs:
            assert out.request_id != "r1" or abort_after is None or steps < abort_after, "output after the abort"
            tokens[out.request_id] += out.new_token_ids
        steps += 1
    return tokens


def test_abort_mid_run_frees_pages_and_leaves_the_rest_unchanged(model_dir, hf_tokens):
    llm = LLM(str(model_dir), dtype="float32", async_scheduling=True, num_kv_pages=128, max_num_batched_tokens=16)
    tokens = _drive(llm, abort_after=6)
    assert 0 < len(tokens["r1"]) < NEW_TOKENS
    assert tokens["r1"] == hf_tokens[1][:len(tokens["r1"])]
    assert [tokens[f"r{i}"] for i in range(len(PROMPTS)) if i != 1] == [t for i, t in enumerate(hf_tokens) if i != 1]
    _assert_pool_free(llm)
    # The engine keeps serving after it, a reused request id included.
    again = _drive(llm, abort_after=None)
    assert list(again.values()) == hf_tokens
    _assert_pool_free(llm)


def test_outputs_come_one_step_late_and_steps_overlap(model_dir):
    """The first step returns nothing (its tokens are read on the next call), and a decode step's
    input token is fed from the step before on the device: the core never reads it first."""
    llm = LLM(str(model_dir), dtype="float32", async_scheduling=True, num_kv_pages=128)
    core = llm.core
    core.add_request(EngineCoreRequest(request_id="a", prompt_token_ids=PROMPTS[2], sampling_params=_greedy()))
    assert core.step().outputs == []
    assert core.in_flight.step is not None
    req = core.scheduler.requests["a"]
    assert req.num_output_placeholders == 1 and req.num_output_tokens == 0
    out = core.step().outputs
    assert [o.request_id for o in out] == ["a"]
    # The second step was launched with its input still a placeholder, then the first resolved.
    assert req.num_output_placeholders == 1 and req.num_output_tokens == 1
    while core.has_unfinished_requests():
        core.step()
    _assert_pool_free(llm)


def test_async_scheduling_flag_and_config():
    import argparse

    from pagoda_engine.config import EngineConfig, add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--async-scheduling"])).scheduler.async_scheduling is True
    assert config_from_args(parser.parse_args(["--no-async-scheduling"])).scheduler.async_scheduling is False
    auto = config_from_args(parser.parse_args([]))
    assert auto.scheduler.async_scheduling is None  # decided by the device: on with CUDA
    assert EngineConfig.from_kwargs(async_scheduling=True).scheduler.async_scheduling
    assert EngineConfig().scheduler.async_scheduling is False  # the offline LLM's default


def test_async_scheduling_auto_is_off_on_cpu(model_dir):
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core.engine_core import EngineCore

    core = EngineCore(EngineConfig.from_kwargs(model=str(model_dir), dtype="float32", device="cpu",
                                               async_scheduling=None, num_kv_pages=32))
    assert core.config.scheduler.async_scheduling is False


def test_tensor_parallel_async_equals_single_rank_sync(model_dir, hf_tokens):
    """Rank 0 feeds the placeholder tokens on its device before broadcasting the step's inputs."""
    with LLM(str(model_dir), dtype="float32", async_scheduling=True, tensor_parallel_size=2, num_kv_pages=128,
             max_num_batched_tokens=32) as llm:
        outs = llm.generate(PROMPTS, _greedy())
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
        _assert_pool_free(llm)


@pytest.mark.parametrize("async_scheduling, pool", [(False, {}), (True, {}), (True, {"num_kv_pages": 12}),
                                                     (False, {"pipeline_parallel_size": 2})],
                         ids=["sync", "async", "async-pool-of-176-tokens", "two-pipeline-stages"])
def test_warm_up_steps_leave_no_trace(model_dir, async_scheduling, pool):
    """A CUDA engine runs warm-up requests before it serves (`core.warm_up.warm_up_steps`; CPU
    engines skip them, so they are run by hand here): afterwards no request, page in use, KV
    offload or prefix-cache count of theirs remains, and the tokens users get, random ones of
    unseeded requests included, are those of an engine that never warmed up. A pool smaller than
    the warm-up's usual prompts (a GPU test's --num-kv-pages 64) shrinks them instead of waiting
    for pages forever. Two pipeline stages (gloo) run them through the batch queue."""
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0), SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0)]
    prompts = PROMPTS[:2]
    kw = dict(dtype="float32", async_scheduling=async_scheduling, kv_offload_cpu_gb=0.01, **pool)
    with LLM(str(model_dir), **kw) as cold:
        expected = [_comparable(o.outputs[0]) for o in cold.generate(prompts, params)]
    with LLM(str(model_dir), **kw) as warm:
        _warm_up_and_check(warm, prompts, params, expected)


def _warm_up_and_check(warm: LLM, prompts, params, expected) -> None:
    core = warm.core
    offload = core.kv.offload
    step_tokens = warm_up_step_tokens(core)
    # Its long prompt and the short one first, then a prompt of each size class alone (as long
    # as the long prompt at most): every configuration of every kernel has run before users come.
    long_len = step_tokens[0] - 16
    assert {n for n in WARM_UP_PROMPT_LENS if n <= long_len} <= set(step_tokens[1:])
    assert not core.scheduler.requests and not core.has_unfinished_requests()
    assert core.kv.offload is offload and sum(t.stored_bytes for t in offload.stats()) == 0
    assert (core.kv.prefix_queries, core.kv.prefix_hits) == (0, 0)
    _assert_pool_free(warm)
    assert [_comparable(o.outputs[0]) for o in warm.generate(prompts, params)] == expected
    _assert_pool_free(warm)

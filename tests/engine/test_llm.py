"""The offline LLM end to end on the tiny model: sampling controls, stops, abort, bad input."""

import json
import time

import pytest

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.capabilities import FEATURES
from pagoda_engine.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llm") / "model", seed=1)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), num_kv_pages=256)


def _pool_is_free(llm) -> bool:
    return llm.core.kv.num_free_pages == llm.core.kv.pool.num_pages - 1 and not llm.core.has_unfinished_requests()


PROMPTS = ["The quick brown fox", "Once upon a time", "héllo 日本語"]


def test_string_and_token_prompts_give_vllm_shaped_outputs(llm):
    ids = llm.get_tokenizer().encode("The quick brown fox")
    by_text, by_ids = llm.generate(["The quick brown fox", ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert by_text.prompt == "The quick brown fox" and by_ids.prompt is None
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    out = by_text.outputs[0]
    assert out.index == 0 and len(out.token_ids) == 8 and out.finish_reason == "length"
    assert out.token_ids == by_ids.outputs[0].token_ids
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)
    assert _pool_is_free(llm)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate("Once upon a time", params)[0].outputs[0].token_ids
    batched = llm.generate(["x y z"] * 3 + ["Once upon a time"], [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 3
                           + [params])[3].outputs[0].token_ids
    assert alone == batched
    other = llm.generate("Once upon a time", SamplingParams(temperature=1.0, max_tokens=10, seed=4321, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    top1 = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=12))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_prompts_spread_over_steps_by_long_prefill_token_threshold_give_the_same_tokens(llm, model_dir):
    # Every prompt here is longer than 3 tokens, so each is prefilled 3 tokens a step, side by
    # side with the others' chunks and decodes: greedy tokens and prompt logprobs stay the same.
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    prompts = ["The quick brown fox jumps over the lazy dog", "Once upon a time there was", "héllo 日本語 again"]
    whole = llm.generate(prompts, params)
    spread = LLM(str(model_dir), num_kv_pages=256, long_prefill_token_threshold=3)
    try:
        assert spread.core.scheduler.config.long_prefill_token_threshold == 3
        chunked = spread.generate(prompts, params)
    finally:
        spread.core.close()
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in whole]
    for a, b in zip(chunked, whole):
        assert len(a.prompt_token_ids) > 3
        assert [None if d is None else sorted(d) for d in a.prompt_logprobs] == \
               [None if d is None else sorted(d) for d in b.prompt_logprobs]
        for da, db in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            for tok in da:
                assert abs(da[tok].logprob - db[tok].logprob) < 1e-4


def test_n_sequences_and_logprobs(llm):
    out = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7, logprobs=2, ignore_eos=True,
                                                          prompt_logprobs=1))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 6
        for token, position in zip(c.token_ids, c.logprobs):
            assert token in position and 2 <= len(position) <= 3
            assert all(lp.logprob <= 0 for lp in position.values())
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for token, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert token in position


def test_max_tokens_min_tokens_and_stop_token_ids(llm):
    base = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_at = base.token_ids[3]
    first = base.token_ids.index(stop_at)
    stopped = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                              stop_token_ids=[stop_at]))[0].outputs[0]
    assert stopped.token_ids == base.token_ids[:first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    delayed = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=10, min_tokens=first + 2, ignore_eos=True,
                                                              stop_token_ids=[stop_at]))[0].outputs[0]
    assert len(delayed.token_ids) > first + 1


def test_eos_stops_unless_ignored_and_min_tokens_masks_it(llm):
    eos = llm.core.eos_token_ids[0]
    natural = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert natural.token_ids[-1] in llm.core.eos_token_ids and natural.finish_reason == "stop"  # this model stops
    out = llm.generate("The", SamplingParams(temperature=0, max_tokens=20, min_tokens=20))[0].outputs[0]
    assert len(out.token_ids) == 20 and eos not in out.token_ids
    ignored = llm.generate("The", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 20


def test_stop_string_is_cut_from_text(llm):
    base = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) >= 6, text
    stop = text[3:6]
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    kept = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True,
                                                           include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    assert _pool_is_free(llm)


def test_abort_frees_pages(llm):
    core = llm.core
    core.add_request(EngineCoreRequest(request_id="to-abort", prompt_token_ids=list(range(5, 60)),
                                       sampling_params=SamplingParams(max_tokens=100)))
    core.step()
    assert core.kv.num_free_pages < core.kv.pool.num_pages - 1
    core.abort_requests(["to-abort"])
    assert _pool_is_free(llm)


def test_chat_applies_template(llm):
    msgs = [{"role": "user", "content": "Hello there"}]
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=4))[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                           return_dict=False)


@pytest.mark.parametrize("params, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(min_p=2), "min_p"), (dict(logprobs=100), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(stop=[""]), "stop"),
])
def test_invalid_sampling_values_are_typed_errors(params, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**params)
    assert e.value.param == field


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm):
    too_long = list(range(5, 5 + llm.core.max_model_len))
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate(["fine", too_long], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        llm.generate([3.5], SamplingParams(max_tokens=2))
    assert _pool_is_free(llm)
    assert len(llm.generate("still here", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_unknown_architecture_is_a_clear_error(model_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="MadeUpForCausalLM"):
        LLM(str(bad))


def test_tiny_model_cpu_throughput_figure(llm, capsys):
    """Not a timed assertion: records the tiny model's CPU decode rate in the test log."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(["Once upon a time"] * 16, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == 16 * 64
    with capsys.disabled():
        print(f"\ntiny model on CPU: {tokens / elapsed:.0f} output tokens/s (16 x 64 tokens)")


# One value per option that asks for its feature; the capability table decides which refuse.
_ASKING = dict(pipeline_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True, kv_offload_cpu_gb=8.0,
               kv_offload_disk_path="/var/cache/kv", kv_offload_disk_gb=10.0, kv_offload_remote_url="redis://kv:6379",
               kv_cache_dtype="fp8")
_NOT_IMPLEMENTED = [(option, feature.title) for feature in FEATURES if not feature.implemented
                    for option in feature.options]


def test_every_unimplemented_option_has_a_value_here():
    assert {option for option, _ in _NOT_IMPLEMENTED} <= set(_ASKING)


@pytest.mark.parametrize("option, title", _NOT_IMPLEMENTED)
def test_options_not_implemented_refuse_to_start(model_dir, option, title):
    with pytest.raises(ModelLoadError, match=f"not implemented in this engine yet: {title}"):
        LLM(str(model_dir), **{option: _ASKING[option]})

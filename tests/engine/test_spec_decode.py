"""Speculative decoding (ngram prompt lookup, and the point-mass proposers the benchmark replays):
greedy output identical to Hugging Face's and to decoding without speculation, under chunked
prefill, prefix hits, preemption and async scheduling; seeded sampling identical; sampled output
keeps the target's distribution (chi-square against the model's own probabilities); refused
drafts leave no pages behind; the config is checked where it enters."""

import math
from collections import Counter

import numpy as np
import pytest
import torch
import transformers

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.bench.spec_replay import ReplayProposer
from pagoda_engine.core.request import Request
from pagoda_engine.core.spec_decode import SpecDecoder, accept, ngram_draft, verification_rows
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.speculative import InvalidSpeculativeConfigError, parse_speculative_config
from pagoda_engine.tiny import build_tiny_model

from test_generate_vs_hf import _assert_pool_free, hf_greedy

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
NEW_TOKENS = 24
# Prompts whose continuations copy from themselves (repeated runs), and plain ones; two share a
# 32-token prefix, so the second is a prefix-cache hit.
SHARED = [(5 * i + 3) % 300 + 20 for i in range(32)]
PROMPTS = [
    [5, 6, 7, 8, 9, 10] * 3 + [5, 6],
    SHARED + [1, 2, 3, 1, 2, 3, 1, 2],
    [(3 * i + 1) % 400 + 5 for i in range(23)],
    SHARED + [44, 45, 46],
    [100 + i for i in range(17)] + [100, 101, 102],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "model", arch="llama", seed=3)


@pytest.fixture(scope="module")
def hf_tokens(model_dir):
    return hf_greedy(model_dir, PROMPTS, NEW_TOKENS)


def _greedy(max_tokens=NEW_TOKENS):
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)


def _run(model_dir, params, speculative_config=NGRAM, prompts=PROMPTS, **kwargs):
    llm = LLM(str(model_dir), dtype="float32", speculative_config=speculative_config, **kwargs)
    outs = llm.generate(prompts, params)
    _assert_pool_free(llm)
    return [o.outputs[0] for o in outs], llm


def _stats(llm):
    return llm.core.scheduler.spec.stats


# --- the config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("given, words", [
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
    ({"method": "nograms", "num_speculative_tokens": 2}, "unknown method 'nograms'"),
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "method 'eagle' (EAGLE-1/2 heads) is not implemented"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "method 'draft_model' needs \"model\""),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "model does not apply to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization is not supported"),
    ({"method": "ngram"}, "num_speculative_tokens must be given"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a whole number >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2}, '"method" must be given'),
    ("[1]", "must be a JSON object"),
    ("{nope", "not valid JSON"),
])
def test_bad_speculative_config_is_refused_naming_it(given, words):
    with pytest.raises(InvalidSpeculativeConfigError) as e:
        parse_speculative_config(given)
    assert words in str(e.value)


def test_ngram_config_takes_vllm_defaults():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (5, 5, None)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)


def test_serve_refuses_a_bad_config_with_exit_2(capsys):
    from pagoda_engine.cli import main

    assert main(["serve", "--model", "pagoda-tiny", "--speculative-config",
                 '{"method": "medusa", "num_speculative_tokens": 2}']) == 2
    assert "medusa" in capsys.readouterr().err


# --- prompt lookup ------------------------------------------------------------------------------

def test_ngram_draft_copies_what_followed_the_latest_longest_match():
    tokens = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3])
    # "2 3" occurs at 1 and 5; the latest (5) is followed by 7 8 4.
    assert ngram_draft(tokens, 3, 1, 2) == [7, 8, 4]
    # Nothing before matches a 3-gram ending "4 2 3"; min 3: no draft.
    assert ngram_draft(tokens, 3, 3, 3) == []
    assert ngram_draft(np.array([5, 6, 5]), 4, 1, 3) == [6, 5]
    assert accept([7, 8, 4], [7, 8, 1, 0]) == 2 and accept([7], [7, 3]) == 1 and accept([7], [6, 3]) == 0


# --- greedy: identical tokens -------------------------------------------------------------------

@pytest.mark.parametrize("budget", [8192, 7])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_tokens_equal_hf_with_chunked_prefill_and_prefix_hits(model_dir, hf_tokens, budget, async_scheduling):
    outs, llm = _run(model_dir, _greedy(), num_kv_pages=128, block_size=4, max_num_batched_tokens=budget,
                     async_scheduling=async_scheduling)
    assert [o.token_ids for o in outs] == hf_tokens
    s = _stats(llm)
    assert s.num_accepted_tokens > 0 and s.num_draft_tokens > s.num_accepted_tokens  # kept and refused drafts
    assert llm.core.kv.prefix_hits > 0


def test_rows_that_do_not_read_the_output_sample_as_the_request_itself(model_dir):
    """Greedy (or unseeded) rows without penalties, past min_tokens, sample as the request at every
    verified position (no copies); seeds, penalties and min_tokens still get each position's own view."""
    req = Request(request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(temperature=0),
                  output_token_ids=[7])
    assert all(row is req for row in verification_rows(req, [3, 4]))
    for params in (SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0, presence_penalty=0.5),
                   SamplingParams(temperature=0, min_tokens=3)):
        req = Request(request_id="r", prompt_token_ids=[1, 2], sampling_params=params, output_token_ids=[7])
        assert [r.output_token_ids for r in verification_rows(req, [3, 4])] == [[7], [7, 3], [7, 3, 4]]
    # EOS may be sampled here (not masked as under min_tokens): against decoding without speculation.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    plain, _ = _run(model_dir, params, speculative_config=None)
    outs, llm = _run(model_dir, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] and _stats(llm).num_accepted_tokens > 0


def test_preemption_keeps_greedy_tokens(model_dir, hf_tokens):
    # 19 usable pages of 4 tokens (one request needs up to 16): the five cannot all stay resident.
    outs, llm = _run(model_dir, _greedy(), num_kv_pages=20, block_size=4, max_model_len=64,
                     kv_growth_reservation=False)
    assert llm.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == hf_tokens
    assert _stats(llm).num_accepted_tokens > 0


def test_stop_tokens_max_tokens_and_logprobs_equal_without_speculation(model_dir, hf_tokens):
    params = [
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[hf_tokens[0][9]], logprobs=2),
        SamplingParams(temperature=0, max_tokens=5, logprobs=0),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),  # until max_model_len
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[hf_tokens[3][12]]),
        SamplingParams(temperature=0, max_tokens=1),
    ]
    plain, _ = _run(model_dir, params, speculative_config=None, num_kv_pages=128, max_model_len=64)
    spec, llm = _run(model_dir, params, num_kv_pages=128, max_model_len=64)
    assert _stats(llm).num_accepted_tokens > 0

    def comparable(c):
        lps = [{t: round(v.logprob, 4) for t, v in e.items()} for e in c.logprobs] if c.logprobs else None
        return c.token_ids, c.finish_reason, c.stop_reason, lps

    assert [comparable(c) for c in spec] == [comparable(c) for c in plain]
    assert spec[2].finish_reason == "length" and len(PROMPTS[2]) + len(spec[2].token_ids) == 64


def test_disable_by_batch_size_turns_speculation_off_for_big_steps(model_dir, hf_tokens):
    config = {**NGRAM, "disable_by_batch_size": 2}
    outs, llm = _run(model_dir, _greedy(), speculative_config=config, num_kv_pages=128)
    assert [o.token_ids for o in outs] == hf_tokens
    s = _stats(llm)
    assert s.num_drafts == 0  # five requests run together from the first step to the last
    outs, llm = _run(model_dir, _greedy(), speculative_config=config, prompts=PROMPTS[:2], num_kv_pages=128)
    assert [o.token_ids for o in outs] == hf_tokens[:2] and _stats(llm).num_drafts > 0


def test_steps_above_disable_by_batch_size_run_as_without_speculation(model_dir, hf_tokens):
    """T1's steps with `disable_by_batch_size` set: the proposer is never asked, and under async
    scheduling every step is launched before the one in flight is resolved (no sync for speculation)."""
    llm = LLM(str(model_dir), dtype="float32", speculative_config={**NGRAM, "disable_by_batch_size": 2},
              async_scheduling=True, num_kv_pages=128)
    core = llm.core
    proposed, launched_behind = [], []
    proposer = core.scheduler.spec.proposer
    propose, launch = proposer.propose, core.runner.launch
    proposer.propose = lambda reqs, budgets: proposed.append(len(reqs)) or propose(reqs, budgets)

    def recording(sched, prev=None, **kwargs):
        launched_behind.append(prev is not None)
        return launch(sched, prev, **kwargs)

    core.runner.launch = recording
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())] == hf_tokens
    assert proposed == [] and _stats(llm).num_drafts == 0
    # The first step has nothing before it; each later one went behind the one in flight.
    assert len(launched_behind) >= NEW_TOKENS and not launched_behind[0] and all(launched_behind[1:])


# --- sampling -----------------------------------------------------------------------------------

def test_seeded_sampling_is_identical_with_and_without_speculation(model_dir):
    params = [SamplingParams(temperature=0.8, top_k=5, seed=11 + i, max_tokens=NEW_TOKENS, ignore_eos=True,
                             repetition_penalty=1.0 if i % 2 else 1.3, presence_penalty=0.0 if i % 2 else 0.4)
              for i in range(len(PROMPTS))]
    plain, _ = _run(model_dir, params, speculative_config=None, num_kv_pages=128)
    spec, llm = _run(model_dir, params, num_kv_pages=128)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert _stats(llm).num_accepted_tokens > 0


def _chi2_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.999 (z: the normal quantile), Wilson-Hilferty's approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def test_sampled_output_keeps_the_targets_distribution(model_dir):
    """2,000 unseeded samples of 3 tokens at temperature 1 over each position's top 3 tokens (27
    sequences), with drafts that replay the greedy continuation (kept for about one in eight): the
    frequency of each sequence against its probability under the model (transformers'), by
    chi-square at p = 0.001."""
    prompt = PROMPTS[2]
    top_k, n, length = 3, 2000, 3
    greedy = hf_greedy(model_dir, [prompt], length)[0]
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=length, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=512, seed=5, speculative_config=NGRAM)
    llm.core.scheduler.spec = SpecDecoder(llm.core.scheduler.spec.config,
                                          ReplayProposer({tuple(prompt): greedy}, 1.0, llm.core.vocab_size))
    outs = llm.generate([prompt] * n, params)
    _assert_pool_free(llm)
    s = _stats(llm)
    assert s.num_accepted_tokens > 0.1 * n and s.num_draft_tokens - s.num_accepted_tokens > 0.1 * n
    assert_target_distribution(model_dir, prompt, outs, top_k, length)


def assert_target_distribution(model_dir, prompt, outs, top_k: int, length: int) -> None:
    """The frequency of each sampled sequence in `outs` (temperature 1 over each position's top
    `top_k` tokens) against its probability under transformers' model, by chi-square at p = 0.001."""
    n = len(outs)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def dist(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        values, ids = logits.topk(top_k)
        return dict(zip(ids.tolist(), torch.softmax(values, -1).tolist()))

    expected = {(): 1.0}
    for _ in range(length):
        expected = {seq + (t,): p * q for seq, p in expected.items() for t, q in dist(seq).items()}
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(seq, 0) - n * p) ** 2 / (n * p) for seq, p in expected.items())
    assert chi2 < _chi2_critical(len(expected) - 1), (chi2, counts)


# --- KV pages -----------------------------------------------------------------------------------

def test_refused_drafts_leave_no_pages_behind(model_dir):
    """After every step each running request holds exactly the pages its computed tokens fill:
    none for drafts it refused."""
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128, block_size=2,
              speculative_config={**NGRAM, "num_speculative_tokens": 5})
    core = llm.core
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt,
                                           sampling_params=_greedy()))
    refused = 0
    while core.has_unfinished_requests():
        core.step()
        s = _stats(llm)
        refused = s.num_draft_tokens - s.num_accepted_tokens
        for req in core.scheduler.running:
            assert len(core.kv.req_pages[req.request_id]) == -(-req.num_computed_tokens // 2), req.request_id
    assert refused > 0
    _assert_pool_free(llm)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
def test_tensor_or_pipeline_parallel_greedy_tokens_equal_hf(model_dir, hf_tokens, layout):
    """TP=2 or PP=2 over gloo (two processes): the verification step is a step like any other, its
    logits gathered on rank 0 (TP) or computed on the last stage (PP), which samples. The pipeline's
    batch queue schedules a request again only once its batch, drafts and all, has been resolved."""
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128, max_num_batched_tokens=16, speculative_config=NGRAM,
              **layout)
    try:
        outs = llm.generate(PROMPTS, _greedy())
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
        assert _stats(llm).num_accepted_tokens > 0
        _assert_pool_free(llm)
    finally:
        llm.close()


def test_requests_with_a_token_in_flight_get_no_draft_and_constrained_ones_do():
    from pagoda_engine.core.request import Request
    from pagoda_engine.speculative import parse_speculative_config

    spec = SpecDecoder(parse_speculative_config(NGRAM))

    def decoding(rid, **fields):
        req = Request(rid, [1, 2, 3, 1, 2], SamplingParams(max_tokens=10), **fields)
        req.output_token_ids, req.num_computed_tokens = [3], 5
        return req

    plain, constrained, in_flight = decoding("a"), decoding("b", grammar=object()), decoding("c")
    in_flight.num_output_placeholders = 1
    spec.propose([plain, constrained, in_flight], max_model_len=64)
    # A grammar does not filter drafts: verification samples under its masks (test_constrained_decoding.py).
    assert plain.spec_token_ids == constrained.spec_token_ids == [1, 2, 3] and in_flight.spec_token_ids == []
    near_end = decoding("d")
    near_end.sampling_params = SamplingParams(max_tokens=3)  # 1 written: 2 more, so one draft at most
    spec.propose([near_end], max_model_len=64)
    assert near_end.spec_token_ids == [1]


def test_the_log_line_is_vllms(caplog):
    from pagoda_engine.speculative import parse_speculative_config

    spec = SpecDecoder(parse_speculative_config(NGRAM))
    spec.observe(3, 2)
    spec.observe(3, 0)
    with caplog.at_level("INFO", logger="pagoda_engine.core.spec_decode"):
        spec.log()
    line = caplog.records[-1].getMessage()
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.00, ")
    assert "Accepted: 2 tokens, Drafted: 6 tokens, Per-position acceptance rate: 0.500, 0.500, 0.000" in line
    assert line.endswith("Avg Draft acceptance rate: 33.3%")

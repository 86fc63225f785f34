"""Speculative decoding with a draft model (`{"method": "draft_model", "model": DIR}`): greedy output
identical to Hugging Face's (so to decoding without speculation) under chunked prefill, prefix hits,
preemption and async scheduling; every draft is the draft model's own greedy continuation of the
request's tokens (transformers' forward of the draft, from scratch), so the drafting KV kept
across steps, pages and preemptions is right; the target as its own draft keeps every draft;
sampled output keeps the target's distribution; refused drafts leave no pages behind; a draft of
another tokenizer is refused at start-up."""

import json
import shutil

import pytest
import torch
import transformers

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.tiny import build_tiny_model

from test_generate_vs_hf import _assert_pool_free, hf_greedy
from test_spec_decode import NEW_TOKENS, PROMPTS, _greedy, assert_target_distribution

K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "model", arch="llama", seed=3)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    # One layer, other weights: a draft that agrees with the target now and then.
    return build_tiny_model(tmp_path_factory.mktemp("draft") / "model", arch="llama", seed=3,
                            config_overrides={"num_hidden_layers": 1})


@pytest.fixture(scope="module")
def hf_tokens(model_dir):
    return hf_greedy(model_dir, PROMPTS, NEW_TOKENS)


def _config(draft, k=K, **extra):
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, **extra}


def _recording(llm) -> list[tuple[list[int], list[int]]]:
    """Every (request's tokens, drafts) the proposer returns from now on."""
    proposer = llm.core.scheduler.spec.proposer
    records, propose = [], proposer.propose

    def recorded(reqs, num_drafts):
        drafts = propose(reqs, num_drafts)
        records.extend((list(r.all_token_ids), list(d)) for r, d in zip(reqs, drafts))
        return drafts

    proposer.propose = recorded
    return records


def _assert_drafts_are_greedy_continuations(draft_dir, records):
    """Each draft is the draft model's argmax continuation of the tokens it drafted after."""
    assert records
    model = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    for tokens, draft in records:
        ids = list(tokens)
        with torch.no_grad():
            for _ in draft:
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert draft == ids[len(tokens):], tokens


def _stats(llm):
    return llm.core.scheduler.spec.stats


@pytest.mark.parametrize("budget, async_scheduling", [(8192, False), (7, False), (7, True)])
def test_greedy_tokens_equal_hf_and_drafts_are_the_drafts_greedy(model_dir, draft_dir, hf_tokens, budget,
                                                                 async_scheduling):
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128, block_size=4, max_num_batched_tokens=budget,
              async_scheduling=async_scheduling, speculative_config=_config(draft_dir))
    records = _recording(llm)
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    assert llm.core.kv.prefix_hits > 0
    s = _stats(llm)
    assert s.num_drafts == len(records) and s.num_draft_tokens > s.num_accepted_tokens
    _assert_pool_free(llm)
    _assert_drafts_are_greedy_continuations(draft_dir, records)


def test_the_target_as_its_own_draft_keeps_every_draft(model_dir, hf_tokens):
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128, block_size=4, max_num_batched_tokens=7,
              speculative_config=_config(model_dir, k=4))
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    s = _stats(llm)
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    assert s.accepted_per_pos[-1] > 0  # full drafts of k, kept whole


def test_preemption_keeps_greedy_tokens_and_drafts(model_dir, draft_dir, hf_tokens):
    # 19 usable pages of 4 tokens (one request needs up to 16): the five cannot all stay resident.
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=20, block_size=4, max_model_len=64,
              kv_growth_reservation=False, speculative_config=_config(draft_dir))
    records = _recording(llm)
    outs = llm.generate(PROMPTS, _greedy())
    assert llm.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens
    _assert_pool_free(llm)
    _assert_drafts_are_greedy_continuations(draft_dir, records)


def test_refused_drafts_leave_no_pages_behind(model_dir, draft_dir):
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128, block_size=2,
              speculative_config=_config(draft_dir, k=5))
    core = llm.core
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=_greedy()))
    while core.has_unfinished_requests():
        core.step()
        for req in core.scheduler.running:
            assert len(core.kv.req_pages[req.request_id]) == -(-req.num_computed_tokens // 2), req.request_id
    s = _stats(llm)
    assert s.num_draft_tokens - s.num_accepted_tokens > 0
    _assert_pool_free(llm)


def test_seeded_sampling_is_identical_with_and_without_speculation(model_dir):
    params = [SamplingParams(temperature=0.8, top_k=5, seed=11 + i, max_tokens=NEW_TOKENS, ignore_eos=True)
              for i in range(len(PROMPTS))]
    plain = LLM(str(model_dir), dtype="float32", num_kv_pages=128).generate(PROMPTS, params)
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128, speculative_config=_config(model_dir))
    spec = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert _stats(llm).num_accepted_tokens > 0


def test_sampled_output_keeps_the_targets_distribution(model_dir):
    """2,000 unseeded samples of 3 tokens at temperature 1 over each position's top 3 tokens,
    drafted by the target itself (its greedy tokens: kept about as often as they are sampled):
    each sequence's frequency against its probability under transformers' model, chi-square at
    p = 0.001."""
    prompt = PROMPTS[2]
    top_k, n, length = 3, 2000, 3
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=length, ignore_eos=True)
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=512, seed=5, speculative_config=_config(model_dir, k=2))
    outs = llm.generate([prompt] * n, params)
    _assert_pool_free(llm)
    s = _stats(llm)
    assert s.num_accepted_tokens > 0.1 * n and s.num_draft_tokens - s.num_accepted_tokens > 0.1 * n
    assert_target_distribution(model_dir, prompt, outs, top_k, length)


# --- refused at start-up ------------------------------------------------------------------------

def test_a_draft_of_another_vocabulary_is_refused_naming_both(model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "other", arch="llama", seed=1,
                             config_overrides={"num_hidden_layers": 1, "vocab_size": 600})
    with pytest.raises(ModelLoadError, match=r"vocabulary of 600 tokens, the target's has \d+"):
        LLM(str(model_dir), dtype="float32", num_kv_pages=32, speculative_config=_config(other))


def test_a_draft_of_another_tokenizer_is_refused_naming_both(model_dir, draft_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(draft_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # same size, two tokens' ids swapped
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="does not share the tokenizer") as e:
        LLM(str(model_dir), dtype="float32", num_kv_pages=32, speculative_config=_config(other))
    assert str(other) in str(e.value) and str(model_dir) in str(e.value)


def test_a_missing_draft_is_refused_naming_it(model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere"):
        LLM(str(model_dir), dtype="float32", num_kv_pages=32, speculative_config=_config(tmp_path / "nowhere"))


def test_a_draft_with_fewer_positions_than_max_model_len_is_refused(model_dir, tmp_path):
    short = build_tiny_model(tmp_path / "short", arch="llama", seed=1,
                             config_overrides={"num_hidden_layers": 1, "max_position_embeddings": 64})
    with pytest.raises(ModelLoadError, match="at most 64 positions.*--max-model-len"):
        LLM(str(model_dir), dtype="float32", num_kv_pages=32, max_model_len=128, speculative_config=_config(short))
    LLM(str(model_dir), dtype="float32", num_kv_pages=32, max_model_len=64, speculative_config=_config(short))


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "async_scheduling": True},
                                    {"pipeline_parallel_size": 2}], ids=["tp", "tp-async", "pp"])
def test_under_tensor_or_pipeline_parallelism_the_whole_draft_drafts_on_rank_0(model_dir, draft_dir, hf_tokens,
                                                                               layout):
    """Two ranks over gloo, real processes: the target sharded or staged, the draft model whole on
    rank 0. The target as its own draft keeps every draft (the whole model drafts what the shards
    or stages verify)."""
    for draft in (draft_dir, model_dir):
        with LLM(str(model_dir), dtype="float32", num_kv_pages=128, block_size=4, speculative_config=_config(draft),
                 **layout) as llm:
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy())] == hf_tokens
            s = _stats(llm)
            assert s.num_draft_tokens > 0 and (s.num_accepted_tokens == s.num_draft_tokens) == (draft == model_dir)


def test_a_draft_model_needs_its_model():
    from pagoda_engine.speculative import InvalidSpeculativeConfigError, parse_speculative_config

    with pytest.raises(InvalidSpeculativeConfigError, match='needs "model"'):
        parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(InvalidSpeculativeConfigError, match="prompt_lookup_max does not apply"):
        parse_speculative_config({"method": "draft_model", "model": "x", "num_speculative_tokens": 2,
                                  "prompt_lookup_max": 3})


def test_drafting_kv_is_valid_up_to_the_first_refused_draft_and_forgotten_on_preemption():
    from pagoda_engine.core.draft_proposer import ModelProposer
    from pagoda_engine.core.kv.manager import KVCacheManager
    from pagoda_engine.core.request import Request
    from pagoda_engine.speculative import parse_speculative_config

    proposer = ModelProposer(parse_speculative_config(_config("x")), None, KVCacheManager(16, 4, True), 8192)

    def decoding(rid):
        req = Request(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=10))
        req.output_token_ids, req.num_computed_tokens = [6], 5
        return req

    req = decoding("a")
    assert proposer._valid(req) == 0  # nothing drafted yet
    proposer._fed["a"] = (req, 0, 6, [7, 8])  # 6 tokens, then drafts 7 and 8 fed (the last draft is never fed)
    req.output_token_ids += [7, 9, 10]  # kept 7, refused 8 (9 sampled instead), then 10
    req.num_computed_tokens = 8
    assert proposer._valid(req) == 7  # tokens 1..6 and the kept draft 7
    req.num_computed_tokens = 6
    assert proposer._valid(req) == 6  # never past the target's computed tokens
    assert proposer._valid(decoding("a")) == 0  # another request of the same id
    req.num_preemptions += 1
    assert proposer._valid(req) == 0


def test_the_warm_up_leaves_no_drafts_counted_and_greedy_tokens_unchanged(model_dir, draft_dir, hf_tokens):
    """A CUDA engine warms up with real requests before it serves (CPU engines skip it; run here by
    hand): they draft, and the counters forget it."""
    from warm_up_steps import warm_up_step_tokens

    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=128, speculative_config=_config(model_dir))
    assert warm_up_step_tokens(llm.core)
    s = _stats(llm)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos) == (0, 0, 0, [0, 0, 0])
    outs = llm.generate(PROMPTS, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == hf_tokens and _stats(llm).num_accepted_tokens > 0
    _assert_pool_free(llm)

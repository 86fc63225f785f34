"""Speculative decoding with EAGLE-3 heads (`{"method": "eagle3", "model": DIR}`) in the format vLLM
loads: the head's forward against an independent plain-torch reading (`eagle3_heads.py`); greedy
output identical to Hugging Face's under chunked prefill, prefix hits, preemption and async
scheduling, under tensor parallelism and on a mixture-of-experts target whose experts span two
engine cores, with every draft the one the independent reading computes from transformers' hidden
states of the target; heads that do not fit the target are refused at start-up."""

import pytest
import torch

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.executor_types import AttentionBatch
from pagoda_engine.tiny import build_tiny_model
from pagoda_engine.worker.attention import get_attention_backend
from pagoda_engine.worker.model.eagle3 import load_eagle3_config, load_eagle3_head
from pagoda_engine.worker.model.loader import load_hf_config, load_model

from eagle3_heads import ReferenceEagle3, write_eagle3_head
from lockstep_cores import add_greedy, finish, run_lockstep, start_core
from spawned_ranks import run_ranks
from test_generate_vs_hf import _assert_pool_free, hf_greedy
from test_spec_decode import NEW_TOKENS, PROMPTS, _greedy

DRAFT_VOCAB = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Six layers: the head reads the hidden states entering layers 2, 3 and 3 (vLLM's 2, L/2, L-3).
    return build_tiny_model(tmp_path_factory.mktemp("llama6") / "model", arch="llama", seed=3,
                            config_overrides={"num_hidden_layers": 6})


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, model_dir):
    return write_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", model_dir, DRAFT_VOCAB, seed=1)


@pytest.fixture(scope="module")
def reference(head_dir, model_dir):
    return ReferenceEagle3(head_dir, model_dir)


@pytest.fixture(scope="module")
def hf_tokens(model_dir):
    return hf_greedy(model_dir, PROMPTS, NEW_TOKENS)


def _config(head, k=3):
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}


def test_the_heads_forward_matches_an_independent_reading(model_dir, head_dir, reference):
    target_cfg = load_hf_config(str(model_dir))
    target = load_model(str(model_dir), target_cfg, torch.float32, torch.device("cpu"))
    head = load_eagle3_head(str(head_dir), load_eagle3_config(str(head_dir)), target.model.embed_tokens, target_cfg,
                            torch.float32, torch.device("cpu"), "auto", 0)
    assert head.aux_layers(6) == (2, 3, 3)
    tokens = PROMPTS[2]
    features = reference.target_features(tokens).detach()
    aux = torch.randn(len(tokens), 3 * target_cfg.hidden_size)
    torch.testing.assert_close(head.combine(aux), aux @ reference.w["fc.weight"].T, rtol=1e-5, atol=1e-5)

    page_size, t = 4, len(tokens) - 1
    attn = get_attention_backend("torch", head.kv_cache_spec(page_size, torch.float32), 16, torch.device("cpu"))
    attn.plan(AttentionBatch(query_lens=[t], seq_lens=[t], page_tables=[list(range(1, 16))],
                             slot_mapping=torch.arange(page_size, page_size + t)))
    with torch.no_grad():
        normed, prenorm = head(torch.tensor(tokens[1:]), torch.arange(t), features[:t].clone(), attn)
        want_normed, want_prenorm = reference.forward(tokens[1:], features[:t])
    torch.testing.assert_close(prenorm, want_prenorm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(normed, want_normed, rtol=1e-4, atol=1e-4)
    best = int(head.compute_logits(normed[-1:]).argmax())
    assert int(head.draft_token_ids(head.compute_logits(normed[-1:]))[0]) == reference.draft_token(want_normed[-1])
    assert reference.draft_token(want_normed[-1]) == best + int(reference.w["d2t"][best])


def _recording(core) -> list[tuple[list[int], list[int], bool]]:
    """Every (request's tokens, drafts, whether it found its prefix in the cache) an engine core's
    proposer returns from now on."""
    proposer = core.scheduler.spec.proposer
    records, propose = [], proposer.propose

    def recorded(reqs, num_drafts):
        drafts = propose(reqs, num_drafts)
        records.extend((list(r.all_token_ids), list(d), r.num_cached_tokens > 0) for r, d in zip(reqs, drafts))
        return drafts

    proposer.propose = recorded
    return records


@pytest.mark.parametrize("kwargs", [
    dict(max_num_batched_tokens=8192, async_scheduling=False),
    dict(max_num_batched_tokens=7, async_scheduling=True),
    # 19 usable pages of 4 tokens (one request needs up to 16): preemptions
    dict(num_kv_pages=20, max_model_len=64, kv_growth_reservation=False),
    # Two gloo ranks: the head whole on rank 0, embedding with the target's embedding gathered there
    dict(max_num_batched_tokens=8192, tensor_parallel_size=2),
], ids=["whole-prompts", "chunked-async", "preemption", "tensor-parallel"])
def test_greedy_tokens_equal_hf_and_drafts_are_the_heads(model_dir, head_dir, reference, hf_tokens, kwargs):
    kwargs = {"num_kv_pages": 128, "block_size": 4, **kwargs}
    with LLM(str(model_dir), dtype="float32", speculative_config=_config(head_dir), **kwargs) as llm:
        records = _recording(llm.core)
        outs = llm.generate(PROMPTS, _greedy())
        assert [o.outputs[0].token_ids for o in outs] == hf_tokens
        if kwargs["num_kv_pages"] == 20:
            assert llm.core.scheduler.num_preemptions > 0
        else:
            assert llm.core.kv.prefix_hits > 0
        _assert_pool_free(llm)
        assert records and llm.core.scheduler.spec.stats.num_drafts == len(records)
    # A request that found its prefix in the cache reads, at the last position of the shared
    # pages, the head's entry of the request that computed them (its next token may differ):
    # its drafts may differ from the head's own there, so only the others are compared.
    exact = [(tokens, draft) for tokens, draft, hit in records if not hit]
    assert len(exact) > len(records) / 2
    for tokens, draft in exact:
        assert draft == reference.drafts(tokens, len(draft)), tokens


def test_pipeline_parallelism_is_refused_naming_why():
    with pytest.raises(ValueError, match="'eagle3' is not supported under pipeline parallelism yet: the head reads"):
        EngineConfig.from_kwargs(pipeline_parallel_size=2, speculative_config=_config("x"))


def test_a_model_that_is_not_an_eagle3_head_is_refused(model_dir):
    with pytest.raises(ModelLoadError, match="is not an EAGLE-3 head: config.json names LlamaForCausalLM"):
        LLM(str(model_dir), dtype="float32", num_kv_pages=32, speculative_config=_config(model_dir))


def test_a_head_for_a_target_too_shallow_is_refused(tmp_path, head_dir):
    shallow = build_tiny_model(tmp_path / "shallow", arch="llama", seed=3)  # 2 layers: (2, 1, -1)
    with pytest.raises(ModelLoadError, match=r"reads the target's layers \(2, 1, -1\), but the target has 2"):
        LLM(str(shallow), dtype="float32", num_kv_pages=32, speculative_config=_config(head_dir))


def test_a_head_narrower_than_the_target_without_its_own_embedding_is_refused(tmp_path, model_dir):
    """A head with no embedding embeds tokens with the target's, which must then be its width."""
    narrow = write_eagle3_head(tmp_path / "narrow", model_dir, DRAFT_VOCAB, seed=4, hidden=32, heads=2, head_dim=16,
                               intermediate=64)
    with pytest.raises(ModelLoadError, match="no embedding of its own.*its hidden size is 32"):
        LLM(str(model_dir), dtype="float32", num_kv_pages=32, speculative_config=_config(narrow))


# (prompt, max_tokens) per core: core 0's two end after 10 and 6 tokens, core 1's after 4 (it idles after).
MOE_REQUESTS = {0: [([5, 6, 7, 5, 6, 7, 5], 10), ([(3 * i + 1) % 400 + 5 for i in range(21)], 6)],
                1: [([42] * 9, 4)]}


def _lockstep_core(rank: int, port: int, model_dir: str, head_dir: str, results) -> None:
    """One of two engine cores whose MoE layers span both, speculating with the head: its greedy
    tokens and drafts."""
    core = start_core(rank, port, model=model_dir, dtype="float32", num_kv_pages=64, block_size=4,
                      max_model_len=256, max_num_seqs=8, speculative_config=_config(head_dir))
    records = _recording(core)
    requests = add_greedy(core, rank, MOE_REQUESTS[rank])
    run_lockstep(core)
    finish(core, results, (rank, [list(r.output_token_ids) for r in requests], records))


def test_with_experts_across_two_cores_each_cores_drafts_are_the_heads(tmp_path):
    """Each core keeps the target's hidden states of its own eager forwards (never of the other
    core's, nor of its idle turns' dummy batches): its drafts are the independent reading's."""
    moe = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=5, config_overrides={"num_hidden_layers": 6})
    head = write_eagle3_head(tmp_path / "head", moe, DRAFT_VOCAB, seed=2)
    with LLM(str(moe), dtype="float32", num_kv_pages=64) as llm:
        expected = {rank: [list(llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
                                .outputs[0].token_ids) for p, n in reqs] for rank, reqs in MOE_REQUESTS.items()}
    got = {rank: rest for rank, *rest in run_ranks(_lockstep_core, (0, 1), lambda rank: (str(moe), str(head)))}
    reference = ReferenceEagle3(head, moe)
    for rank in (0, 1):
        tokens, records = got[rank]
        assert tokens == expected[rank], rank
        exact = [(t, d) for t, d, hit in records if not hit]
        assert exact, rank
        for t, d in exact:
            assert d == reference.drafts(t, len(d)), (rank, t)

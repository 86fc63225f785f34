"""Speculative decoding on the GPU (FlashInfer, CUDA graphs, async scheduling): the greedy tokens
of decoding without speculation (a token may differ only at a tie within bf16 rounding: the
verification step's attention sums in another order than the decode graph's), with chunked
prefill and preemption; drafts replayed from the greedy continuation are all kept; refused drafts
leave no pages behind. Verification steps replay their own whole-forward graphs
(`worker/verify_graphs.py`), whose kernel (`attention/verify_triton.py`) matches float32 causal
attention at Llama-3.1-8B's heads, eager and replayed."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_support import CUDA, make_llm, random_prompts, requires_gpu
from paged_attention_reference import random_csr
from pagoda_engine import SamplingParams
from pagoda_engine.bench.spec_replay import ReplayProposer
from pagoda_engine.core.spec_decode import SpecDecoder
from test_gpu_async_scheduling import ACCUMULATED_TIE

pytestmark = [pytest.mark.gpu, requires_gpu]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def _copying_prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so that prompt lookup drafts (and some drafts are kept)."""
    return [p * 4 for p in random_prompts(7, [5, 9, 13, 3, 20, 7])]


def _assert_same_or_tie(plain, spec):
    for (a_ids, a_lps), (b_ids, _) in zip(plain, spec):
        if a_ids != b_ids:
            at = next(i for i, (a, b) in enumerate(zip(a_ids, b_ids)) if a != b)
            best, second = sorted((lp.logprob for lp in a_lps[at].values()), reverse=True)[:2]
            assert best - second <= ACCUMULATED_TIE, (at, best, second)


@pytest.mark.parametrize("engine_kwargs", [
    dict(max_num_batched_tokens=64),
    dict(num_kv_pages=10, block_size=16, max_model_len=256, kv_growth_reservation=False),
])
def test_greedy_tokens_equal_decoding_without_speculation(gpu_model_dir, engine_kwargs):
    prompts = _copying_prompts()
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    results = []
    for speculative_config in (None, NGRAM):
        llm = make_llm(gpu_model_dir, speculative_config=speculative_config, **engine_kwargs)
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        kv = llm.core.kv
        assert kv.num_free_pages == kv.pool.num_pages - 1, "pages leaked"
        if speculative_config is not None:
            stats = llm.core.scheduler.spec.stats
            assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
        if "num_kv_pages" in engine_kwargs:
            assert llm.core.scheduler.num_preemptions > 0
    _assert_same_or_tie(*results)


def test_replayed_greedy_drafts_are_all_kept(gpu_model_dir):
    prompts = random_prompts(3, [40, 90])
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm = make_llm(gpu_model_dir, speculative_config=NGRAM)
    spec = llm.core.scheduler.spec
    llm.core.scheduler.spec = None
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.core.scheduler.spec = replay = SpecDecoder(
        spec.config, ReplayProposer({tuple(p): g for p, g in zip(prompts, greedy)}, 1.0, llm.core.vocab_size))
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    s = replay.stats
    # Every draft kept while the two runs agree; a bf16 tie may part them once, then drafts miss.
    assert s.num_accepted_tokens >= 0.8 * s.num_draft_tokens, s
    assert sum(a == b for x, y in zip(greedy, again) for a, b in zip(x, y)) >= 0.8 * sum(map(len, greedy))


def test_verification_steps_replay_their_graphs_and_keep_greedy_tokens(gpu_model_dir):
    """Every step that verifies drafts replays a verification graph (none runs as piecewise graphs
    or eagerly), and the tokens are those of decoding without speculation, ties aside."""
    prompts = _copying_prompts()[:2]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    results = []
    for speculative_config in (None, NGRAM):
        llm = make_llm(gpu_model_dir, speculative_config=speculative_config)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))  # their full pages: prefix hits below
        [before] = llm.core.executor.collective_rpc("graph_replays")
        outs = llm.generate(prompts, params)
        [after] = llm.core.executor.collective_rpc("graph_replays")
        replays = {kind: after[kind] - before[kind] for kind in after}
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        if speculative_config is None:
            assert llm.core.executor.worker.verify_graphs is None
            continue
        graphs = llm.core.executor.worker.verify_graphs
        assert graphs is not None and graphs.query_len == 5
        assert replays["verify"] > 0 and replays["piecewise"] <= 1, replays  # at most the prompts' last pages
        assert llm.core.scheduler.spec.stats.num_drafts > 0
    _assert_same_or_tie(*results)


def _reference_verify(q_rows, cache, indptr, indices, last, page_size):
    outs = []
    for b, q in enumerate(q_rows):
        pages = indices[indptr[b]:indptr[b + 1]].long().to(cache.device)
        n = (len(pages) - 1) * page_size + int(last[b])
        k, v = (cache[pages, i].reshape(-1, *cache.shape[3:])[:n].float() for i in (0, 1))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("jhd,nhd->jhn", q.float(), k) * q.shape[-1] ** -0.5
        visible = torch.arange(n, device=cache.device)[None, :] <= (
            n - q.shape[0] + torch.arange(q.shape[0], device=cache.device))[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        outs.append(torch.einsum("jhn,nhd->jhd", scores.softmax(-1), v))
    return outs


@pytest.mark.parametrize("query_len", [3, 5, 9])
def test_verification_kernel_matches_float32_attention_eager_and_in_a_graph(query_len):
    """Llama-3.1-8B's heads (32 over 8, 128), bf16 pages of 16; one to eight requests of 1 ..
    query_len new tokens, lengths from a few tokens to past MAX_SPLITS blocks; the same bits from a
    CUDA graph replayed over new inputs."""
    from pagoda_engine.worker.attention.decode_triton import BLOCK_N, MAX_SPLITS
    from pagoda_engine.worker.attention.verify_triton import VerifyDecode, padded_rows

    num_qo, num_kv, head_dim, page_size, num_pages = 32, 8, 128, 16, 1500
    rng = random.Random(query_len)
    gen = torch.Generator(device=CUDA).manual_seed(query_len)
    cache = torch.randn(num_pages, 2, page_size, num_kv, head_dim, generator=gen, device=CUDA).bfloat16()
    long = MAX_SPLITS * BLOCK_N + 3 * BLOCK_N + 1
    verify = VerifyDecode(8, query_len, num_qo, num_kv, head_dim, page_size, CUDA)
    for seq_lens in ([query_len], [640], [long], [9, 700, 130, long, 64, 65, 2000, 17]):
        qo_lens = [rng.randint(1, query_len) for _ in seq_lens]
        seq_lens = [max(s, q) for s, q in zip(seq_lens, qo_lens)]
        indptr, indices, last = (a.to(CUDA) for a in random_csr(seq_lens, page_size, num_pages, rng))
        q = torch.randn(len(seq_lens) * query_len, num_qo, head_dim, generator=gen, device=CUDA).bfloat16()
        rows = torch.from_numpy(padded_rows(qo_lens, query_len)).to(CUDA)
        qo = torch.tensor(qo_lens, dtype=torch.int32, device=CUDA)
        out = torch.zeros_like(q)
        verify(q, *cache.unbind(1), indptr, indices, last, qo, out=out)
        starts = [sum(qo_lens[:i]) for i in range(len(qo_lens))]
        want = _reference_verify([q[rows[s:s + n]] for s, n in zip(starts, qo_lens)], cache, indptr.cpu(),
                                 indices.cpu(), last.cpu(), page_size)
        for s, n, expected in zip(starts, qo_lens, want):
            torch.testing.assert_close(out[rows[s:s + n]].float(), expected, atol=2e-2, rtol=2e-2)
        assert not verify.counters.any()
        graph = torch.cuda.CUDAGraph()
        replayed = torch.zeros_like(q)
        with torch.cuda.graph(graph):
            verify(q, *cache.unbind(1), indptr, indices, last, qo, out=replayed)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed[rows], out[rows])

"""The sampler on plain tensors: greedy, temperature, top-k/top-p/min-p, seeds, penalties,
min_tokens, logprobs and prompt logprobs (vLLM's semantics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagoda_engine.core.request import Request
from pagoda_engine.core.sampling_batch import sampling_batch
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.worker.sampling import (
    Sampler,
    apply_penalties_and_masks,
    apply_top_k_top_p,
    compute_prompt_logprobs,
)

CPU = torch.device("cpu")
V = 50


def req(prompt=(1, 2, 3), output=(), eos=(), rid="r", **params) -> Request:
    r = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(**params),
                eos_token_ids=tuple(eos))
    r.output_token_ids = list(output)
    return r


def sample(reqs, logits, seed=0, device=CPU):
    batch = sampling_batch(reqs, logits.shape[1], device)
    return Sampler(seed).sample(logits.to(device), batch)


def rand_logits(rows, vocab=V, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def frequencies(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


# --- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax():
    logits = rand_logits(8)
    out = sample([req(temperature=0.0) for _ in range(8)], logits)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_all_greedy_batch_builds_no_sampling_tensors():
    batch = sampling_batch([req(temperature=0.0) for _ in range(4)], V, CPU)
    assert batch.all_greedy
    assert batch.random_rows is None and batch.temperature is None
    assert batch.output_counts is None and batch.min_tokens_rows is None
    assert not batch.needs_logprobs


def test_empty_batch():
    out = sample([], torch.zeros(0, V))
    assert out.token_ids == [] and out.logprobs == []


def test_top_k_1_is_greedy_under_temperature_1():
    logits = rand_logits(64, seed=1)
    for seed in range(5):
        out = sample([req(temperature=1.0, top_k=1) for _ in range(64)], logits, seed=seed)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_1_breaks_ties_like_argmax():
    logits = torch.zeros(4, V)
    logits[:, [7, 3, 30]] = 5.0  # three-way tie for the max: argmax picks the lowest id
    out = sample([req(top_k=1) for _ in range(4)], logits)
    assert out.token_ids == [3] * 4 == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = rand_logits(64, seed=2)
    out = sample([req(temperature=1.5, top_p=1e-6) for _ in range(64)], logits, seed=3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_min_p_1_keeps_only_the_most_likely_tokens():
    logits = rand_logits(64, seed=4)
    logits[:8, 5] = logits[:8].amax(-1) + 1  # a clear max in some rows
    out = sample([req(temperature=0.8, min_p=1.0) for _ in range(64)], logits, seed=5)
    assert out.token_ids == logits.argmax(-1).tolist()


# --- the allowed set and the distribution ---------------------------------------------------------

SMALL_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 4000


def draw(params, temperature=1.0, seed=0):
    """DRAWS samples of SMALL_LOGITS in one call: every row is the same request, unseeded."""
    reqs = [req(temperature=temperature, **params) for _ in range(DRAWS)]
    return sample(reqs, SMALL_LOGITS.expand(DRAWS, -1).clone(), seed=seed).token_ids


def expected(allowed: list[int], temperature=1.0):
    probs = torch.zeros_like(SMALL_LOGITS)
    probs[allowed] = torch.softmax(SMALL_LOGITS[allowed] / temperature, -1)
    return probs


def assert_distribution(tokens, probs):
    freq = frequencies(tokens, len(probs))
    allowed = set(torch.nonzero(probs).flatten().tolist())
    assert set(tokens) <= allowed
    # Every allowed token that should turn up about 20 times or more does (else the set check is idle).
    assert {t for t in allowed if probs[t] * DRAWS >= 20} <= set(tokens)
    # 4000 draws: a binomial's standard deviation is at most 0.008; allow about 4 of them.
    assert torch.allclose(freq, probs, atol=0.03), (freq, probs)


def test_temperature_samples_the_softmax():
    assert_distribution(draw({}, temperature=1.0), expected(list(range(8))))
    assert_distribution(draw({}, temperature=0.5, seed=1), expected(list(range(8)), temperature=0.5))


def test_top_k_samples_only_the_k_most_likely():
    assert_distribution(draw({"top_k": 3}), expected([0, 1, 2]))


def test_top_p_samples_the_nucleus():
    probs = torch.softmax(SMALL_LOGITS, -1)  # 0.40, 0.25, 0.15, 0.09, ... (descending by id)
    mass_before = probs.cumsum(-1) - probs
    top_p = 0.7
    nucleus = [i for i in range(8) if mass_before[i] < top_p]
    assert nucleus == [0, 1, 2]  # the smallest prefix whose mass reaches 0.7 (0.40 + 0.25 + 0.15)
    assert_distribution(draw({"top_p": top_p}), expected(nucleus))


def test_min_p_drops_unlikely_tokens():
    probs = torch.softmax(SMALL_LOGITS / 0.9, -1)
    min_p = 0.3
    kept = [i for i in range(8) if probs[i] >= min_p * probs.max()]
    assert 1 < len(kept) < 8
    assert_distribution(draw({"min_p": min_p}, temperature=0.9), expected(kept, temperature=0.9))


def test_top_k_then_top_p_renormalises_before_the_nucleus():
    # Over the whole vocabulary the mass before tokens 0..3 is 0, 0.40, 0.65, 0.80, so top_p=0.7 alone
    # keeps three tokens. Within the top 4 (renormalised: 0.46, 0.28, 0.17, 0.10) it is 0, 0.46, 0.73:
    # top_k=4 first, then top_p=0.7, keeps two.
    top4 = torch.softmax(SMALL_LOGITS[:4], -1)
    assert (top4.cumsum(-1) - top4 < 0.7).sum() == 2
    assert_distribution(draw({"top_p": 0.7}), expected([0, 1, 2]))
    assert_distribution(draw({"top_k": 4, "top_p": 0.7}), expected([0, 1]))


def reference_top_k_top_p(row: torch.Tensor, k: int, p: float) -> set[int]:
    """The kept set, straight from the definition: rank the whole row (ties by token id), keep k,
    renormalise, keep while the mass before a token is below p."""
    order = torch.sort(-row, stable=True).indices[:k].tolist()
    probs = torch.softmax(row[order], -1)
    before = probs.cumsum(-1) - probs
    return {t for t, b in zip(order, before.tolist()) if b < p or p >= 1.0}


def test_top_k_top_p_on_a_large_vocabulary_match_the_definition():
    # 1000 tokens: more than the sampler's first candidate window, so peaked rows are decided inside
    # it and flat rows with a wide nucleus must fall back to ranking the whole vocabulary.
    vocab, rows = 1000, 24
    gen = torch.Generator().manual_seed(5)
    scales = torch.tensor([8.0, 2.0, 0.5, 0.05] * (rows // 4))
    logits = torch.randn(rows, vocab, generator=gen) * scales[:, None]
    top_ks = [vocab, 1, 7, 300, vocab, 999] * (rows // 6)
    top_ps = [0.5, 1.0, 0.9, 0.999, 0.95, 0.3, 1.0, 0.999] * (rows // 8)
    batched = apply_top_k_top_p(logits, torch.tensor(top_ks), torch.tensor(top_ps))
    for i in range(rows):
        # Alone, a row without a large top_k gets the small candidate window; in the batch, the
        # largest top_k sets the window for every row. Both must give the definition's set.
        alone = apply_top_k_top_p(logits[i:i + 1], torch.tensor(top_ks[i:i + 1]), torch.tensor(top_ps[i:i + 1]))
        for got in (batched[i], alone[0]):
            kept = set(torch.nonzero(got > float("-inf")).flatten().tolist())
            assert kept == reference_top_k_top_p(logits[i], top_ks[i], top_ps[i]), i
            torch.testing.assert_close(got[sorted(kept)], logits[i][sorted(kept)])
    # The flat rows with a wide nucleus really needed more than the first window.
    assert max(len(reference_top_k_top_p(logits[i], vocab, 0.999)) for i in range(rows)) > 256


def test_ties_rank_by_token_id_on_a_large_vocabulary():
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3))
    tied = [950, 611, 402, 399, 17]
    logits[0, tied] = 10.0
    for k in (1, 2, 3):
        got = apply_top_k_top_p(logits, torch.tensor([k]), None)
        assert torch.nonzero(got[0] > float("-inf")).flatten().tolist() == sorted(tied)[:k]
    got = apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert torch.nonzero(got[0] > float("-inf")).flatten().tolist() == [17] == logits.argmax(-1).tolist()


def test_top_k_alone_on_a_large_vocabulary():
    vocab = 1000
    logits = rand_logits(4, vocab=vocab, seed=8)
    top_ks = [1, 256, 500, vocab]
    got = apply_top_k_top_p(logits, torch.tensor(top_ks), None)
    for i, k in enumerate(top_ks):
        assert set(torch.nonzero(got[i] > float("-inf")).flatten().tolist()) == reference_top_k_top_p(
            logits[i], k, 1.0)


# --- seeds ------------------------------------------------------------------------------------------

def seeded_run(seed, position, others, sampler_seed=0, num_steps=12):
    """Generate num_steps tokens for one seeded request placed at `position` among `others` unseeded
    random rows. The target's logits at each step depend only on the step."""
    sampler = Sampler(sampler_seed)
    target = req(rid="target", seed=seed, temperature=1.0, top_p=0.95)
    for step in range(num_steps):
        rows = [req(rid=f"o{i}", temperature=0.7) for i in range(others)]
        rows.insert(position, target)
        logits = rand_logits(len(rows), seed=1000 + step)
        logits[position] = rand_logits(1, seed=step)[0]
        out = sampler.sample(logits, sampling_batch(rows, V, CPU))
        target.output_token_ids.append(out.token_ids[position])
    return target.output_token_ids


def test_seeded_request_is_reproducible_across_batches_and_positions():
    alone = seeded_run(seed=42, position=0, others=0)
    assert seeded_run(seed=42, position=0, others=0) == alone
    assert seeded_run(seed=42, position=3, others=5, sampler_seed=1) == alone
    assert seeded_run(seed=42, position=7, others=7, sampler_seed=2) == alone
    assert seeded_run(seed=43, position=0, others=0) != alone


def test_seeded_request_resumes_identically_after_preemption():
    full = seeded_run(seed=7, position=0, others=2)
    # Recompute after preemption: the request comes back with the outputs it already had, and the
    # engine's other randomness has moved on; the next token must be the same as without preemption.
    target = req(rid="target", seed=7, temperature=1.0, top_p=0.95, output=full[:6])
    Sampler(123).sample(rand_logits(4), sampling_batch([req(temperature=1.0)] * 4, V, CPU))
    logits = rand_logits(1, seed=6)
    out = Sampler(99).sample(logits, sampling_batch([target], V, CPU))
    assert out.token_ids == [full[6]]


def test_unseeded_rows_vary_with_the_sampler_seed():
    logits = torch.zeros(32, V)  # uniform: 32 draws agreeing by chance has probability 50**-32
    reqs = [req(temperature=1.0) for _ in range(32)]
    a = sample(reqs, logits, seed=0).token_ids
    assert sample(reqs, logits, seed=0).token_ids == a
    assert sample(reqs, logits, seed=1).token_ids != a
    # The engine generator moves on between steps.
    sampler = Sampler(0)
    batch = sampling_batch(reqs, V, CPU)
    assert sampler.sample(logits, batch).token_ids != sampler.sample(logits, batch).token_ids


# --- penalties and min_tokens -------------------------------------------------------------------------

def test_penalties_follow_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    r = req(prompt=[0, 1], output=[2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5,
            presence_penalty=0.25)
    got = apply_penalties_and_masks(logits, sampling_batch([r], 6, CPU))
    # Repetition on tokens seen anywhere (0, 1 in the prompt; 2, 3 in the output): positive / 2,
    # negative * 2. Frequency: 0.5 per output occurrence. Presence: 0.25 once per output token.
    want = torch.tensor([[2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, 3.0 / 2 - 0.5 * 1 - 0.25, -2.0, 1.0]])
    torch.testing.assert_close(got, want)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]))  # input untouched


def test_penalties_follow_the_request_from_step_to_step():
    logits = torch.zeros(1, 6)
    r = req(prompt=[0], presence_penalty=1.0, repetition_penalty=2.0)
    before = apply_penalties_and_masks(logits + 1, sampling_batch([r], 6, CPU))
    torch.testing.assert_close(before, torch.tensor([[0.5, 1, 1, 1, 1, 1]]))
    r.output_token_ids.append(4)
    after = apply_penalties_and_masks(logits + 1, sampling_batch([r], 6, CPU))
    torch.testing.assert_close(after, torch.tensor([[0.5, 1, 1, 1, 0.5 - 1.0, 1]]))
    r.prompt_token_ids = [2]  # a new prompt list is read afresh
    again = apply_penalties_and_masks(logits + 1, sampling_batch([r], 6, CPU))
    torch.testing.assert_close(again, torch.tensor([[1, 1, 0.5, 1, 0.5 - 1.0, 1]]))


def test_penalties_are_per_row():
    logits = rand_logits(3, vocab=6)
    rows = [req(output=[1, 1]), req(output=[1, 1], frequency_penalty=1.0), req(temperature=0.0)]
    got = apply_penalties_and_masks(logits, sampling_batch(rows, 6, CPU))
    want = logits.clone()
    want[1, 1] -= 2.0
    torch.testing.assert_close(got, want)


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    assert sample([req(prompt=[0], temperature=0.0)], logits).token_ids == [0]
    assert sample([req(prompt=[0], temperature=0.0, repetition_penalty=2.0)], logits).token_ids == [1]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])  # EOS 0 best, then stop token 1, then 2
    def greedy(num_outputs, **kw):
        r = req(output=[3] * num_outputs, eos=(0,), temperature=0.0, min_tokens=2, stop_token_ids=[1], **kw)
        return sample([r], logits).token_ids[0]
    assert greedy(0) == 2
    assert greedy(1) == 2
    assert greedy(2) == 0  # reached: EOS allowed again
    # ignore_eos: EOS would not stop the request, but vLLM still masks it while below min_tokens
    # (its all_stop_token_ids hold the EOS ids regardless).
    assert greedy(1, ignore_eos=True) == 2


def test_min_tokens_masks_every_eos_id_in_random_rows():
    logits = torch.zeros(200, 6)
    logits[:, [0, 4]] = 4.0
    rows = [req(eos=(0, 4), min_tokens=1) for _ in range(200)]
    tokens = sample(rows, logits).token_ids
    assert 0 not in tokens and 4 not in tokens and set(tokens) == {1, 2, 3, 5}


# --- logprobs ------------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = rand_logits(6, seed=9)
    rows = [req(output=[5, 5], temperature=1.3, logprobs=3, repetition_penalty=1.5, presence_penalty=1.0)
            for _ in range(6)]
    out = sample(rows, logits, seed=4)
    raw = torch.log_softmax(logits, -1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.chosen.token_id == tok
        assert lp.chosen.logprob == pytest.approx(raw[i, tok].item(), abs=1e-5)
        assert lp.chosen.rank == 1 + int((raw[i] > raw[i, tok]).sum())
        top_vals, top_ids = raw[i].topk(3)
        assert [e.token_id for e in lp.top] == top_ids.tolist()
        assert [e.logprob for e in lp.top] == pytest.approx(top_vals.tolist(), abs=1e-5)
        assert [e.rank for e in lp.top] == [1, 2, 3]
    assert any(lp.chosen.rank > 1 for lp in out.logprobs)  # the ranks above were not all trivial


def test_logprobs_zero_gives_only_the_chosen_token():
    logits = rand_logits(2)
    out = sample([req(temperature=0.0, logprobs=0), req(temperature=0.0)], logits)
    assert out.logprobs[0].top == [] and out.logprobs[0].chosen.rank == 1
    assert out.logprobs[0].chosen.logprob == pytest.approx(torch.log_softmax(logits[0], -1).max().item(), abs=1e-6)
    assert out.logprobs[1] is None


def test_prompt_logprobs():
    logits = rand_logits(5, seed=11)
    targets = torch.tensor([3, 0, 17, 49, 8])
    got = compute_prompt_logprobs(logits, targets, num_top=2)
    raw = torch.log_softmax(logits, -1)
    assert len(got) == 5
    for i, entry in enumerate(got):
        t = targets[i].item()
        assert entry.chosen.token_id == t
        assert entry.chosen.logprob == pytest.approx(raw[i, t].item(), abs=1e-5)
        assert entry.chosen.rank == 1 + int((raw[i] > raw[i, t]).sum())
        assert [e.token_id for e in entry.top] == raw[i].topk(2).indices.tolist()
    assert compute_prompt_logprobs(logits[:0], targets[:0], 2) == []
    assert all(e.top == [] for e in compute_prompt_logprobs(logits, targets, 0))


# --- all of it at once -------------------------------------------------------------------------------

def test_mixed_batch_in_one_call():
    logits = rand_logits(6, seed=21)
    rows = [
        req(rid="greedy", temperature=0.0),
        req(rid="seeded", seed=5, temperature=0.9, top_k=10),
        req(rid="penalised", temperature=0.0, output=[0], repetition_penalty=1.3, frequency_penalty=0.4),
        req(rid="logprobs", temperature=1.0, top_p=0.8, logprobs=2),
        req(rid="min_tokens", temperature=0.0, eos=(1,), min_tokens=3),
        req(rid="min_p", temperature=0.7, min_p=0.2, logprobs=0),
    ]
    logits[4, 1] = 100.0  # EOS is the argmax, but masked
    batch = sampling_batch(rows, V, CPU)
    out = Sampler(0).sample(logits, batch)

    processed = apply_penalties_and_masks(logits, batch)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[2] == processed[2].argmax().item()
    assert out.token_ids[4] == processed[4].argmax().item() != 1
    assert out.token_ids[1] in logits[1].topk(10).indices.tolist()
    probs5 = torch.softmax(logits[5] / 0.7, -1)
    assert probs5[out.token_ids[5]] >= 0.2 * probs5.max()
    assert [lp is not None for lp in out.logprobs] == [False, False, False, True, False, True]
    assert len(out.logprobs[3].top) == 2 and out.logprobs[5].top == []
    # The seeded row does not care about the rest of the batch.
    alone = Sampler(77).sample(logits[1:2], sampling_batch([rows[1]], V, CPU))
    assert alone.token_ids == [out.token_ids[1]]


def test_out_of_vocabulary_prompt_ids_are_ignored_by_penalties():
    logits = torch.ones(1, 4)
    r = req(prompt=[2, 9], repetition_penalty=2.0)  # 9 is past a 4-token LM head
    got = apply_penalties_and_masks(logits, sampling_batch([r], 4, CPU))
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 0.5, 1.0]]))


@pytest.mark.gpu
def test_mixed_batch_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cuda = torch.device("cuda")
    logits = rand_logits(4, seed=3)
    rows = [req(temperature=0.0), req(seed=1, top_k=5, logprobs=1), req(top_p=0.5, min_p=0.1),
            req(temperature=0.0, eos=(int(logits[3].argmax()),), min_tokens=1, presence_penalty=0.5)]
    out = sample(rows, logits, device=cuda)
    again = sample([rows[1]], logits[1:2], seed=9, device=cuda)
    assert out.token_ids[0] == logits[0].argmax().item()
    assert out.token_ids[1] in logits[1].topk(5).indices.tolist() and again.token_ids == [out.token_ids[1]]
    assert out.token_ids[3] == logits[3].topk(2).indices[1].item()
    assert math.isclose(out.logprobs[1].chosen.logprob,
                        torch.log_softmax(logits[1], -1)[out.token_ids[1]].item(), abs_tol=1e-4)
    tokens = sample([req(top_k=3) for _ in range(DRAWS)], SMALL_LOGITS.expand(DRAWS, -1).clone(), device=cuda)
    assert set(tokens.token_ids) == {0, 1, 2}


def test_unseeded_draw_keys_are_distinct_and_follow_the_stream():
    """The GPU kernel's per-row Philox keys: the same stream and draw numbers give the same keys,
    consecutive steps never reuse one, and every key fits a non-negative int64."""
    from pagoda_engine.worker.sampling import row_seeds

    first, second = row_seeds(7, 0, 512), row_seeds(7, 512, 512)
    assert np.array_equal(first, row_seeds(7, 0, 512))
    keys = np.concatenate([first, second])
    assert len(np.unique(keys)) == 1024 and (keys >= 0).all()
    assert not np.array_equal(row_seeds(8, 0, 512), first)  # another engine seed, another stream

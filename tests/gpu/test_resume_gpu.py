"""Continuations on the GPU (`resume_token_ids`, what `pagoda route` sends when a replica fails
mid-stream): a sequence resumed after k of its tokens recomputes their KV in one prefill instead
of k decode steps, with other kernels (FlashInfer prefill, no CUDA graph). Its greedy tokens, and
a seeded sequence's sampled ones, must still be the uninterrupted sequence's."""

from __future__ import annotations

import itertools

import pytest

from gpu_support import greedy_tokens, make_llm, random_prompts, requires_gpu
from pagoda_engine import SamplingParams
from pagoda_engine.api.outputs import RequestOutputKind

pytestmark = [pytest.mark.gpu, requires_gpu]
_ids = itertools.count()


def _resumed(llm, prompt: list[int], resume: list[int], params: SamplingParams) -> list[int]:
    """The tokens after `resume`, generated as a continuation."""
    request_id = f"resume-{next(_ids)}"
    for core_req in llm.processor.add_request(request_id, None, prompt, params,
                                              output_kind=RequestOutputKind.FINAL_ONLY, resume_token_ids=resume):
        llm.core.add_request(core_req)
    return list(llm._run([request_id])[0].outputs[0].token_ids)


# On an H200 (2026-11-28) 7 of 16 resumed bf16 sequences left the uninterrupted one 14-47 tokens
# in: the resumed tokens' KV is recomputed by one prefill, whose kernels round differently from the
# decode steps that wrote it first, and random-weight logits have near-ties. The router's
# continuation is exact on CPU (tests/router/test_migration.py) and near-exact on bf16 GPUs until
# the prefill reproduces the decode's numbers.
@pytest.mark.xfail(strict=True, reason="bf16 prefill of resumed tokens rounds unlike the decode steps that wrote them")
def test_a_resumed_greedy_sequence_goes_on_as_the_uninterrupted_one(gpu_model_dir):
    llm = make_llm(gpu_model_dir)
    prompts = random_prompts(11, [7, 40, 90, 300])
    full = greedy_tokens(llm, prompts, 64)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    diverged = []
    for prompt, out in zip(prompts, full):
        for k in (1, 16, 33, 63):
            got = out[:k] + _resumed(llm, prompt, out[:k], params)
            if got != out:
                first = next(i for i, (a, b) in enumerate(zip(got, out)) if a != b)
                diverged.append((len(prompt), k, first))
    assert not diverged, f"(prompt length, resumed after, first differing position): {diverged}"


def test_a_resumed_seeded_sequence_draws_what_the_uninterrupted_one_drew(gpu_model_dir):
    llm = make_llm(gpu_model_dir)
    prompt = random_prompts(12, [50])[0]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=48, ignore_eos=True)
    full = list(llm.generate([prompt], params)[0].outputs[0].token_ids)
    for k in (1, 20, 47):
        assert full[:k] + _resumed(llm, prompt, full[:k], params) == full, k

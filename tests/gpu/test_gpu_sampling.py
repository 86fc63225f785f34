"""Sampling on the GPU (the Gumbel-max kernel for plain temperature rows, FlashInfer for top-k,
top-p and min-p) draws from the same distributions as the torch sampler, keeps the filters, and
gives a seeded row the same token wherever it sits and whatever shares its batch."""

from __future__ import annotations

import pytest
import torch

from gpu_support import requires_gpu
from pagoda_engine.core.request import Request
from pagoda_engine.core.sampling_batch import sampling_batch
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.worker.sampling import CudaSampler, make_sampler

pytestmark = [pytest.mark.gpu, requires_gpu]

CUDA = torch.device("cuda")
VOCAB = 64
ROWS = 40_000  # enough draws that two samplers' histograms differ by < 0.02 in total variation


def requests(n: int, **params) -> list[Request]:
    return [Request(request_id=str(i), prompt_token_ids=[1, 2], sampling_params=SamplingParams(**params))
            for i in range(n)]


def draw(sampler, logits_row: torch.Tensor, n: int = ROWS, **params) -> torch.Tensor:
    reqs = requests(n, **params)
    batch = sampling_batch(reqs, logits_row.shape[-1], logits_row.device)
    return torch.tensor(sampler.sample(logits_row.expand(n, logits_row.shape[-1]).contiguous(), batch).token_ids)


def empirical(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


@pytest.fixture(scope="module")
def logits():
    gen = torch.Generator(device=CUDA).manual_seed(0)
    return torch.randn(VOCAB, generator=gen, device=CUDA) * 2


def test_cuda_gets_the_flashinfer_sampler():
    assert isinstance(make_sampler(0, CUDA), CudaSampler)
    assert not isinstance(make_sampler(0, torch.device("cpu")), CudaSampler)


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.0, top_k=5),
                                    dict(temperature=1.0, top_p=0.6), dict(temperature=1.3, min_p=0.1),
                                    dict(temperature=0.9, top_k=10, top_p=0.8)],
                         ids=["temperature", "top_k", "top_p", "min_p", "top_k_top_p"])
def test_flashinfer_draws_follow_the_torch_sampler_distribution(logits, params):
    fi = draw(CudaSampler(1), logits, **params).cpu()
    ref = draw(make_sampler(1, torch.device("cpu")), logits.cpu(), **params)
    allowed = set(ref.tolist())
    # Filtered-out tokens never appear (the torch sampler's support, up to a rare boundary token).
    outside = sum(1 for t in fi.tolist() if t not in allowed)
    assert outside <= ROWS * 0.002, outside
    total_variation = 0.5 * (empirical(fi) - empirical(ref)).abs().sum().item()
    assert total_variation < 0.05, total_variation


def test_bf16_logits_are_sampled_without_a_float_copy_and_follow_the_distribution(logits):
    bf16 = logits.bfloat16()
    fi = draw(CudaSampler(2), bf16, temperature=0.8).cpu()
    ref = torch.softmax(bf16.float().cpu() / 0.8, dim=-1)
    total_variation = 0.5 * (empirical(fi) - ref).abs().sum().item()
    assert total_variation < 0.03, total_variation


def test_gumbel_kernel_across_vocabulary_chunks():
    """A Llama-3 vocabulary spans 16 chunks: the winner may sit in any of them, masked tokens never
    win, and a dominant token always does."""
    from pagoda_engine.worker.gumbel import gumbel_max_sample

    vocab, rows = 128_256, 4_000
    logits = torch.full((rows, vocab), float("-inf"), device=CUDA, dtype=torch.bfloat16)
    live = torch.tensor([5, 8191, 8192, 70_000, vocab - 1], device=CUDA)
    logits[:, live] = 0.0  # five equally likely tokens, across chunk edges
    seeds = torch.arange(rows, device=CUDA, dtype=torch.int64) * 7919 + 1
    tokens = gumbel_max_sample(logits, seeds)
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts.sum().item() == rows and counts[live].sum().item() == rows
    assert (counts[live].float() / rows - 0.2).abs().max().item() < 0.04, counts[live].tolist()
    logits[:, vocab - 1] = 30.0
    assert (gumbel_max_sample(logits, seeds) == vocab - 1).all()
    # Temperature divides the logits: a small one makes the draw greedy (each row's best token
    # leads by at least 1, 100 after the division: beyond any Gumbel noise of 32-bit uniforms).
    logits = torch.randn(rows, vocab, device=CUDA)
    logits[torch.arange(rows, device=CUDA), logits.argmax(dim=-1)] += 1.0
    cold = gumbel_max_sample(logits, seeds, torch.full((rows,), 0.01, device=CUDA))
    assert torch.equal(cold, logits.argmax(dim=-1))


def test_seeded_plain_row_keeps_its_token_whatever_shares_the_batch(logits):
    sampler = CudaSampler(0)
    seeded = Request(request_id="s", prompt_token_ids=[1], sampling_params=SamplingParams(temperature=0.9, seed=7))
    neighbours = [[], requests(5, temperature=1.0), requests(5, temperature=0.0), requests(5, top_k=3),
                  requests(3, top_p=0.5, seed=11) + requests(2, temperature=0.0)]
    exact = logits.bfloat16().float()  # the same values in float32 and bf16
    tokens = []
    for others in neighbours:
        reqs = others[:2] + [seeded] + others[2:]
        at = reqs.index(seeded)
        batch = sampling_batch(reqs, VOCAB, CUDA)
        for dtype in (torch.float32, torch.bfloat16):
            tokens.append(sampler.sample(exact.to(dtype).expand(len(reqs), VOCAB).contiguous(), batch).token_ids[at])
    assert len(set(tokens)) == 1, tokens


def test_seeded_rows_do_not_depend_on_their_position(logits):
    sampler = CudaSampler(0)
    seeded = Request(request_id="s", prompt_token_ids=[1], sampling_params=SamplingParams(temperature=1.0, seed=42))
    others = requests(7, temperature=1.0)
    tokens = []
    for position in (0, 3, 7):
        reqs = others[:position] + [seeded] + others[position:]
        batch = sampling_batch(reqs, VOCAB, CUDA)
        tokens.append(sampler.sample(logits.expand(len(reqs), VOCAB).contiguous(), batch).token_ids[position])
    assert len(set(tokens)) == 1

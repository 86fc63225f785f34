"""FlashInfer sampling on the GPU draws from the same distributions as the torch sampler, keeps
top-k/top-p/min-p filters, and leaves seeded rows to the position-independent torch path."""

from __future__ import annotations

import pytest
import torch

from gpu_support import requires_gpu
from pagoda_engine.request import Request, SamplingParams
from pagoda_engine.sampling import FlashInferSampler, SamplingBatch, make_sampler

pytestmark = [pytest.mark.gpu, requires_gpu]

CUDA = torch.device("cuda")
VOCAB = 64
ROWS = 40_000  # enough draws that two samplers' histograms differ by < 0.02 in total variation


def requests(n: int, **params) -> list[Request]:
    return [Request(request_id=str(i), prompt_token_ids=[1, 2], sampling_params=SamplingParams(**params))
            for i in range(n)]


def draw(sampler, logits_row: torch.Tensor, n: int = ROWS, **params) -> torch.Tensor:
    reqs = requests(n, **params)
    batch = SamplingBatch.from_requests(reqs, VOCAB, logits_row.device)
    return torch.tensor(sampler.sample(logits_row.expand(n, VOCAB).contiguous(), batch).token_ids)


def empirical(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).float() / len(tokens)


@pytest.fixture(scope="module")
def logits():
    gen = torch.Generator(device=CUDA).manual_seed(0)
    return torch.randn(VOCAB, generator=gen, device=CUDA) * 2


def test_cuda_gets_the_flashinfer_sampler():
    assert isinstance(make_sampler(0, CUDA), FlashInferSampler)
    assert not isinstance(make_sampler(0, torch.device("cpu")), FlashInferSampler)


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.0, top_k=5),
                                    dict(temperature=1.0, top_p=0.6), dict(temperature=1.3, min_p=0.1),
                                    dict(temperature=0.9, top_k=10, top_p=0.8)],
                         ids=["temperature", "top_k", "top_p", "min_p", "top_k_top_p"])
def test_flashinfer_draws_follow_the_torch_sampler_distribution(logits, params):
    fi = draw(FlashInferSampler(1), logits, **params).cpu()
    ref = draw(make_sampler(1, torch.device("cpu")), logits.cpu(), **params)
    allowed = set(ref.tolist())
    # Filtered-out tokens never appear (the torch sampler's support, up to a rare boundary token).
    outside = sum(1 for t in fi.tolist() if t not in allowed)
    assert outside <= ROWS * 0.002, outside
    total_variation = 0.5 * (empirical(fi) - empirical(ref)).abs().sum().item()
    assert total_variation < 0.05, total_variation


def test_seeded_rows_do_not_depend_on_their_position(logits):
    sampler = FlashInferSampler(0)
    seeded = Request(request_id="s", prompt_token_ids=[1], sampling_params=SamplingParams(temperature=1.0, seed=42))
    others = requests(7, temperature=1.0)
    tokens = []
    for position in (0, 3, 7):
        reqs = others[:position] + [seeded] + others[position:]
        batch = SamplingBatch.from_requests(reqs, VOCAB, CUDA)
        tokens.append(sampler.sample(logits.expand(len(reqs), VOCAB).contiguous(), batch).token_ids[position])
    assert len(set(tokens)) == 1

"""Disaggregated prefill/decode on the GPU: a producer and a consumer engine core on one device
(bf16, FlashInfer, async scheduling, CUDA graphs), pages moved by the real endpoint and each
connector: the gloo pair (device -> host -> host -> device) and, where its wheel is installed,
NIXL (a READ of the producer's registered device memory). Pulled pages are bit-identical to the producer's, and the
consumer's greedy tokens equal an aggregated core's, with and without a prefix it holds itself."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from gpu_support import random_prompts, requires_gpu
from pagoda_engine.config import EngineConfig
from pagoda_engine.core.engine_core import EngineCore
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, requires_gpu]


NIXL_INSTALLED = any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu13"))


@pytest.fixture(scope="module", params=[
    "PagodaTorchConnector",
    pytest.param("NixlConnector", marks=pytest.mark.skipif(not NIXL_INSTALLED, reason="the nixl wheel is not installed")),
])
def cores(request, gpu_model_dir):
    def core(role: str | None) -> EngineCore:
        transfer = {"kv_role": role, "kv_port": 0, "kv_connector": request.param}
        extra = {"kv_transfer_config": json.dumps(transfer)} if role else {}
        return EngineCore(EngineConfig.from_kwargs(model=str(gpu_model_dir), dtype="bfloat16", num_kv_pages=512,
                                                   max_num_seqs=32, seed=0, **extra))

    made = [core("kv_producer"), core("kv_consumer"), core(None)]
    yield made
    for c in made:
        c.close()


def _run(core: EngineCore, rid: str, prompt: list[int], max_tokens: int, params: dict | None = None):
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, kv_transfer_params=params)))
    tokens, answer = [], None
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens += list(out.new_token_ids)
            answer = out.kv_transfer_params or answer
    return tokens, answer


def _pages(core: EngineCore, hashes: list[str]) -> list[torch.Tensor]:
    caches = core.executor.worker.attn.kv_caches
    return [torch.stack([c[core.kv.pool.cached[bytes.fromhex(h)].page_id] for c in caches]) for h in hashes]


def test_pulled_pages_are_bit_identical_and_greedy_tokens_equal_an_aggregated_core(cores):
    producer, consumer, aggregated = cores
    prompts = random_prompts(0, [700, 1031, 64, 5])
    prompts.append(prompts[1][:512] + prompts[0][:300])  # the consumer holds 512 tokens of it itself
    for i, prompt in enumerate(prompts):
        expected, _ = _run(aggregated, f"a{i}", prompt, 24)
        _, params = _run(producer, f"p{i}", prompt, 1, {"do_remote_decode": True})
        received = consumer.kv_transfer.counters.external_hits
        got, _ = _run(consumer, f"c{i}", prompt, 24, params)
        assert got == expected, i
        pulled = consumer.kv_transfer.counters.external_hits - received
        usable = (len(prompt) - 1) // consumer.kv.page_size * consumer.kv.page_size
        assert pulled == (usable - 512 if i == 4 else usable), i
        hashes = params["remote_block_hashes"]
        for mine, theirs in zip(_pages(consumer, hashes), _pages(producer, hashes)):
            assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))
    assert consumer.kv_transfer.counters.failures == 0
    deadline = time.monotonic() + 10
    while producer.kv_transfer.pages_held:  # every hold was pulled: released once the endpoint says so
        assert time.monotonic() < deadline, producer.kv_transfer.pages_held
        producer.release_expired()
        time.sleep(0.05)

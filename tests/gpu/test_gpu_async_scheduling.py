"""Async scheduling on the GPU (FlashInfer, decode CUDA graphs, FlashInfer sampling): the same
greedy and seeded tokens as the synchronous engine, with chunked prefill and preemption (a greedy
token may differ only at a tie within bf16 rounding: see the test)."""

from __future__ import annotations

import pytest

from gpu_support import requires_gpu
from pagoda_engine import SamplingParams
from test_gpu_engine import make_llm, random_prompts

pytestmark = [pytest.mark.gpu, requires_gpu]

# A tie within bf16 rounding: the model's logits are bf16, whose rounding step for magnitudes 4 to
# 8 is 2^-5, so two best tokens a step apart are 2^-5 apart in logprob too. Which one a run picks
# depends on the order of float32 sums, which differs between batch sizes (one-row matrix-vector
# kernels, the short-context decode attention of one or two requests, cuBLAS tiles).
BF16_TIE = 2 ** -5
# A served core's requests arrive among others' decodes, so a request's steps run in other batch
# sizes than offline, each size with its own kernels (equally accurate: the short-context decode
# attention's error against float32 attention is FlashInfer's, `test_decode_triton_gpu.py`). Their
# rounding differences accumulate in the K/V of every earlier token, so where the two runs first
# part, the served one takes the offline run's runner-up, at most this far behind (measured: 2^-3
# on an 8-layer random model at token 46).
ACCUMULATED_TIE = 2 ** -2


@pytest.mark.parametrize("engine_kwargs", [
    dict(max_num_batched_tokens=64),  # chunked prefill beside graph-replayed decodes
    # preemption (9 pages, 144 tokens; admitted without the growth reservation)
    dict(num_kv_pages=10, block_size=16, max_model_len=256, kv_growth_reservation=False),
])
def test_async_scheduling_gives_the_synchronous_tokens(gpu_model_dir, engine_kwargs):
    prompts = random_prompts(5, [3, 70, 17, 130, 1, 45, 33, 90])
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=2, top_k=20, top_p=0.9, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=3)] * 2
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(gpu_model_dir, async_scheduling=async_scheduling, **engine_kwargs)
        assert llm.core.executor.graphs is not None
        outs = llm.generate(prompts, params)
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs])
        kv = llm.core.kv
        assert kv.num_free_pages == kv.pool.num_pages - 1, "pages leaked"
        if "num_kv_pages" in engine_kwargs:
            assert llm.core.scheduler.num_preemptions > 0
    for (sync_ids, sync_reason, sync_lps), (async_ids, async_reason, _), p in zip(*results, params):
        assert async_reason == sync_reason
        if async_ids != sync_ids:
            # A request that decodes alone (or with one other) for a step in one run and beside
            # more in the other gets that step from other kernels, its sums in another order: a
            # greedy token may differ there, and only where the best two were within bf16 rounding.
            assert p.temperature == 0 and p.logprobs, (sync_ids, async_ids)
            at = next(i for i, (a, b) in enumerate(zip(sync_ids, async_ids)) if a != b)
            best, second = sorted((lp.logprob for lp in sync_lps[at].values()), reverse=True)[:2]
            assert best - second <= BF16_TIE, (at, best, second)


def test_a_served_core_paces_and_publishes_early_with_the_offline_tokens(tmp_path):
    """A server's engine core on CUDA with the command line's defaults (async scheduling, step launch
    pacing) behind the real core loop, requests arriving while others decode: each gets the greedy
    tokens the offline LLM gives it (up to ties within accumulated bf16 rounding: ACCUMULATED_TIE),
    and steps' outputs left between two layers of the next step's launch."""
    import time

    import transformers
    from core_loop_sockets import core_loop_sockets
    from gpu_support import MODEL_CONFIG, save_random_model
    from pagoda_engine import LLM
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core.engine_core import EngineCore
    from pagoda_engine.messages import ShutdownRequest
    from pagoda_engine.tiny import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny")
    model = tmp_path / "llama8"  # 8 layers: the publish may happen before the last two
    model.mkdir()
    save_random_model(model, tiny, transformers.LlamaForCausalLM, transformers.LlamaConfig,
                      **{**MODEL_CONFIG, "num_hidden_layers": 8})
    prompts = random_prompts(7, [40, 3, 150, 17, 90, 1])
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    llm = LLM(str(model), dtype="bfloat16", num_kv_pages=256)
    try:
        want = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, [params] * len(prompts))]
    finally:
        llm.close()

    core = EngineCore(EngineConfig.from_kwargs(model=str(model), dtype="bfloat16", num_kv_pages=256,
                                               async_scheduling=None, step_launch_pacing=None))
    got: dict[str, list[int]] = {}
    try:
        assert core.config.scheduler.async_scheduling and core.in_flight.pacer is not None
        with core_loop_sockets(core, "gpu-early") as sockets:
            sockets.send_request("r0", prompts[0], params)
            sockets.thread.start()
            sent, finished = 1, 0
            while finished < len(prompts):
                for output in getattr(sockets.receive(), "outputs", []):
                    got.setdefault(output.request_id, []).extend(output.new_token_ids)
                    finished += output.finish_reason is not None
                if sent < len(prompts) and len(got.get("r0", [])) >= 6 * sent:  # arrivals among decodes
                    time.sleep(0.002)
                    sockets.send_request(f"r{sent}", prompts[sent], params)
                    sent += 1
            sockets.send(ShutdownRequest())
            sockets.thread.join(10)
        assert core.in_flight.early_publishes > 0  # (the tiny model's decode steps are too short to pace)
    finally:
        core.close()
    for i, (want_ids, want_lps) in enumerate(want):
        ids = got[f"r{i}"]
        assert len(ids) == 48
        if ids != want_ids:
            at = next(k for k, (a, b) in enumerate(zip(want_ids, ids)) if a != b)
            (_, best), (runner_up, second) = sorted(((t, lp.logprob) for t, lp in want_lps[at].items()),
                                                    key=lambda item: -item[1])[:2]
            assert ids[at] == runner_up and best - second <= ACCUMULATED_TIE, (i, at, ids[at], best, second)

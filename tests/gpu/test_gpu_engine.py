"""The GPU engine end to end on a small bf16 Llama: logits against transformers, greedy tokens
against transformers, prefix caching and CUDA graphs (whole-forward and piecewise) changing
nothing, KV sizing by measurement, and no memory growth over 1,000 requests."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from gpu_support import (CUDA, check_bf16_logits_against, check_greedy_tokens_against, check_piecewise_forward,
                         greedy_tokens, make_llm, random_prompts, requires_gpu, triton_compiles_after_start_up)
from pagoda_engine import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, requires_gpu]


@pytest.fixture(scope="module")
def hf_reference(gpu_model_dir):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32).to(CUDA).eval()


def test_flashinfer_is_the_automatic_choice(gpu_model_dir):
    llm = make_llm(gpu_model_dir)
    assert llm.core.executor.attn.name == "flashinfer"
    assert llm.core.executor.graphs is not None


def test_bf16_logits_match_transformers(gpu_model_dir, hf_reference):
    """A prefill step of three prompts, then steps that mix decodes with a chunked prefill: each
    step's last-token logits stay within bf16 rounding of transformers' (float32) logits."""
    check_bf16_logits_against(gpu_model_dir, hf_reference)


def test_greedy_tokens_match_transformers(gpu_model_dir, hf_reference):
    check_greedy_tokens_against(make_llm(gpu_model_dir), hf_reference, random_prompts(2, [5, 33, 64, 100]))


def test_prefix_caching_on_and_off_give_identical_greedy_tokens(gpu_model_dir):
    shared = random_prompts(3, [70])[0]
    prompts = [shared + tail for tail in random_prompts(4, [3, 20, 41])]
    off = greedy_tokens(make_llm(gpu_model_dir, enable_prefix_caching=False), prompts, 16)
    llm = make_llm(gpu_model_dir, enable_prefix_caching=True)
    first = greedy_tokens(llm, prompts, 16)
    again = greedy_tokens(llm, prompts, 16)  # every full page of every prompt is now a cache hit
    assert llm.core.kv.prefix_hits > 0
    assert first == off
    assert again == off


def test_no_triton_kernel_is_compiled_after_start_up(gpu_model_dir):
    assert triton_compiles_after_start_up(gpu_model_dir) == []


def test_dummy_batches_between_requests_change_nothing(gpu_model_dir):
    """An engine core whose experts span other cores runs dummy batches while it has no work
    (one token through FlashInfer, KV into the null page): cached prefixes and greedy tokens of the
    requests after them are unchanged."""
    prompts = random_prompts(5, [40, 70])
    llm = make_llm(gpu_model_dir)
    first = greedy_tokens(llm, prompts, 16)
    with torch.inference_mode():
        for _ in range(3):
            llm.core.execute_dummy_batch()
    torch.cuda.synchronize()
    assert greedy_tokens(llm, prompts, 16) == first  # the second run reads the first run's cached pages
    assert llm.core.kv.prefix_hits > 0


def test_cuda_graphs_on_and_off_give_identical_greedy_tokens(gpu_model_dir):
    prompts = random_prompts(5, [4, 17, 30, 31, 64])  # 5 decodes pad to the graph of 8
    eager = make_llm(gpu_model_dir, enforce_eager=True)
    assert eager.core.executor.graphs is None
    want = greedy_tokens(eager, prompts, 32)
    # Alone, a request decodes through the one-row matrix-vector kernels: sums in another order
    # than a batch's GEMMs, so its own eager tokens are the reference.
    want_alone = greedy_tokens(eager, prompts[:1], 32)
    del eager
    graphs = make_llm(gpu_model_dir)
    assert graphs.core.executor.graphs is not None and 8 in graphs.core.executor.graphs.batch_sizes
    assert greedy_tokens(graphs, prompts, 32) == want
    assert greedy_tokens(graphs, prompts[:1], 32) == want_alone  # batch of one: the graph of 1
    del graphs
    # Decode batches above --max-cudagraph-capture-size run eagerly (5 > 4), smaller ones replay.
    capped = make_llm(gpu_model_dir, max_cudagraph_capture_size=4)
    assert capped.core.executor.graphs.batch_sizes == [1, 2, 4]
    assert greedy_tokens(capped, prompts, 32) == want


def test_piecewise_graphs_give_the_eager_greedy_tokens(gpu_model_dir):
    """A 48-token budget chunks the longer prompts, so prefill chunks run alone and mixed with
    decodes; those steps replay piecewise graphs (at padded token counts) and change nothing."""
    prompts = random_prompts(8, [5, 40, 90, 130, 200])
    eager = make_llm(gpu_model_dir, enforce_eager=True, max_num_batched_tokens=48)
    want = greedy_tokens(eager, prompts, 24)
    del eager
    decode_only = make_llm(gpu_model_dir, cudagraph_mode="FULL_DECODE_ONLY", max_num_batched_tokens=48)
    assert decode_only.core.executor.piecewise is None
    assert greedy_tokens(decode_only, prompts, 24) == want
    del decode_only
    llm = make_llm(gpu_model_dir, max_num_batched_tokens=48)
    piecewise = llm.core.executor.piecewise
    assert piecewise.token_sizes == [8, 16, 32, 48]
    steps = _record_steps(piecewise)
    assert greedy_tokens(llm, prompts, 24) == want
    assert any(0 < decodes and tokens > decodes for tokens, decodes in steps), steps  # mixed steps
    assert any(tokens not in piecewise.token_sizes for tokens, _ in steps), steps  # padded ones


def test_piecewise_graphs_above_256_tokens_are_measured_and_give_the_eager_greedy_tokens(gpu_model_dir):
    """With a 512-token budget the steps of 257-512 tokens replay piecewise graphs too, at the
    sizes the start-up's GEMM timing kept (`drop_slow_sizes`; 512, the largest, always), and
    change nothing."""
    from pagoda_engine.worker.cuda_graphs import piecewise_token_sizes

    prompts = random_prompts(9, [270, 300, 420, 500])
    eager = make_llm(gpu_model_dir, enforce_eager=True, max_num_batched_tokens=512)
    want = greedy_tokens(eager, prompts, 16)
    del eager
    llm = make_llm(gpu_model_dir, max_num_batched_tokens=512)
    piecewise = llm.core.executor.piecewise
    sizes = piecewise.token_sizes
    assert sizes[-1] == 512 and set(sizes) <= set(piecewise_token_sizes(512)) and 256 in sizes
    steps = _record_steps(piecewise)
    assert greedy_tokens(llm, prompts, 16) == want
    assert any(tokens > 256 for tokens, _ in steps), steps


def _record_steps(piecewise) -> list[tuple[int, int]]:
    """(tokens, decodes) of every step `piecewise` replays from now on, in a list filled as they run."""
    steps = []
    replay = piecewise.run

    def recording_run(input_ids, positions, batch):
        steps.append((batch.num_tokens, batch.num_decodes))
        return replay(input_ids, positions, batch)

    piecewise.run = recording_run
    return steps


def test_piecewise_forward_matches_the_eager_forward(gpu_model_dir):
    """One mixed step (a decode over 100 cached tokens and a fresh 37-token prompt, padded to 48)
    through the piecewise graphs and through the eager forward: the same hidden states."""
    check_piecewise_forward(gpu_model_dir)


def test_kv_pool_is_sized_by_measurement(gpu_model_dir):
    """With a budget of about 1 GiB above what is in use now, the pool takes what the profile step
    leaves of it (fewer pages than the sequences could use) and the GPU ends within the budget."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = (total - free + (1 << 30)) / total
    # 1,024 sequences of 2,048 tokens would need 2 GiB of this model's pages: more than the budget.
    llm = LLM(str(gpu_model_dir), dtype="bfloat16", gpu_memory_utilization=utilization, max_num_seqs=1024)
    core = llm.core
    page_bytes = core.executor.model.kv_cache_spec(16, torch.bfloat16).bytes_per_page()
    assert 0 < core.kv_capacity_tokens < 1024 * core.max_model_len, core.kv_capacity_tokens
    assert core.num_kv_pages * page_bytes > (256 << 20), core.num_kv_pages  # most of the spare GiB went to pages
    free_after, _ = torch.cuda.mem_get_info()
    used = total - free_after
    # CUDA graphs are captured after the pool is sized and come on top; the core measures them.
    print(f"graphs took {core.executor.cuda_graph_bytes >> 20} MiB; used {used >> 20} MiB of a {int(utilization * total) >> 20} MiB budget")
    assert 0 < core.executor.cuda_graph_bytes <= (256 << 20), core.executor.cuda_graph_bytes
    assert used <= utilization * total + core.executor.cuda_graph_bytes + (64 << 20), (used, utilization * total)
    assert greedy_tokens(llm, random_prompts(6, [10]), 4)[0]


def test_no_memory_growth_over_1000_requests(gpu_model_dir):
    """After warm-up, the allocated bytes stay put while 1,000 requests of mixed lengths and
    sampling settings (greedy, seeded, unseeded, top-k/top-p) come and go."""
    llm = make_llm(gpu_model_dir)
    rng = random.Random(7)

    def batch(n):
        prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(1, 120))] for _ in range(n)]
        params = [SamplingParams(temperature=rng.choice([0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                 top_k=rng.choice([0, 20]), seed=rng.choice([None, rng.randrange(1000)]),
                                 max_tokens=rng.randrange(1, 12), ignore_eos=True) for _ in range(n)]
        outs = llm.generate(prompts, params)
        assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, params))

    batch(100)  # warm-up: every graph size and code path once
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    readings = []
    for _ in range(10):
        batch(100)
        torch.cuda.synchronize()
        readings.append(torch.cuda.memory_allocated())
    assert not llm.core.scheduler.requests
    assert max(readings) - baseline <= 1 << 20, [r - baseline for r in readings]

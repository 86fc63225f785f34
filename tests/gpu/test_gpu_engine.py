"""The GPU engine end to end on a small bf16 Llama: logits against transformers, greedy tokens
against transformers, prefix caching and CUDA graphs (whole-forward and piecewise) changing
nothing, KV sizing by measurement, and no memory growth over 1,000 requests."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from gpu_support import make_llm, requires_gpu
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.attention import AttentionBatch, get_attention_backend

pytestmark = [pytest.mark.gpu, requires_gpu]

CUDA = torch.device("cuda")


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def random_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_reference(gpu_model_dir):
    import transformers

    return transformers.LlamaForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32).to(CUDA).eval()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens], device=CUDA)).logits[0].float()


def test_flashinfer_is_the_automatic_choice(gpu_model_dir):
    llm = make_llm(gpu_model_dir)
    assert llm.core.attn.name == "flashinfer"
    assert llm.core.runner.graphs is not None


@pytest.fixture(params=["small", "llama-sized"])
def model_and_reference(request):
    """(model directory, transformers float32 reference): the small model, and Llama-3.1-8B's shapes."""
    if request.param == "small":
        return request.getfixturevalue("gpu_model_dir"), request.getfixturevalue("hf_reference")
    return request.getfixturevalue("llama_sized")


def test_bf16_logits_match_transformers(model_and_reference):
    """A prefill step of three prompts, then steps that mix decodes with a chunked prefill: each
    step's last-token logits stay within bf16 rounding of transformers' (float32) logits."""
    from pagoda_engine.model.loader import load_hf_config, load_model

    model_dir, hf_reference = model_and_reference
    model = load_model(str(model_dir), load_hf_config(str(model_dir)), torch.bfloat16, CUDA)
    attn = get_attention_backend("auto", model.kv_cache_spec(16, torch.bfloat16), 64, CUDA)
    assert attn.name == "flashinfer"
    free = list(range(1, 64))
    random.Random(0).shuffle(free)
    seqs = dict(zip("abc", random_prompts(1, [3, 40, 90])))
    tables: dict[str, list[int]] = {}
    done: dict[str, int] = {}
    checked = 0

    def step(chunks):  # (request, number of new tokens); decodes first
        nonlocal checked
        ids, pos, slots, qlens, slens, tabs = [], [], [], [], [], []
        for rid, n in chunks:
            start = done.get(rid, 0)
            table = tables.setdefault(rid, [])
            while len(table) * 16 < start + n:
                table.append(free.pop())
            ids += seqs[rid][start:start + n]
            pos += range(start, start + n)
            slots += [table[p // 16] * 16 + p % 16 for p in range(start, start + n)]
            qlens.append(n)
            slens.append(start + n)
            tabs.append(list(table))
            done[rid] = start + n
        nd = sum(1 for (rid, n), s in zip(chunks, slens) if n == 1 and s > 1)
        attn.plan(AttentionBatch(qlens, slens, tabs, torch.tensor(slots, device=CUDA), nd))
        with torch.no_grad():
            hidden = model(torch.tensor(ids, device=CUDA), torch.tensor(pos, device=CUDA), attn)
            last = torch.tensor(qlens, device=CUDA).cumsum(0) - 1
            logits = model.compute_logits(hidden[last])
        for (rid, _), got in zip(chunks, logits):
            ref = hf_logits(hf_reference, seqs[rid][:done[rid]])[-1]
            scale = ref.abs().max().item()
            assert (got - ref).abs().max().item() <= 0.05 * scale, rid
            assert torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.995, rid
            checked += 1
            if done[rid] == len(seqs[rid]):
                seqs[rid].append(int(got.argmax()))

    step([("a", 3), ("b", 40), ("c", 50)])
    step([("a", 1), ("b", 1), ("c", 40)])
    for _ in range(3):
        step([("a", 1), ("b", 1), ("c", 1)])
    assert checked == 15


def test_greedy_tokens_match_transformers(gpu_model_dir, hf_reference):
    """Our greedy tokens are transformers' greedy tokens: at every generated position, transformers
    (float32, fed the same sequence) ranks our token first."""
    prompts = random_prompts(2, [5, 33, 64, 100])
    outputs = greedy_tokens(make_llm(gpu_model_dir), prompts, 24)
    for prompt, out in zip(prompts, outputs):
        assert len(out) == 24
        ref = hf_logits(hf_reference, prompt + out)[len(prompt) - 1:-1]
        top2 = ref.topk(2, dim=-1).values
        scale = ref.abs().max().item()
        report = [(i, tok, int(ref[i].argmax()), round((top2[i, 0] - ref[i, tok]).item() / scale, 4),
                   round((top2[i, 0] - top2[i, 1]).item() / scale, 4)) for i, tok in enumerate(out)]
        # (position, ours, transformers', our token's gap to the best, best-to-second gap), gaps / max |logit|
        # A token within bf16 rounding of a tie may legitimately differ; none may lose clearly.
        assert all(gap < 0.01 for *_, gap, _ in report), report
        assert sum(ours == theirs for _, ours, theirs, *_ in report) >= len(out) - 1, report


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


def test_cuda_graphs_on_and_off_give_identical_greedy_tokens(gpu_model_dir):
    prompts = random_prompts(5, [4, 17, 30, 31, 64])  # 5 decodes pad to the graph of 8
    eager = make_llm(gpu_model_dir, enforce_eager=True)
    assert eager.core.runner.graphs is None
    want = greedy_tokens(eager, prompts, 32)
    del eager
    graphs = make_llm(gpu_model_dir)
    assert graphs.core.runner.graphs is not None and 8 in graphs.core.runner.graphs.batch_sizes
    assert greedy_tokens(graphs, prompts, 32) == want
    assert greedy_tokens(graphs, prompts[:1], 32) == want[:1]  # batch of one: the graph of 1
    del graphs
    # Decode batches above --max-cudagraph-capture-size run eagerly (5 > 4), smaller ones replay.
    capped = make_llm(gpu_model_dir, max_cudagraph_capture_size=4)
    assert capped.core.runner.graphs.batch_sizes == [1, 2, 4]
    assert greedy_tokens(capped, prompts, 32) == want


def test_piecewise_graphs_give_the_eager_greedy_tokens(gpu_model_dir):
    """A 48-token budget chunks the longer prompts, so prefill chunks run alone and mixed with
    decodes; those steps replay piecewise graphs (at padded token counts) and change nothing."""
    prompts = random_prompts(8, [5, 40, 90, 130, 200])
    eager = make_llm(gpu_model_dir, enforce_eager=True, max_num_batched_tokens=48)
    want = greedy_tokens(eager, prompts, 24)
    del eager
    decode_only = make_llm(gpu_model_dir, cudagraph_mode="FULL_DECODE_ONLY", max_num_batched_tokens=48)
    assert decode_only.core.runner.piecewise_graphs is None
    assert greedy_tokens(decode_only, prompts, 24) == want
    del decode_only
    llm = make_llm(gpu_model_dir, max_num_batched_tokens=48)
    piecewise = llm.core.runner.piecewise_graphs
    assert piecewise.token_sizes == [8, 16, 32, 48]
    steps = []
    replay = piecewise.run

    def recording_run(input_ids, positions, batch):
        steps.append((batch.num_tokens, batch.num_decodes))
        return replay(input_ids, positions, batch)

    piecewise.run = recording_run
    assert greedy_tokens(llm, prompts, 24) == want
    assert any(0 < decodes and tokens > decodes for tokens, decodes in steps), steps  # mixed steps
    assert any(tokens not in piecewise.token_sizes for tokens, _ in steps), steps  # padded ones


def test_piecewise_forward_matches_the_eager_forward(model_and_reference):
    """One mixed step (a decode over 100 cached tokens and a fresh 37-token prompt, padded to 48)
    through the piecewise graphs and through the eager forward: the same hidden states."""
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core import EngineCore

    gc.collect()
    torch.cuda.empty_cache()
    core = EngineCore(EngineConfig.from_kwargs(model=str(model_and_reference[0]), dtype="bfloat16", num_kv_pages=64,
                                               max_num_seqs=8))
    executor, page_size = core.runner.executor, 16
    model, attn = executor.model, executor.attn
    tokens = torch.tensor(random_prompts(9, [138])[0], device=CUDA)
    first_pages, second_pages = list(range(1, 8)), list(range(8, 11))
    with torch.inference_mode():
        fill = AttentionBatch(query_lens=[100], seq_lens=[100], page_tables=[first_pages],
                              slot_mapping=torch.arange(16, 116, device=CUDA))
        attn.plan(fill)
        model(tokens[:100], torch.arange(100, device=CUDA), attn)
        slots = [first_pages[100 // page_size] * page_size + 100 % page_size] + [8 * page_size + i for i in range(37)]
        mixed = AttentionBatch(query_lens=[1, 37], seq_lens=[101, 37], page_tables=[first_pages, second_pages],
                               slot_mapping=torch.tensor(slots, device=CUDA), num_decodes=1)
        ids = tokens[100:]
        positions = torch.tensor([100] + list(range(37)), device=CUDA)
        attn.plan(mixed)
        eager = model(ids, positions, attn).float()
        assert executor.piecewise.fits(mixed) and executor.piecewise.padded_size(38) == 48
        graphed = executor.execute_model(ids, positions, mixed).float()
    assert graphed.shape == eager.shape == (38, model.config.hidden_size)
    torch.testing.assert_close(graphed, eager, atol=3e-2, rtol=3e-2)


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
    page_bytes = core.model.kv_cache_spec(16, torch.bfloat16).bytes_per_page()
    assert 0 < core.kv_capacity_tokens < 1024 * core.max_model_len, core.kv_capacity_tokens
    assert core.num_kv_pages * page_bytes > (256 << 20), core.num_kv_pages  # most of the spare GiB went to pages
    free_after, _ = torch.cuda.mem_get_info()
    used = total - free_after
    # CUDA graphs are captured after the pool is sized and come on top; the core measures them.
    print(f"graphs took {core.cuda_graph_bytes >> 20} MiB; used {used >> 20} MiB of a {int(utilization * total) >> 20} MiB budget")
    assert 0 < core.cuda_graph_bytes <= (256 << 20), core.cuda_graph_bytes
    assert used <= utilization * total + core.cuda_graph_bytes + (64 << 20), (used, utilization * total)
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

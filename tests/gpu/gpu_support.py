"""What every GPU test module shares: the skip rule (no CUDA or no FlashInfer: skip, as on CPU CI)
and the small model's configuration. A module of its own, not conftest.py, so test modules can
import it by a name no other test directory uses."""

from __future__ import annotations

import gc
import importlib.util
import random

import pytest
import torch

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.worker.attention import AttentionBatch, get_attention_backend

CUDA = torch.device("cuda")
HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU and flashinfer")

# 8 query heads over 2 KV heads (group 4: the tensor-core decode path), head_dim 64, llama3 rotary.
MODEL_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
                    rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=256))



# Llama-3.1-8B's shapes (32 query heads over 8 KV heads of 128, MLP 14,336, vocabulary 128,256, its
# rotary scaling) with two layers instead of 32: the kernels run at the sizes the benchmarks use.
LLAMA_SIZED_CONFIG = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                          rms_norm_eps=1e-5, rope_theta=500000.0,
                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=8192))

# What most GPU tests run: bf16, a fixed small KV pool, a batch that covers several graph sizes.
LLM_DEFAULTS = dict(dtype="bfloat16", num_kv_pages=512, max_num_seqs=32, seed=0)


def make_llm(model_dir, **overrides) -> LLM:
    """An engine on the GPU with LLM_DEFAULTS (overridable), after freeing what earlier tests left."""
    gc.collect()
    torch.cuda.empty_cache()
    return LLM(str(model_dir), **{**LLM_DEFAULTS, **overrides})


def random_prompts(seed: int, lengths: list[int], vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens], device=CUDA)).logits[0].float()


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def check_greedy_tokens_against(llm: LLM, hf_reference, prompts: list[list[int]], max_tokens: int = 24) -> None:
    """Our greedy tokens are transformers' greedy tokens: at every generated position, transformers
    (float32, fed the same sequence) ranks our token first."""
    outputs = greedy_tokens(llm, prompts, max_tokens)
    for prompt, out in zip(prompts, outputs):
        assert len(out) == max_tokens
        ref = hf_logits(hf_reference, prompt + out)[len(prompt) - 1:-1]
        top2 = ref.topk(2, dim=-1).values
        scale = ref.abs().max().item()
        report = [(i, tok, int(ref[i].argmax()), round((top2[i, 0] - ref[i, tok]).item() / scale, 4),
                   round((top2[i, 0] - top2[i, 1]).item() / scale, 4)) for i, tok in enumerate(out)]
        # (position, ours, transformers', our token's gap to the best, best-to-second gap), gaps / max |logit|
        # A token within bf16 rounding of a tie may legitimately differ; none may lose clearly, and
        # none may differ where transformers' best two are apart.
        assert all(gap < 0.01 for *_, gap, _ in report), report
        assert all(ours == theirs or tie < 0.005 for _, ours, theirs, _, tie in report), report


def check_bf16_logits_against(model_dir, hf_reference) -> None:
    """A prefill step of three prompts, then steps that mix decodes with a chunked prefill, through
    the bf16 model and FlashInfer: each step's last-token logits stay within bf16 rounding of the
    float32 transformers reference's.

    An MoE layer picks experts by rank: where its k-th and (k+1)-th router logits for a token are
    within bf16 rounding of each other, the last bits of its input decide which expert serves it,
    and the float32 reference may pick the other (then the logits differ by that expert's share).
    One checked position of all may differ for that reason, and only where a near tie is seen."""
    from pagoda_engine.worker.model import moe
    from pagoda_engine.worker.model.loader import load_hf_config, load_model

    model = load_model(str(model_dir), load_hf_config(str(model_dir)), torch.bfloat16, CUDA)
    attn = get_attention_backend("auto", model.kv_cache_spec(16, torch.bfloat16), 64, CUDA)
    assert attn.name == "flashinfer"
    free = list(range(1, 64))
    random.Random(0).shuffle(free)
    seqs = dict(zip("abc", random_prompts(1, [3, 40, 90])))
    tables: dict[str, list[int]] = {}
    done: dict[str, int] = {}
    checked = 0
    excused: list[tuple[str, float]] = []
    routed: list[tuple[torch.Tensor, int]] = []  # each MoE layer's router logits in the step, and its k
    select_experts = moe.select_experts

    def recording_select_experts(router_logits, top_k, renormalize):
        routed.append((router_logits.float(), top_k))
        return select_experts(router_logits, top_k, renormalize)

    def tie_gap(row: int) -> float:
        """The smallest gap between a layer's k-th and (k+1)-th router logits for this token, in
        units of bf16 rounding at their size (infinite for a dense model)."""
        gaps = [float("inf")]
        for logits, k in routed:
            top = logits[row].topk(k + 1).values
            gaps.append(((top[k - 1] - top[k]) / (top[k - 1].abs().clamp_min(1e-3) * 2 ** -8)).item())
        return min(gaps)

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
        routed.clear()
        moe.select_experts = recording_select_experts
        try:
            with torch.no_grad():
                hidden = model(torch.tensor(ids, device=CUDA), torch.tensor(pos, device=CUDA), attn)
                last = torch.tensor(qlens, device=CUDA).cumsum(0) - 1
                logits = model.compute_logits(hidden[last])
        finally:
            moe.select_experts = select_experts
        for (rid, _), got, row in zip(chunks, logits, last.tolist()):
            ref = hf_logits(hf_reference, seqs[rid][:done[rid]])[-1]
            scale = ref.abs().max().item()
            close = ((got - ref).abs().max().item() <= 0.05 * scale
                     and torch.nn.functional.cosine_similarity(got, ref, dim=0) > 0.995)
            if not close:
                gap = tie_gap(row)
                assert gap <= 4 and not excused, (rid, done[rid], gap, excused)
                excused.append((rid, gap))
                print(f"{rid} at {done[rid]} tokens: a near tie between experts (gap {gap:.2f} bf16 roundings)")
            checked += 1
            if done[rid] == len(seqs[rid]):
                seqs[rid].append(int(got.argmax()))

    step([("a", 3), ("b", 40), ("c", 50)])
    step([("a", 1), ("b", 1), ("c", 40)])
    for _ in range(3):
        step([("a", 1), ("b", 1), ("c", 1)])
    assert checked == 15


def check_piecewise_forward(model_dir) -> None:
    """One mixed step (a decode over 100 cached tokens and a fresh 37-token prompt, padded to 48)
    through the piecewise CUDA graphs and through the eager forward: the same hidden states."""
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core.engine_core import EngineCore

    gc.collect()
    torch.cuda.empty_cache()
    core = EngineCore(EngineConfig.from_kwargs(model=str(model_dir), dtype="bfloat16", num_kv_pages=64,
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


def save_bf16_with_reference(model_cls, config, std: float, out) -> tuple:
    """A random transformers model at `config` (weights N(0, std), see random_weights), saved in
    bf16 to `out`; returns (out, the same values in float32 as the reference model)."""
    from random_weights import randomise

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config)
    randomise(model, std=std)
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    return out, model.float().eval()


def save_random_model(out, tokenizer_dir, model_cls, config_cls, **config) -> None:
    """A random transformers model (weights N(0, 0.06), see random_weights) saved in bf16 to `out`,
    with the tokenizer files of `tokenizer_dir` and its vocabulary size."""
    import shutil
    from pathlib import Path

    import transformers

    from random_weights import randomise

    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, Path(out) / f.name)
    vocab = transformers.AutoConfig.from_pretrained(tokenizer_dir).vocab_size
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, **config))
    randomise(model, std=0.06)
    model.to(torch.bfloat16).save_pretrained(out)


_COMPILES_AFTER_START_UP = """
import json, random, sys
import triton
from pagoda_engine import LLM, SamplingParams

compiled = {"start-up": [], "after": []}
phase = "start-up"
def record(**kw):  # the kernel, its constants (constexprs, configuration) and specialisation
    info = kw.get("compile") or {}
    compiled[phase].append(f"{kw['fn'].name} {info.get('constants')} {info.get('configs')}")
triton.knobs.runtime.jit_post_compile_hook = record
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
phase = "after"
rng = random.Random(11)
lengths = (1, 2, 3, 5, 16, 17, 33, 100, 255, 257, 511, 1023, 1025)
def prompts():  # fresh ones each time: no prefix-cache hit shortens a step
    return [[rng.randrange(5, 500) for _ in range(n)] for n in lengths]
llm.generate(prompts(), SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=0))
for prompt in prompts():  # alone: steps of each of these token counts
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
print(json.dumps(compiled))
"""


def triton_compiles_after_start_up(model_dir) -> list[str]:
    """The Triton kernel variants (each as its name, constants and specialisation) that a fresh
    process's engine on `model_dir` compiled or loaded after start-up, over steps of many token
    counts, together and alone. Start-up (the profile step, graph capture, the warm-up steps)
    should leave none: a compile on a live step holds it 100-300 ms. A fresh server's first burst
    did, for the variant of the rotary/K-V write kernel whose positions an odd token count left 8
    bytes off 16-byte alignment. A process of its own: kernels an earlier test ran would be in
    this one's cache, and Triton reports every kernel a fresh process first runs, so start-up
    must report some."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COMPILES_AFTER_START_UP, str(model_dir), json.dumps(LLM_DEFAULTS)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    print("Triton kernels at start-up:", *compiled["start-up"], "after start-up:", *compiled["after"], sep="\n  ")
    assert compiled["start-up"], "Triton reported no kernel at start-up: the hook is not called"
    return compiled["after"]

"""FP8 KV pages (`--kv-cache-dtype fp8`) on the GPU.

- FlashInfer reading FP8 pages (FA2 kernels, bf16 queries) with the layer's scales folded into
  the queries and output, and the fused K/V write quantizing into them, against the reference
  backend over the same FP8 pages (it dequantizes): mixed batches of decodes and prefill chunks at
  Llama-3.1-8B's heads (32/8 of 128), layer scales 1.0 and far from it; the same bf16 tolerance
  as tests/gpu/test_flashinfer_attention.py (the pages' rounding is the same on both sides).
- A Llama-3.1-8B-shaped model (two layers) scoring a 200-token prompt over FP8 pages against
  over bf16 pages: top-1 agreement at least 0.98 where bf16's choice is clear (top-2 log-prob gap
  0.5 or more) and mean KL(bf16 || fp8) at most 0.02 nats per position.
- CUDA graphs on and off give the same greedy tokens over FP8 pages (decode graphs replay
  FlashInfer's FP8 decode, and the Triton decode kernels' for one or two requests and large
  batches, which widen the e4m3 values as they load them).
"""

from __future__ import annotations

import random

import pytest
import torch
from gpu_support import LLAMA_SIZED_CONFIG, greedy_tokens, make_llm, random_prompts, requires_gpu
from pagoda_engine.worker.attention import KVCacheSpec

pytestmark = [pytest.mark.gpu, requires_gpu]
CUDA = torch.device("cuda")
FP8 = torch.float8_e4m3fn
PAGE = 16
NUM_PAGES = 1024
CLEAR_GAP = 0.5  # as tests/gpu/test_fp8_gpu.py


def _batch(rng: random.Random, decode_lens: list[int], prefills: list[tuple[int, int]]):
    from test_flashinfer_attention import make_batch

    return make_batch(rng, decode_lens, prefills, device="cuda")


@pytest.mark.parametrize("scales", [((1.0, 1.0), (1.0, 1.0)), ((0.5, 2.0), (4.0, 0.25))],
                         ids=["unit-scales", "checkpoint-scales"])
@pytest.mark.parametrize("prefills", [[], [(0, 5), (32, 40), (7, 100)]], ids=["decodes", "mixed"])
@pytest.mark.parametrize("num_decodes", [1, 4, 40, 200])
def test_flashinfer_over_fp8_pages_matches_the_reference_over_the_same_pages(scales, num_decodes, prefills):
    """Decodes alone take the Triton decode kernels at one or two requests (short) and at large
    batches, FlashInfer's decode otherwise; mixed steps FlashInfer's prefill beside them."""
    from pagoda_engine.worker.attention.flashinfer import FlashInferBackend
    from pagoda_engine.worker.attention.torch_ref import TorchRefBackend

    spec = KVCacheSpec(num_layers=2, num_kv_heads=8, num_qo_heads=32, head_dim=128, page_size=PAGE, dtype=FP8,
                       compute_dtype=torch.bfloat16, k_scales=scales[0], v_scales=scales[1])
    fi, ref = FlashInferBackend(spec, NUM_PAGES, CUDA), TorchRefBackend(spec, NUM_PAGES, CUDA)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    for a, b in zip(fi.kv_caches, ref.kv_caches):  # the same cached FP8 values in both pools
        a.copy_(torch.randn(a.shape, generator=gen, device=CUDA).to(FP8))
        b.copy_(a)
    rng = random.Random(1)
    # Contexts that fit the pool: short for the 200-request batch (make_batch's pages are NUM_PAGES).
    decode_lens = [rng.randrange(2, 200 if num_decodes < 3 else 600 if num_decodes <= 40 else 80)
                   for _ in range(num_decodes)]
    batch = _batch(rng, decode_lens, prefills)
    q, k, v = (torch.randn(batch.num_tokens, h, 128, generator=gen, device=CUDA).bfloat16() for h in (32, 8, 8))
    for layer in range(2):
        fi.plan(batch)
        ref.plan(batch)
        got, want = fi.forward(layer, q.clone(), k, v), ref.forward(layer, q.clone(), k, v)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        # The fused write (Triton, hardware e4m3 conversion) against torch's: the same codes for
        # the new tokens but where a value sits a hair from a rounding midpoint; nothing else moved.
        # (Indexed as bytes: torch's index kernels take no float8 dtype.)
        pages, offsets = batch.slot_mapping // PAGE, batch.slot_mapping % PAGE
        got_bytes, want_bytes = fi.kv_caches[layer].view(torch.uint8), ref.kv_caches[layer].view(torch.uint8)
        got_new, want_new = got_bytes[pages, :, offsets], want_bytes[pages, :, offsets]
        assert (got_new == want_new).float().mean() >= 0.999
        torch.testing.assert_close(got_new.view(FP8).float(), want_new.view(FP8).float(), rtol=2 ** -3,
                                   atol=2 ** -9)
        got_bytes[pages, :, offsets] = want_new
        assert torch.equal(got_bytes, want_bytes)


def _prompt_logprobs(model_dir, tokens: list[int], **kwargs) -> torch.Tensor:
    """[positions, 2]: the top-2 log-probabilities of every prompt position (prompt_logprobs)."""
    from pagoda_engine import SamplingParams

    llm = make_llm(model_dir, **kwargs)
    try:
        out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20))[0]
    finally:
        llm.close()
    return out.prompt_logprobs[1:]


@pytest.fixture(scope="module")
def llama_sized(tmp_path_factory, gpu_model_dir):
    import shutil

    import transformers
    from gpu_support import save_bf16_with_reference

    config = transformers.LlamaConfig(bos_token_id=128000, eos_token_id=128001, **LLAMA_SIZED_CONFIG)
    model_dir, reference = save_bf16_with_reference(transformers.LlamaForCausalLM, config, 0.02,
                                                    tmp_path_factory.mktemp("llama-sized-fp8-kv"))
    del reference
    # An engine starts with a tokenizer: the tiny model's (the prompts are token ids; ids past its
    # vocabulary decode to nothing).
    for f in gpu_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, model_dir / f.name)
    torch.cuda.empty_cache()
    return model_dir


def test_fp8_kv_logits_agree_with_bf16_kv_at_llama_8b_shapes(llama_sized):
    tokens = random_prompts(3, [200], vocab=128000)[0]
    bf16 = _prompt_logprobs(llama_sized, tokens)
    fp8 = _prompt_logprobs(llama_sized, tokens, kv_cache_dtype="fp8")
    agree, clear, kls = [], [], []
    for want, have in zip(bf16, fp8):
        ranked = sorted(want.items(), key=lambda item: item[1].rank)
        top_have = min(have.items(), key=lambda item: item[1].rank)[0]
        agree.append(ranked[0][0] == top_have)
        clear.append(ranked[0][1].logprob - ranked[1][1].logprob >= CLEAR_GAP)
        # KL over the top-20 of bf16 (the mass the comparison can see), renormalised on both sides.
        ids = [t for t, _ in ranked if t in have]
        p = torch.tensor([want[t].logprob for t in ids]).log_softmax(0)
        r = torch.tensor([have[t].logprob for t in ids]).log_softmax(0)
        kls.append(float((p.exp() * (p - r)).sum()))
    agree, clear = torch.tensor(agree), torch.tensor(clear)
    kl = sum(kls) / len(kls)
    print(f"FP8 KV vs bf16 KV at Llama-3.1-8B shapes: top-1 agreement {agree.float().mean():.3f} over all "
          f"{len(agree)} positions, {agree[clear].float().mean():.3f} over the {int(clear.sum())} clear ones; "
          f"KL(bf16 || fp8) {kl:.4f} nats (over bf16's top 20)")
    assert clear.float().mean() >= 0.1
    assert agree[clear].float().mean() >= 0.98
    assert kl <= 0.02


def test_fp8_kv_greedy_tokens_are_the_same_with_and_without_cuda_graphs(gpu_model_dir):
    prompts = random_prompts(5, [3, 17, 60, 9, 33])
    tokens = []
    for eager in (True, False):
        llm = make_llm(gpu_model_dir, kv_cache_dtype="fp8", enforce_eager=eager)
        try:
            assert llm.core.executor.worker.attn.kv_caches[0].dtype == FP8
            tokens.append(greedy_tokens(llm, prompts, 24))
        finally:
            llm.close()
    assert tokens[0] == tokens[1]


def test_fp8_kv_pool_holds_twice_the_pages_of_bf16(gpu_model_dir):
    """The profile step measures the same budget; FP8 pages are half the bytes, so the budget
    holds about twice the pages (it moves a little between engines: within 5 %). Asked of the
    executor: the pool itself is capped at what max_num_seqs sequences can use."""
    pages = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = make_llm(gpu_model_dir, kv_cache_dtype=kv_cache_dtype)
        try:
            core = llm.core
            pages[kv_cache_dtype] = core.executor.determine_num_kv_pages(core.config, core.max_model_len)
        finally:
            llm.close()
    assert abs(pages["fp8"] / pages["auto"] - 2) < 0.1, pages

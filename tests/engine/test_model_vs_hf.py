"""Pagoda's decoder models give the logits transformers gives, through the paged-attention path.

Each case builds a tiny random Hugging Face model, saves it, loads it with Pagoda's loader and
runs ragged batches (several requests per step, chunked prefill, decodes) through the reference
attention backend with pages handed out in shuffled order. Every step's logits are compared with
transformers' logits at the same positions of the full sequence.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagoda_engine.worker.attention import AttentionBatch
from pagoda_engine.worker.attention.torch_ref import TorchRefBackend
from pagoda_engine.worker.cuda_graphs import SegmentBuffers
from pagoda_engine.worker.model.loader import load_hf_config, load_model
from random_weights import randomise

CPU = torch.device("cpu")
VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            rms_norm_eps=1e-6)

# name → (config class, model class, config overrides). Together they cover: grouped-query
# attention with 6 over 2 and 12 over 4 heads, one KV head, explicit head_dim, tied and untied
# embeddings, q/k/v bias (Qwen2), all-projection bias (Llama attention_bias/mlp_bias), q/k norm
# (Qwen3), and default, llama3, linear and yarn rotary embeddings.
CASES = {
    "llama_gqa6over2": ("LlamaConfig", "LlamaForCausalLM",
                        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)),
    "llama31_rope_tied": ("LlamaConfig", "LlamaForCausalLM",
                          dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                 high_freq_factor=4.0, original_max_position_embeddings=32),
                               rope_theta=500000.0)),
    "llama_linear_rope_bias": ("LlamaConfig", "LlamaForCausalLM",
                               dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                    mlp_bias=True, rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral_one_kv_head": ("MistralConfig", "MistralForCausalLM",
                            dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
    "qwen2_bias_gqa12over4_tied": ("Qwen2Config", "Qwen2ForCausalLM",
                                   dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=4,
                                        tie_word_embeddings=True)),
    "qwen3_qknorm_headdim32": ("Qwen3Config", "Qwen3ForCausalLM",
                               dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen3_yarn_tied": ("Qwen3Config", "Qwen3ForCausalLM",
                        dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                             rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    # Mixture of experts: Mixtral (renormalised top-2 of 4), Qwen2-MoE (gated shared expert, top-2
    # weights not renormalised, layer 1 dense), Qwen3-MoE (q/k norm, renormalised top-2 of 8).
    "mixtral_moe": ("MixtralConfig", "MixtralForCausalLM",
                    dict(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe_shared_expert": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                                dict(num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=48, shared_expert_intermediate_size=80,
                                     norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe_normalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                             dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request, tmp_path_factory):
    """(transformers model, Pagoda model, their directory): the same random weights, float32 on CPU."""
    config_cls, model_cls, overrides = CASES[request.param]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    torch.manual_seed(sum(map(ord, request.param)))
    hf = getattr(transformers, model_cls)(config)
    randomise(hf, std=0.15, norm_spread=0.3)
    hf.eval()
    model_dir = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(model_dir)
    ours = load_model(str(model_dir), load_hf_config(str(model_dir)), torch.float32, CPU)
    # An eager transformers model is the reference: its attention is independent of SDPA.
    reference = getattr(transformers, model_cls).from_pretrained(model_dir, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    return reference, ours, model_dir


class PagedRunner:
    """The part of a model runner these tests need: page tables from a shuffled free list, slot
    mapping, positions, one forward per step."""

    def __init__(self, model, page_size: int, num_pages: int = 64, seed: int = 0, device: torch.device = CPU):
        self.model = model
        self.page_size = page_size
        self.device = device
        dtype = next(model.parameters()).dtype
        self.attn = TorchRefBackend(model.kv_cache_spec(page_size, dtype), num_pages, device)
        self.free_pages = list(range(1, num_pages))  # page 0 is the null page
        random.Random(seed).shuffle(self.free_pages)
        self.page_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run each request's new tokens (decodes listed first); return each chunk's logits [len, vocab]."""
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for rid, tokens in chunks:
            start = self.num_computed.get(rid, 0)
            end = start + len(tokens)
            table = self.page_tables.setdefault(rid, [])
            while len(table) * self.page_size < end:
                table.append(self.free_pages.pop())
            ids += tokens
            positions += range(start, end)
            slots += [table[p // self.page_size] * self.page_size + p % self.page_size for p in range(start, end)]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            self.num_computed[rid] = end
        num_decodes = 0
        while num_decodes < len(chunks) and query_lens[num_decodes] == 1 and seq_lens[num_decodes] > 1:
            num_decodes += 1
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=self.device)
        self.attn.plan(AttentionBatch(query_lens, seq_lens, tables, slot_mapping, num_decodes))
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), self.attn)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape == (len(ids), VOCAB)
        return list(logits.cpu().split(query_lens))


def reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 end to end; differences come only from summation order.
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("page_size", [4, 16])
def test_ragged_prefill_batch_matches_transformers(models, page_size):
    reference, ours, _ = models
    rng = random.Random(1)
    prompts = {f"r{n}": [rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 40)}
    runner = PagedRunner(ours, page_size)
    logits = runner.step(list(prompts.items()))
    for (rid, tokens), got in zip(prompts.items(), logits):
        assert_logits_close(got, reference_logits(reference, tokens))


def test_chunked_prefill_then_decodes_match_transformers(models):
    """Two requests share steps: one prefilled in three chunks while the other decodes, then both
    decode greedily. Each step's last-token logits equal transformers' on the whole sequence."""
    reference, ours, _ = models
    rng = random.Random(2)
    seqs = {"a": [rng.randrange(VOCAB) for _ in range(23)], "b": [rng.randrange(VOCAB) for _ in range(9)]}
    runner = PagedRunner(ours, page_size=4, seed=3)
    recorded: list[tuple[str, int, torch.Tensor]] = []  # (request, position, logits there)

    def run(chunks):
        for (rid, tokens), got in zip(chunks, runner.step(chunks)):
            recorded.append((rid, runner.num_computed[rid] - 1, got[-1]))

    def greedy(rid):  # append the token our model predicts, as an engine would
        last = [lg for r, _, lg in recorded if r == rid][-1]
        seqs[rid].append(int(last.argmax()))
        return [seqs[rid][-1]]

    run([("a", seqs["a"][:8]), ("b", seqs["b"])])
    run([("b", greedy("b")), ("a", seqs["a"][8:18])])
    run([("b", greedy("b")), ("a", seqs["a"][18:23])])
    for _ in range(4):
        run([("a", greedy("a")), ("b", greedy("b"))])

    full = {rid: reference_logits(reference, tokens) for rid, tokens in seqs.items()}
    assert len(recorded) == 14
    for rid, position, got in recorded:
        assert_logits_close(got, full[rid][position])


def test_segments_over_fixed_buffers_give_the_forward(models):
    """The piecewise CUDA graphs' way through the model, run eagerly on CPU: the forward cut at
    every attention call, over fixed buffers padded past the step's tokens, with attention over
    the real rows in between. A mixed step (a decode and a 21-token chunk, padded to 32) gives
    the logits of the ordinary forward."""
    _, ours, _ = models
    rng = random.Random(5)
    runner = PagedRunner(ours, page_size=4, seed=6)
    runner.step([("a", [rng.randrange(VOCAB) for _ in range(11)])])
    chunks = [("a", [rng.randrange(VOCAB)]), ("b", [rng.randrange(VOCAB) for _ in range(21)])]
    expected = torch.cat(runner.step(chunks))  # the forward; also writes the step's K/V

    buffers = SegmentBuffers(ours, runner.attn, CPU, max_tokens=32)
    ids = torch.tensor([t for _, tokens in chunks for t in tokens])
    positions = torch.tensor([11] + list(range(21)))
    buffers.load(ids, positions, size=32)
    with torch.no_grad():
        for i in range(buffers.num_segments - 1):
            buffers.segment(i, 32)
            buffers.attend(i, num_tokens=22)  # the plan of runner.step's mixed batch still holds
        hidden = buffers.segment(buffers.num_segments - 1, 32)
        got = ours.compute_logits(hidden[:22])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_forward_matches_transformers(models, dtype):
    """Loaded straight to the GPU: float32 agrees as on CPU; bfloat16 stays within rounding."""
    reference, _, model_dir = models
    cuda = torch.device("cuda")
    ours = load_model(str(model_dir), load_hf_config(str(model_dir)), dtype, cuda)
    if ours.moe is not None and dtype == torch.bfloat16:
        # bf16 rounding flips the routing of tokens whose top-k experts nearly tie, which these
        # tiny random routers do often, and such a token then takes another expert (as in any
        # bf16 MoE engine). MoE in bf16 is held to this bound at Qwen3-30B-A3B's size instead
        # (tests/gpu/test_moe_sized_gpu.py), and its kernels to the exact loop (test_moe_kernels_gpu.py).
        pytest.skip("tiny random MoE routers tie too often for a bf16 bound; see test_moe_sized_gpu.py")
    assert next(ours.parameters()).device.type == "cuda"
    rng = random.Random(4)
    prompts = {f"r{n}": [rng.randrange(VOCAB) for _ in range(n)] for n in (3, 30, 70)}
    logits = PagedRunner(ours, page_size=16, device=cuda).step(list(prompts.items()))
    for tokens, got in zip(prompts.values(), logits):
        ref = reference_logits(reference, tokens)
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3)
        else:
            scale = ref.abs().max().item()
            # Seen on an H200: at most 3% of the largest logit, cosine similarity at least 0.9989.
            assert (got - ref).abs().max().item() <= 0.05 * scale
            assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() > 0.995

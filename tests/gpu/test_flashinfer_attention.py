"""The FlashInfer backend against the PyTorch reference backend on the same mixed batches:
decodes and prefill chunks (some after cached tokens) in one step, pages in shuffled order."""

from __future__ import annotations

import random

import pytest
import torch
from gpu_support import requires_gpu
from pagoda_engine.worker.attention import AttentionBatch, KVCacheSpec

pytestmark = [pytest.mark.gpu, requires_gpu]

PAGE = 16
NUM_PAGES = 1024


def make_batch(rng: random.Random, decode_lens: list[int], prefills: list[tuple[int, int]], device):
    """decode_lens: context lengths (cached + the new token); prefills: (cached, new) per chunk."""
    free = list(range(1, NUM_PAGES))
    rng.shuffle(free)
    query_lens, seq_lens, tables, slots = [], [], [], []
    for cached, new in [(n - 1, 1) for n in decode_lens] + prefills:
        seq_len = cached + new
        table = [free.pop() for _ in range(-(-seq_len // PAGE))]
        query_lens.append(new)
        seq_lens.append(seq_len)
        tables.append(table)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(cached, seq_len)]
    return AttentionBatch(query_lens, seq_lens, tables, torch.tensor(slots, device=device), len(decode_lens))


def backends(num_qo_heads, num_kv_heads, head_dim, num_layers=2):
    from pagoda_engine.worker.attention.flashinfer import FlashInferBackend
    from pagoda_engine.worker.attention.torch_ref import TorchRefBackend

    cuda = torch.device("cuda")
    spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=num_kv_heads, num_qo_heads=num_qo_heads, head_dim=head_dim,
                       page_size=PAGE, dtype=torch.bfloat16)
    fi, ref = FlashInferBackend(spec, NUM_PAGES, cuda), TorchRefBackend(spec, NUM_PAGES, cuda)
    # The same cached K/V (the tokens before each new chunk) in both pools.
    gen = torch.Generator(device=cuda).manual_seed(0)
    for a, b in zip(fi.kv_caches, ref.kv_caches):
        a.copy_(torch.randn(a.shape, generator=gen, device=cuda, dtype=torch.float32))
        b.copy_(a)
    return fi, ref


@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 8, 64), (8, 2, 64)], ids=["gqa4-d128", "mha-d64", "gqa4-d64"])
@pytest.mark.parametrize("num_decodes", [4, 40], ids=["few-decodes", "many-decodes"])
def test_mixed_batch_matches_reference(heads, num_decodes):
    num_qo, num_kv, head_dim = heads
    fi, ref = backends(num_qo, num_kv, head_dim)
    rng = random.Random(1)
    decode_lens = [2, 17, 300, 33] + [rng.randrange(2, 400) for _ in range(num_decodes - 4)]
    batch = make_batch(rng, decode_lens=decode_lens, prefills=[(0, 5), (32, 40), (7, 100), (0, 1)], device="cuda")
    t = batch.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(t, h, head_dim, generator=gen, device="cuda").bfloat16() for h in (num_qo, num_kv, num_kv))
    for layer in range(2):
        fi.plan(batch)
        ref.plan(batch)
        got, want = fi.forward(layer, q, k, v), ref.forward(layer, q, k, v)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(fi.kv_caches[layer], ref.kv_caches[layer], atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["mixed", "decodes", "prefills"])
def test_later_layers_replay_the_first_layers_kernel_call(kind):
    """One plan, four layers: layer 0 goes through FlashInfer's `run`, layers 1-3 replay the call
    it made with their own q, pages and output. Each layer matches the reference, and the replay
    gives the bits `run` gives."""
    fi, ref = backends(32, 8, 128, num_layers=4)
    rng = random.Random(5)
    decode_lens = [rng.randrange(2, 700) for _ in range(12)] if kind != "prefills" else []
    prefills = [(0, 30), (64, 200), (5, 1)] if kind != "decodes" else []
    batch = make_batch(rng, decode_lens=decode_lens, prefills=prefills, device="cuda")
    t = batch.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(6)
    qs, ks, vs = ([torch.randn(t, h, 128, generator=gen, device="cuda").bfloat16() for _ in range(4)]
                  for h in (32, 8, 8))
    fi.plan(batch)
    ref.plan(batch)
    got = [fi.forward(layer, qs[layer], ks[layer], vs[layer]) for layer in range(4)]
    replays = fi._step.replays
    assert len(replays) == (2 if kind == "mixed" else 1)
    assert all(r is not None for r in replays.values()), "FlashInfer's run made a call the backend cannot replay"
    for layer in range(4):
        want = ref.forward(layer, qs[layer], ks[layer], vs[layer])
        torch.testing.assert_close(got[layer].float(), want.float(), atol=2e-2, rtol=2e-2)
    # `run` itself, for every layer (a fresh plan records again at its first layer: use layer 0 for that).
    fi.plan(batch)
    fi.forward(0, qs[0], ks[0], vs[0])
    fi._step.replays = {key: None for key in fi._step.replays}
    for layer in range(1, 4):
        torch.testing.assert_close(fi.forward(layer, qs[layer], ks[layer], vs[layer]), got[layer], atol=0, rtol=0)


@pytest.mark.parametrize("num_reqs,padded", [(5, 8), (21, 32)])
def test_graph_decode_plan_with_padding_matches_eager(num_reqs, padded):
    """A decode batch planned into the CUDA-graph buffers, padded to a larger size, gives the real
    rows the eager plan's outputs; the padding writes only the null page."""
    fi, _ = backends(32, 8, 128)
    fi.init_graph_buffers([8, 32], max_pages_per_seq=64)
    rng = random.Random(3)
    lens = [2, 40, 513, 16, 17] + [rng.randrange(2, 300) for _ in range(num_reqs - 5)]
    batch = make_batch(rng, decode_lens=lens, prefills=[], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(padded, 32, 128, generator=gen, device="cuda").bfloat16()
    k, v = (torch.randn(padded, 8, 128, generator=gen, device="cuda").bfloat16() for _ in range(2))
    fi.plan(batch)
    eager = fi.forward(0, q[:num_reqs], k[:num_reqs], v[:num_reqs]).clone()
    before = fi.kv_caches[0][1:].clone()
    fi.plan_graph_decode(batch, padded)
    out = fi.forward(0, q, k, v)
    torch.testing.assert_close(out[:num_reqs], eager, atol=1e-2, rtol=1e-2)
    assert torch.equal(fi.kv_caches[0][1:], before)  # real rows rewrote the same K/V; padding only page 0


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm-and-rotary"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 2, 64), (32, 4, 128)],
                         ids=["gqa4-d128", "gqa4-d64", "qwen3-30b-a3b"])
@pytest.mark.parametrize("separate", [False, True], ids=["qkv-slices", "separate-q-k-v"])
def test_rotary_handed_to_the_backend_matches_reference(heads, separate, qk_norm):
    """Layers hand their rotary (and Qwen3's layers their per-head q/k norms) to `forward`:
    FlashInfer's backend normalises and rotates in the fused K/V-write kernel, the reference
    applies the model's norms and rotary first; outputs and pages agree."""
    from pagoda_engine.worker.model.layers import RMSNorm, RotaryEmbedding

    num_qo, num_kv, head_dim = heads
    rotary = RotaryEmbedding(head_dim, 2048, 500000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=256))
    rotary = rotary.to("cuda")
    fi, ref = backends(num_qo, num_kv, head_dim)
    rng = random.Random(5)
    batch = make_batch(rng, decode_lens=[2, 300, 33], prefills=[(0, 5), (32, 40)], device="cuda")
    positions = torch.tensor([n - 1 for n in (2, 300, 33)] + list(range(5)) + list(range(32, 72)), device="cuda")
    t = batch.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(6)
    if separate:
        q, k, v = (torch.randn(t, h, head_dim, generator=gen, device="cuda").bfloat16() for h in (num_qo, num_kv, num_kv))
    else:
        qkv = torch.randn(t, (num_qo + 2 * num_kv) * head_dim, generator=gen, device="cuda").bfloat16()
        q, k, v = (x.view(t, -1, head_dim) for x in qkv.split([num_qo * head_dim, num_kv * head_dim,
                                                                num_kv * head_dim], dim=-1))
    norms = {}
    if qk_norm:
        q_norm, k_norm = (RMSNorm(head_dim, 1e-6).requires_grad_(False).to("cuda") for _ in range(2))
        for norm in (q_norm, k_norm):
            norm.weight.copy_(1 + 0.2 * torch.randn(head_dim, generator=gen, device="cuda"))
        norms = dict(q_norm=q_norm.bfloat16(), k_norm=k_norm.bfloat16())
    fi.plan(batch)
    ref.plan(batch)
    want = ref.forward(0, q.clone(), k.clone(), v.clone(), positions=positions, rotary=rotary, **norms)
    got = fi.forward(0, q, k, v, positions=positions, rotary=rotary, **norms)  # q rotated in place, in the qkv output
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    # With the norms both round the normalised values to bf16 before rotating: rarely a step apart there too.
    torch.testing.assert_close(fi.kv_caches[0].float(), ref.kv_caches[0].float(), atol=3e-2 if qk_norm else 2e-2,
                               rtol=1e-2)


@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 4, 128), (64, 8, 128)], ids=["llama-8b", "qwen3-30b-a3b", "llama-70b"])
def test_graph_decode_of_1024_rows_plans_in_a_workspace_sized_for_it(heads):
    """`--max-num-seqs 1024 --max-cudagraph-capture-size 1024` on an H100 failed to start:
    FlashInfer's graph plan for 1,024 rows of 32 query heads takes 335 MB of split-KV scratch,
    more than the default 256 MiB workspace. The backend now grows the workspace to what the
    largest graph batch needs, and an eager plan still runs after it."""
    from pagoda_engine.worker.attention.flashinfer import WORKSPACE_BYTES, graph_decode_workspace_bytes

    num_qo, num_kv, head_dim = heads
    fi, _ = backends(num_qo, num_kv, head_dim)
    fi.init_graph_buffers([1, 1024], max_pages_per_seq=1)
    need = graph_decode_workspace_bytes(num_qo, num_kv, head_dim, 1024)
    assert fi.workspace.numel() == max(need, WORKSPACE_BYTES) and need > WORKSPACE_BYTES
    rng = random.Random(5)
    n = 1000
    batch = make_batch(rng, decode_lens=[rng.randrange(2, PAGE + 1) for _ in range(n)], prefills=[], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(1024, num_qo, head_dim, generator=gen, device="cuda").bfloat16()
    k, v = (torch.randn(1024, num_kv, head_dim, generator=gen, device="cuda").bfloat16() for _ in range(2))
    fi.plan(batch)
    eager = fi.forward(0, q[:n], k[:n], v[:n]).clone()
    fi.plan_graph_decode(batch, 1024)
    out = fi.forward(0, q, k, v)
    torch.testing.assert_close(out[:n], eager, atol=1e-2, rtol=1e-2)

"""The batched LoRA kernels (`model/lora_triton.py`) under Triton's CPU interpreter, against the
dense per-row product: rows of three adapter slots and of the base model interleaved, a slot with
no rows, several output slices (q/k/v), ranks below the slot width (zero-padded) and uneven sizes.

Skips where Triton does not import; at Llama-3.1-8B's shapes on a GPU, inside CUDA graphs, it is
tests/gpu/test_lora_gpu.py."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from triton_interpreter import import_kernels  # noqa: E402

from pagoda_engine.worker.model.lora import LoRABatch, LoRALayer, _Slice  # noqa: E402

kernels = import_kernels("pagoda_engine.worker.model.lora_triton")

# Without a GPU, `tl.dot` is interpreted only when the switch was on as Triton was imported: run
# with TRITON_INTERPRET=1 set for the whole process (the Makefile's TRITON_KERNEL_TESTS).
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="without a GPU these kernels run only with TRITON_INTERPRET=1 set")


def dense_reference(x, y, layer: LoRALayer, row_slots: list[int], scales: list[float]) -> torch.Tensor:
    """y + for each row its slot's scale × x A^T B^T per slice, in float32, row by row."""
    out = y.float().clone()
    r = layer.rank
    for t, slot in enumerate(row_slots):
        if slot < 0:
            continue
        shrunk = x[t].float() @ layer.lora_a[slot].float().t()
        for i, s in enumerate(layer.slices):
            part = shrunk[i * r:(i + 1) * r] @ layer.b(i)[slot].float().t()
            out[t, s.out_offset:s.out_offset + s.out_size] += scales[slot] * part
    return out


# float16 and float32: the interpreter's `tl.dot` of bfloat16 operands is wrong (numpy has no
# bfloat16); bfloat16 is tests/gpu/test_lora_gpu.py's.
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
# Slices on 128- or 64-column edges take one expand for the whole output (the widest block that
# fits); others one per slice. K above
# the shrink's 64-wide tile is split over programs: 200 in four chunks, the last short; 2,200 in
# chunks of three tiles (the 32-row step) or two (the 7-row one) (`_split_k`), the expand summing
# their partial planes.
@pytest.mark.parametrize("k,sizes,rank,ranks", [(64, [48, 16, 16], 16, [16, 8, 4]), (40, [70], 8, [8, 8, 3]),
                                                (32, [128, 64, 64], 16, [16, 4, 8]), (48, [64, 192], 8, [8, 2, 5]),
                                                (200, [48, 16, 16], 16, [16, 8, 4]), (2200, [64], 8, [8, 3, 5]),
                                                (96, [128, 128, 256], 16, [16, 2, 9])])
def test_shrink_expand_equal_the_dense_product(k, sizes, rank, ranks, dtype):
    gen = torch.Generator().manual_seed(k + rank)
    num_slots = 4  # slot 3 holds an adapter that no row names
    batch = LoRABatch(num_slots, 64, torch.device("cpu"))
    slices, offset = [], 0
    for i, n in enumerate(sizes):
        slices.append(_Slice(f"m{i}", offset, n, (0, n, n)))
        offset += n
    layer = LoRALayer(slices, k, None, k, batch, rank, torch.float32)
    scales = [0.5, 2.0, 1.25, 3.0]
    for slot in range(num_slots):
        r = ranks[slot % len(ranks)]
        for i in range(len(slices)):
            layer.place(slot, i, torch.randn(r, k, generator=gen), torch.randn(sizes[i], r, generator=gen))
        batch.scales[slot] = scales[slot]
    typed = LoRALayer(slices, k, None, k, batch, rank, dtype)
    typed.lora_a.copy_(layer.lora_a)
    for i in range(len(slices)):
        typed.b(i).copy_(layer.b(i))
    batch.use_kernels = True  # the kernels' buffers, on the CPU (the interpreter reads host memory)
    batch.block_m = 16  # slot 2's 20 rows take two blocks
    # Requests in batch order: (new tokens, slot); base rows between the adapters' rows. The second
    # step is smaller, on the same buffers: the first step's blocks past its own must not run; in the
    # third, three rows of three slots, as many blocks as rows (the grid's bound).
    for query_lens, lora_slots in (([3, 1, 20, 1, 5, 2], [0, -1, 2, 0, -1, 1]), ([2, 4, 1], [1, -1, 0]),
                                   ([1, 1, 1], [2, 0, 1])):
        row_slots = [s for n, s in zip(query_lens, lora_slots) for _ in range(n)]
        t = len(row_slots)
        x = torch.randn(t, k, generator=gen).to(dtype)
        y = torch.randn(t, offset, generator=gen).to(dtype)
        batch.set(query_lens, lora_slots)
        got = kernels.add_lora(x, y.clone(), typed, batch)
        expected = dense_reference(x, y, typed, row_slots, scales)
        base = [i for i, s in enumerate(row_slots) if s < 0]
        assert torch.equal(got[base], y[base])  # base rows untouched
        torch.testing.assert_close(got.float(), expected, rtol=1e-2, atol=1e-1)


@pytest.mark.parametrize("rows", [1, 16, 64, 256, 2048, 16384])
@pytest.mark.parametrize("k", [40, 64, 4096, 14336])
def test_the_split_of_k_covers_it_in_whole_tiles(rows, k):
    """The shrink's K chunks: whole 64-wide tiles, every column of K in exactly one chunk, at most
    MAX_SPLITS of them, many for a decode step's rows, few for hundreds of rows (the expand re-reads
    every row's planes) and none (one chunk) for a prefill."""
    for n_tiles in (1, 3):
        chunk, splits = kernels._split_k(rows, 32, n_tiles, k)
        assert chunk % kernels._BLOCK_K == 0 and 1 <= splits <= kernels.MAX_SPLITS
        assert (splits - 1) * chunk < k <= splits * chunk
        if rows <= 32 and k >= 32 * kernels._BLOCK_K:
            assert splits >= kernels.MAX_SPLITS // 2
        if rows >= 16384:  # a long prefill's row blocks are programs enough
            assert splits == 1
        assert splits == 1 or splits ** 2 * rows <= kernels._PLANE_BUDGET


def _one_row_layer(k: int, sizes: list[int], rank: int, slot_of_row: int):
    """A bf16 LoRA layer of 3 slots (random A, B; scales 0.5, 2, 1.25) and a one-row step on `slot_of_row`."""
    gen = torch.Generator().manual_seed(k + rank)
    batch = LoRABatch(3, 64, torch.device("cpu"))
    batch.use_kernels = True
    slices, offset = [], 0
    for i, n in enumerate(sizes):
        slices.append(_Slice(f"m{i}", offset, n, (0, n, n)))
        offset += n
    layer = LoRALayer(slices, k, None, k, batch, rank, torch.bfloat16)
    layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=gen) * k ** -0.5)
    layer.lora_b.copy_(torch.randn(layer.lora_b.shape, generator=gen))
    batch.scales.copy_(torch.tensor([0.5, 2.0, 1.25]))
    batch.set([1], [slot_of_row])
    return layer, gen


# bfloat16: these one-row kernels multiply elementwise (no `tl.dot`), which the interpreter does right.
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("slot", [1, -1], ids=["adapter", "base"])
@pytest.mark.parametrize("k", [64, 200])
def test_the_one_row_kernels_shrink_the_row_in_extra_programs(k, slot, fp8):
    """`gemv_triton.gemv` and `gemv_rmsnorm` with `lora`: their outputs are the bits they give
    without it, and the extra programs' shrunk row is x (or the normalised row) · A[slot]^T; the
    same over an FP8 base weight with its row scales (`--quantization fp8` with adapters: the
    adapters stay in the activations' dtype)."""
    from pagoda_engine.worker.model.fp8_math import quantize_rows

    gemv = import_kernels("pagoda_engine.worker.model.gemv_triton")
    layer, gen = _one_row_layer(k, [40, 24], 8, slot)
    x = torch.randn(1, k, generator=gen).bfloat16()
    res = torch.randn(1, k, generator=gen).bfloat16()
    norm_w = torch.randn(k, generator=gen).bfloat16()
    w = (torch.randn(70, k, generator=gen) * k ** -0.5).bfloat16()
    w, scale = quantize_rows(w) if fp8 else (w, None)
    one_row = layer.one_row(x)
    y, shrunk = gemv.gemv(x, w, scale=scale, lora=one_row)
    assert torch.equal(y, gemv.gemv(x, w, scale=scale)) and shrunk.shape == (1, 1, 16)
    y2, res2, normed, shrunk2 = gemv.gemv_rmsnorm(x, res, norm_w, 1e-5, w, normed_out=True, scale=scale, lora=one_row)
    for got, expected in zip((y2, res2, normed),
                             gemv.gemv_rmsnorm(x, res, norm_w, 1e-5, w, normed_out=True, scale=scale)):
        assert torch.equal(got, expected)
    if slot >= 0:
        a = layer.lora_a[slot].float()
        torch.testing.assert_close(shrunk[0], x.float() @ a.t(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(shrunk2[0], normed.float() @ a.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slot", [2, -1], ids=["adapter", "base"])
def test_the_one_row_gated_expand_is_silu_of_gate_times_up_with_the_adapter(slot):
    """`expand_act`: gate and up each plus the slot's scale × shrunk · B^T, rounded to bf16 as the
    expand would write them, then SiLU(gate) × up; the base row's is SiLU-and-mul of y alone."""
    inter, rank = 96, 16
    layer, gen = _one_row_layer(32, [inter, inter], rank, slot)
    y = torch.randn(1, 2 * inter, generator=gen).bfloat16()
    shrunk = torch.randn(1, 1, 2 * rank, generator=gen)
    got = kernels.expand_act(shrunk, y, layer, layer.batch)
    gate, up = y.float().chunk(2, dim=-1)
    if slot >= 0:
        scale = layer.batch.scales[slot].item()
        gate = (gate + scale * shrunk[0, :, :rank] @ layer.b(0)[slot].float().t()).bfloat16().float()
        up = (up + scale * shrunk[0, :, rank:] @ layer.b(1)[slot].float().t()).bfloat16().float()
    expected = torch.nn.functional.silu(gate) * up
    # A bf16 ulp apart where the float32 sums round to either side: 2 % of the value, 1 % of the largest.
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=1e-2 * expected.abs().max().item())


def test_the_engine_on_the_kernels_serves_each_adapter_as_peft_does(tmp_path):
    """The whole engine with its LoRA layers on the kernels (interpreted, float32): a batch of the
    base and three adapters (two device slots) gives PEFT's greedy tokens: the slices' offsets,
    the block table and the slots as the engine fills them."""
    pytest.importorskip("peft")
    from lora_adapters import ADAPTERS, peft_greedy, write_adapter

    from pagoda_engine import LLM, LoRARequest, SamplingParams
    from pagoda_engine.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2", seed=3)
    paths = {name: write_adapter(model_dir, tmp_path / name, *spec, seed=i + 1)
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    prompts = [[(3 * i + 1) % 400 + 5 for i in range(23)]]
    new_tokens = 4
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=64, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.core.executor.worker.lora.batch.use_kernels = True
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}
    names = [None, *loras]
    outs = llm.generate([p for _ in names for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens),
                        lora_request=[loras.get(n) for n in names for _ in prompts])
    got = [o.outputs[0].token_ids for o in outs]
    for i, name in enumerate(names):
        assert got[i * len(prompts):(i + 1) * len(prompts)] == peft_greedy(model_dir, paths.get(name), prompts,
                                                                           new_tokens), name


def test_lone_requests_through_the_one_row_kernels_decode_as_peft_does(tmp_path, monkeypatch):
    """The layers' one-row path as a GPU runs it (`gemv_triton`'s kernels, interpreted here: every
    one-row projection takes them, the norms folded into q/k/v and gate/up), each request alone so
    that every decode step is one row: the kernels' LoRA programs shrink the row, the expands (and
    gate/up's with the activation) follow, and each adapter's greedy tokens are PEFT's. Qwen2: q/k/v
    with biases, in the folded kernel."""
    pytest.importorskip("peft")
    from lora_adapters import ADAPTERS, peft_greedy, write_adapter

    from pagoda_engine import LLM, LoRARequest, SamplingParams
    from pagoda_engine.tiny import VOCAB_SIZE, build_tiny_model
    from pagoda_engine.worker.model import layers

    gemv = import_kernels("pagoda_engine.worker.model.gemv_triton")
    fused = {"lora": 0, "rmsnorm": 0}

    def counted(fn, key):
        def call(*args, **kwargs):
            fused[key] += kwargs.get("lora") is not None
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(gemv, "gemv", counted(gemv.gemv, "lora"))
    monkeypatch.setattr(gemv, "gemv_rmsnorm", counted(gemv.gemv_rmsnorm, "rmsnorm"))
    # 16 columns a program, not the GPU's one or two: the interpreter runs programs one by one (and
    # 16 leaves the LoRA programs' last block of A's rows part-masked at rank 8).
    one_row_config, norm_config = gemv.one_row_config, gemv.norm_config
    monkeypatch.setattr(gemv, "one_row_config", lambda *a: one_row_config(*a)._replace(block_n=16, split_k=1))
    monkeypatch.setattr(gemv, "norm_config", lambda *a: norm_config(*a)._replace(block_n=16, blocks=1))
    # The CUDA-only switches, opened for one row on the CPU (not for the LM head: it takes no adapter).
    def one_row(x, w):
        return gemv if x.shape[0] == 1 and w.shape[0] < VOCAB_SIZE else None

    monkeypatch.setattr(layers, "_gemv_kernels", one_row)
    monkeypatch.setattr(layers, "_gemv_norm_kernels", lambda norm, x, res, w: one_row(x, w))

    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2", seed=5)
    paths = {name: write_adapter(model_dir, tmp_path / name, *spec, seed=i + 1)
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    prompts = [[(7 * i + 3) % 400 + 5 for i in range(11)]]
    new_tokens = 4
    llm = LLM(str(model_dir), dtype="float32", num_kv_pages=64, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.core.executor.worker.lora.batch.use_kernels = True
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    for name in [None, *loras]:
        got = [llm.generate(prompts, params, lora_request=loras.get(name))[0].outputs[0].token_ids]
        assert got == peft_greedy(model_dir, paths.get(name), prompts, new_tokens), name
    assert fused["lora"] and fused["rmsnorm"]

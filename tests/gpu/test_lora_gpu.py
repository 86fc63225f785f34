"""Multi-LoRA on the GPU: the Triton shrink/expand kernels (`model/lora_triton.py`) against a dense
float32 reference at Llama-3.1-8B's projection shapes, ranks 8 to 64, rows of several adapters
and of the base model interleaved, eagerly and replayed inside a CUDA graph whose slots change
between replays, the same bits every run and with or without PDL; a lone row's shrink inside the
one-row matrix-vector kernels likewise; the engine with CUDA graphs on: every adapter's greedy
tokens are transformers + PEFT's (float32) and equal the eager engine's, in a batch and for a lone
request (one-row decode steps); and `python -m pagoda_engine.bench.lora_kernels`."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_support import CUDA, hf_logits, make_llm, random_prompts, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

# Llama-3.1-8B's projections: (name, input width, output slices).
LLAMA_8B = {
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
NUM_SLOTS = 4


def _layer(in_features: int, sizes: list[int], rank: int, gen: torch.Generator):
    from pagoda_engine.worker.model.lora import LoRABatch, LoRALayer, _Slice

    batch = LoRABatch(NUM_SLOTS, 4096, CUDA)
    slices, offset = [], 0
    for i, n in enumerate(sizes):
        slices.append(_Slice(f"m{i}", offset, n, (0, n, n)))
        offset += n
    layer = LoRALayer(slices, in_features, None, in_features, batch, rank, torch.bfloat16)
    for slot in range(NUM_SLOTS):
        r = rank if slot % 2 == 0 else max(rank // 2, 1)  # odd slots: an adapter of lower rank, zero-padded
        for i, n in enumerate(sizes):
            a = torch.randn(r, in_features, generator=gen) * in_features ** -0.5
            b = torch.randn(n, r, generator=gen) * r ** -0.5
            layer.place(slot, i, a.to(CUDA), b.to(CUDA))
        batch.scales[slot] = 0.5 + slot
    return layer, batch, offset


def _dense(x, y, layer, row_slots: list[int]) -> torch.Tensor:
    """y + each row's slot's scale × x A^T B^T, float32, slot by slot (dense matmuls over its rows)."""
    out = y.float().clone()
    r = layer.rank
    slots = torch.tensor(row_slots, device=CUDA)
    for slot in range(NUM_SLOTS):
        rows = (slots == slot).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        shrunk = x[rows].float() @ layer.lora_a[slot].float().t()
        for i, s in enumerate(layer.slices):
            part = shrunk[:, i * r:(i + 1) * r] @ layer.b(i)[slot].float().t()
            out[rows, s.out_offset:s.out_offset + s.out_size] += layer.batch.scales[slot] * part
    return out


def _step(num_tokens: int, seed: int) -> tuple[list[int], list[int]]:
    """Requests (new tokens, slot) covering `num_tokens` rows: decodes and chunks, slots -1..3, one slot left out."""
    rng = random.Random(seed)
    query_lens, slots, left = [], [], num_tokens
    unused = rng.randrange(NUM_SLOTS)
    while left:
        n = min(left, rng.choice([1, 1, 1, 7, 64, 300]))
        query_lens.append(n)
        slots.append(rng.choice([s for s in (-1, 0, 1, 2, 3) if s != unused]))
        left -= n
    return query_lens, slots


def _close(got, expected) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("rank", [8, 16, 32, 64])
@pytest.mark.parametrize("proj", sorted(LLAMA_8B))
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 2048])
def test_kernels_equal_the_dense_reference(proj, rank, num_tokens):
    from pagoda_engine.worker.model.lora_triton import add_lora

    gen = torch.Generator().manual_seed(rank + num_tokens)
    in_features, sizes = LLAMA_8B[proj]
    layer, batch, width = _layer(in_features, sizes, rank, gen)
    query_lens, slots = _step(num_tokens, rank)
    batch.set(query_lens, slots)
    row_slots = [s for n, s in zip(query_lens, slots) for _ in range(n)]
    x = torch.randn(num_tokens, in_features, generator=gen).to(CUDA, torch.bfloat16)
    y = torch.randn(num_tokens, width, generator=gen).to(CUDA, torch.bfloat16)
    expected = _dense(x, y, layer, row_slots)
    got = add_lora(x, y.clone(), layer, batch)
    base = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[base], y[base])
    _close(got, expected)
    # The K-split's partial planes are summed in one order: the same bits every run.
    for _ in range(3):
        assert torch.equal(add_lora(x, y.clone(), layer, batch), got)


@pytest.mark.parametrize("rank", [16, 64])
def test_a_captured_graph_serves_the_slots_each_replay_names(rank):
    """One capture at a padded row count; three replays whose steps name other slots (and fewer
    rows than the capture, the rest base padding) each equal the dense reference."""
    from pagoda_engine.worker.model.lora_triton import add_lora

    gen = torch.Generator().manual_seed(rank)
    in_features, sizes = LLAMA_8B["qkv"]
    layer, batch, width = _layer(in_features, sizes, rank, gen)
    rows = 64
    x = torch.zeros(rows, in_features, device=CUDA, dtype=torch.bfloat16)
    y = torch.zeros(rows, width, device=CUDA, dtype=torch.bfloat16)
    batch.set([rows], [0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        add_lora(x, y.clone(), layer, batch)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    out = torch.empty_like(y)
    y_in = torch.empty_like(y)
    with torch.cuda.graph(graph):
        out.copy_(add_lora(x, y_in.clone(), layer, batch))
    for seed in range(3):
        padding = 5 * seed  # rows past the step's own: the graph's padding, run as base rows
        query_lens, slots = _step(rows - padding, 100 + seed)
        batch.set(query_lens + [padding], slots + [-1])
        row_slots = [s for n, s in zip(query_lens, slots) for _ in range(n)]
        x.copy_(torch.randn(rows, in_features, generator=gen).to(CUDA, torch.bfloat16))
        y_in.copy_(torch.randn(rows, width, generator=gen).to(CUDA, torch.bfloat16))
        graph.replay()
        _close(out, _dense(x, y_in, layer, row_slots))


@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("proj", sorted(LLAMA_8B))
def test_a_lone_rows_shrink_in_the_matrix_vector_kernel_equals_the_dense_reference(proj, rank):
    """The engine's one-row path, in a CUDA graph replayed under other slots (and the base): q/k/v
    and gate/up with the norm folded in (`gemv_rmsnorm`), o and down plain (`gemv`), each with its
    extra programs shrinking the row, then the expand (gate/up's with the activation)."""
    from pagoda_engine.worker.model import gemv_triton
    from pagoda_engine.worker.model.layers import SiluAndMul

    gen = torch.Generator().manual_seed(rank)
    in_features, sizes = LLAMA_8B[proj]
    layer, batch, width = _layer(in_features, sizes, rank, gen)
    w = (torch.randn(width, in_features, generator=gen) * in_features ** -0.5).to(CUDA, torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(in_features, generator=gen)).to(CUDA, torch.bfloat16)
    x = torch.zeros(1, in_features, device=CUDA, dtype=torch.bfloat16)
    res = torch.zeros_like(x)
    folded, gated = proj in ("qkv", "gate_up"), proj == "gate_up"

    def run():
        if folded:
            y, _, shrunk = gemv_triton.gemv_rmsnorm(x, res, norm_w, 1e-5, w, lora=layer.one_row(x))
        else:
            y, shrunk = gemv_triton.gemv(x, w, lora=layer.one_row(x))
        return layer.expand_act(shrunk, y, SiluAndMul()) if gated else layer.expand(shrunk, y)

    batch.set([1], [0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for slot in (0, 3, -1, 2):
        batch.set([1], [slot])
        x.copy_(torch.randn(1, in_features, generator=gen).to(CUDA, torch.bfloat16))
        res.copy_(torch.randn(1, in_features, generator=gen).to(CUDA, torch.bfloat16))
        graph.replay()
        h = x.float() + res.float() if folded else x.float()
        if folded:
            h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()).bfloat16()
        expected = _dense(h.to(torch.bfloat16), h.float() @ w.float().t(), layer, [slot])
        if gated:
            gate, up = expected.chunk(2, dim=-1)
            expected = torch.nn.functional.silu(gate) * up
        _close(out, expected)


def _adapters(gpu_model_dir, tmp_path):
    from lora_adapters import ADAPTERS, write_adapter
    from pagoda_engine import LoRARequest

    paths = {name: write_adapter(gpu_model_dir, tmp_path / name, *spec, seed=i + 1, std=0.05)
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    return paths, {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}


def _check_against_peft(gpu_model_dir, paths, names, prompts, outs) -> None:
    """At every generated position of `outs` (per name in `names`, per prompt), transformers + PEFT
    (float32) ranks our token first, within bf16 rounding of a tie; and each adapter changes some
    prompt's tokens (a dropped adapter would pass as the base)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(gpu_model_dir, dtype=torch.float32).to(CUDA).eval()
    for i, name in enumerate(names):
        mine = outs[i * len(prompts):(i + 1) * len(prompts)]
        if name is not None:
            assert mine != outs[:len(prompts)], f"adapter {name} wrote the base model's tokens"
        model = base if name is None else peft.PeftModel.from_pretrained(base, paths[name]).to(CUDA).eval()
        for prompt, out in zip(prompts, mine):
            ref = hf_logits(model, prompt + out)[len(prompt) - 1:-1]
            top2 = ref.topk(2, dim=-1).values
            scale = ref.abs().max().item()
            for pos, tok in enumerate(out):
                gap = (top2[pos, 0] - ref[pos, tok]).item() / scale
                tie = (top2[pos, 0] - top2[pos, 1]).item() / scale
                assert gap < 0.01 and (tok == int(ref[pos].argmax()) or tie < 0.005), (name, pos, tok, gap, tie)
        if name is not None:
            base = model.unload()  # the base model again, without this adapter's layers


def test_engine_with_graphs_serves_each_adapter_as_peft_does(gpu_model_dir, tmp_path):
    """bf16 engine, CUDA graphs on, three adapters and the base in one batch (two device slots):
    at every generated position transformers + PEFT (float32) ranks our token first (within
    bf16 rounding of a tie), and the eager engine writes the same tokens."""
    from pagoda_engine import SamplingParams

    paths, loras = _adapters(gpu_model_dir, tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (3, 17, 40, 9)]
    names = [None, *loras]
    batch = [p for _ in names for p in prompts]
    per_prompt = [loras.get(n) for n in names for _ in prompts]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(**kwargs) -> list[list[int]]:
        llm = make_llm(gpu_model_dir, enable_lora=True, max_loras=2, max_lora_rank=16, **kwargs)
        try:
            assert llm.core.cuda_graphs == (not kwargs.get("enforce_eager", False))
            return [o.outputs[0].token_ids for o in llm.generate(batch, params, lora_request=per_prompt)]
        finally:
            llm.close()

    graphs, eager = run(), run(enforce_eager=True)
    assert graphs == eager
    _check_against_peft(gpu_model_dir, paths, names, prompts, graphs)


def test_a_lone_request_decodes_each_adapter_as_peft_does(gpu_model_dir, tmp_path):
    """One request at a time, graphs on: every decode step is one row, where the input norm and
    q/k/v, and the post-attention norm and gate/up, are one kernel each (`gemv_rmsnorm`) and the
    adapters read the normalised row it writes; gate/up's adapter part must join before the
    activation. Each adapter's tokens are PEFT's."""
    from pagoda_engine import SamplingParams

    paths, loras = _adapters(gpu_model_dir, tmp_path)
    prompts = random_prompts(1, [5, 31])
    names = [None, *loras]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = make_llm(gpu_model_dir, enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        assert llm.core.cuda_graphs
        outs = [llm.generate([p], params, lora_request=loras.get(n))[0].outputs[0].token_ids
                for n in names for p in prompts]
    finally:
        llm.close()
    _check_against_peft(gpu_model_dir, paths, names, prompts, outs)


def test_the_kernel_bench_times_every_projection(capsys):
    """`python -m pagoda_engine.bench.lora_kernels` on a few weight copies: a row of timings per
    projection and row count, the decode rows' shrinks split over K."""
    from pagoda_engine.bench import lora_kernels

    lora_kernels.main(["--layers", "2", "--rows", "1,16", "--slots", "4"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in lora_kernels.SHAPES]
    assert [(r[0], r[1]) for r in rows] == [(name, n) for name in lora_kernels.SHAPES for n in ("1", "16")]
    for name, _, splits, *us in rows:
        assert int(splits) > 1, name
        assert all(float(u) > 0 for u in us[:4]), (name, us)


@pytest.mark.parametrize("rows", [1, 6, 64])
def test_a_chain_of_lora_projections_gives_the_same_bits_with_and_without_pdl(monkeypatch, rows):
    """Projections with adapters, each reading the row(s) the one before wrote, in a CUDA graph:
    under programmatic dependent launch (the LoRA kernels read their block table and first A or B
    tile before the wait) the same bits as without it. One row: the folded norm's and the plain
    matrix-vector kernel's LoRA programs and the expand; more: the split-K shrink and the expand."""
    from pagoda_engine.worker import pdl
    from pagoda_engine.worker.model import gemv_triton
    from pagoda_engine.worker.model.layers import linear
    from pagoda_engine.worker.model.lora_triton import add_lora

    k = 2048
    gen = torch.Generator().manual_seed(rows)
    layers = [_layer(k, [k], 16, gen)[0] for _ in range(8)]
    batch = layers[0].batch
    for layer in layers[1:]:  # one block table for the chain, as a model's layers share one
        layer.batch = batch
    weights = [(torch.randn(k, k, generator=gen) * k ** -0.5).to(CUDA, torch.bfloat16) for _ in layers]
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(CUDA, torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(CUDA, torch.bfloat16)
    res = torch.randn(rows, k, generator=gen).to(CUDA, torch.bfloat16)
    batch.set([1] * rows, [-1 if i % 5 == 4 else i % NUM_SLOTS for i in range(rows)])  # some base rows

    def chain():
        h, r = x, res
        for i, (layer, w) in enumerate(zip(layers, weights)):
            if rows == 1 and i % 2 == 0:
                y, r, shrunk = gemv_triton.gemv_rmsnorm(h, r, norm_w, 1e-5, w, lora=layer.one_row(h))
                h = layer.expand(shrunk, y)
            elif rows == 1:
                y, shrunk = gemv_triton.gemv(h, w, lora=layer.one_row(h))
                h = layer.expand(shrunk, y)
            else:
                h = add_lora(h, linear(h, w), layer, batch)
            h = h / h.float().square().mean().sqrt().to(h.dtype)  # each layer's row at unit scale
        return h, r

    def replayed():
        chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        return [t.clone() for t in out]

    results = []
    for on in (False, True):
        monkeypatch.setenv("PAGODA_PDL", "1" if on else "0")
        pdl._keywords.cache_clear()
        results.append(replayed())
    pdl._keywords.cache_clear()
    assert all(t.isfinite().all() for t in results[1])
    for got, expected in zip(results[1], results[0]):
        assert torch.equal(got, expected)

"""FP8 (e4m3) weights on CPU: the numbers (round trips within e4m3's error, the matmul's scaling),
`--quantization fp8` on float weights against transformers running the same quantized numbers,
a compressed-tensors FP8 checkpoint written by the compressed-tensors library giving the logits
of `--quantization fp8` on the weights it came from, vLLM's `quant_method: fp8` form with
per-tensor scales, tensor parallelism (TP=2 over gloo gives TP=1's tokens), dummy weights, and
every form not served refused at start-up, named."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.tiny import build_tiny_model
from pagoda_engine.worker.model.fp8_math import (FP8_DTYPE, FP8_MAX, dequantize_groups, fp8_linear, quantize_groups,
                                                 quantize_rows, quantize_tokens)
from pagoda_engine.worker.model.layers import RowParallelLinear
from pagoda_engine.worker.model.loader import load_hf_config, load_model
from random_weights import randomise
import test_model_vs_hf
from test_model_vs_hf import PagedRunner

CPU = torch.device("cpu")
VOCAB = 256
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
PROMPT = [(7 * i + 3) % VOCAB for i in range(19)]
# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; below the
# smallest normal (2^-6) values sit on a grid of 2^-9, so they move by at most half a step.
E4M3_REL, E4M3_SUBNORMAL_ABS = 2.0 ** -4, 2.0 ** -10
# A static activation scale that covers the tiny model's projection inputs (|x| up to 32).
STATIC_INPUT_SCALE = 32.0 / 448.0


def _load(model_dir, **kwargs) -> torch.nn.Module:
    return load_model(str(model_dir), load_hf_config(str(model_dir)), torch.float32, CPU, **kwargs)


def _logits(model, tokens=PROMPT) -> torch.Tensor:
    return PagedRunner(model, page_size=4).step([("r", tokens)])[0]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama's float32 checkpoint (random weights, clear greedy choices)."""
    torch.manual_seed(11)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    randomise(hf, std=0.15, norm_spread=0.3)
    model_dir = tmp_path_factory.mktemp("fp8-source")
    hf.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def quantized_on_load(hf_dir):
    return _load(hf_dir, quantization="fp8")


# --- the numbers --------------------------------------------------------------------------------


def test_weight_round_trip_is_within_e4m3_error_and_each_row_reaches_the_largest_value():
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.logspace(-3, 1, 48).unsqueeze(1)  # rows of very different scales
    values, scale = quantize_rows(w)
    assert values.dtype == FP8_DTYPE and scale.shape == (48,) and scale.dtype == torch.float32
    restored = values.float() * scale.unsqueeze(1)
    bound = E4M3_REL * w.abs() + E4M3_SUBNORMAL_ABS * scale.unsqueeze(1)
    assert ((restored - w).abs() <= bound).all()
    assert torch.equal(values.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))


def test_token_scales_are_per_row_or_the_one_static_scale():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -4.0]])
    values, scale = quantize_tokens(x)
    assert torch.allclose(scale.squeeze(1), torch.tensor([2.0, 0.0, 300.0]) / FP8_MAX)
    assert torch.equal(values[1].float(), torch.zeros(3))  # an all-zero row stays zero, no NaN
    static = torch.tensor([0.5])
    values, scale = quantize_tokens(x, static)
    assert torch.equal(scale, torch.full((3, 1), 0.5))
    assert values[2, 0].float() == FP8_MAX  # beyond the static range: clamped, not inf


def test_group_scales_are_each_groups_largest_magnitude_the_last_group_short():
    """The FP8 MoE experts' activation scales (`quantize_groups`): one per row and group of
    columns; values round-trip within e4m3's half step (2^-4 relative) of the group's scale."""
    x = torch.tensor([[1.0, -2.0, 0.5, 8.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    values, scale = quantize_groups(x, 2)
    assert values.shape == x.shape and values.dtype == FP8_DTYPE and scale.shape == (2, 3)
    assert torch.allclose(scale[0], torch.tensor([2.0, 8.0, 0.0]).clamp(min=1e-12) / FP8_MAX)
    assert torch.equal(values[1].float(), torch.zeros(5))  # an all-zero group stays zero, no NaN
    torch.manual_seed(3)
    x = torch.randn(6, 200) * torch.logspace(-3, 3, 200)
    back = dequantize_groups(*quantize_groups(x, 64), 64)
    group_amax = x.abs().reshape(6, -1)[:, :192].reshape(6, 3, 64).amax(-1)
    assert back.shape == x.shape
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + 1e-9).all()
    # Each group's largest magnitude lands on 448 exactly.
    assert torch.allclose(back.abs().reshape(6, -1)[:, :192].reshape(6, 3, 64).amax(-1), group_amax)


def test_fp8_linear_is_the_quantized_product_scaled_back():
    torch.manual_seed(1)
    x, w, bias = torch.randn(2, 5, 32), torch.randn(24, 32) * 0.1, torch.randn(24)
    wq, ws = quantize_rows(w)
    y = fp8_linear(x, wq, ws, bias)
    assert y.shape == (2, 5, 24) and y.dtype == x.dtype
    xq, xs = quantize_tokens(x.reshape(10, 32))
    expected = (xq.float() * xs) @ (wq.float() * ws.unsqueeze(1)).t() + bias
    torch.testing.assert_close(y.reshape(10, 24), expected, rtol=1e-5, atol=1e-5)
    # And near the float product: e4m3 on both sides.
    assert (y - (x @ w.t() + bias)).abs().max() < 0.1 * (x @ w.t()).abs().max()


# --- --quantization fp8 on float weights --------------------------------------------------------


def _rounded(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to e4m3 row by row (last dimension), each row's largest magnitude at 448: written
    here from the format's definition (torch's float8 cast), not with Pagoda's helpers."""
    scale = t.abs().amax(dim=-1, keepdim=True) / 448.0
    return (t / scale).to(torch.float8_e4m3fn).float() * scale


def _hf_running_fp8(model_dir, model_cls=transformers.LlamaForCausalLM):
    """transformers' model with each projection's weight rounded to e4m3 per output row and its
    input rounded per token, and MoE experts' stacked weights rounded per row (their inputs as
    they are): the reference the quantized model must match. The router and LM head stay."""
    hf = model_cls.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and not name.endswith("mlp.gate"):
            module.weight.data = _rounded(module.weight.data)
            module.forward = lambda x, m=module: torch.nn.functional.linear(_rounded(x), m.weight, m.bias)
        if name.endswith("mlp.experts"):
            for p in module.parameters():
                p.data = _rounded(p.data)
    return hf


def test_quantize_on_load_matches_transformers_running_the_same_fp8_numbers(hf_dir, quantized_on_load):
    params = dict(quantized_on_load.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8_DTYPE
    assert params["model.layers.1.mlp.down_proj.weight_scale"].shape == (CONFIG["hidden_size"],)
    assert quantized_on_load.lm_head.weight.dtype == torch.float32  # the LM head stays in --dtype
    reference = _hf_running_fp8(hf_dir)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_logits(quantized_on_load), expected, atol=2e-4, rtol=2e-4)


def test_fp8_logits_stay_near_the_float_model(hf_dir, quantized_on_load):
    full = _logits(_load(hf_dir))
    fp8 = _logits(quantized_on_load)
    assert (fp8.argmax(-1) == full.argmax(-1)).float().mean() >= 0.9
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), full.log_softmax(-1), log_target=True, reduction="batchmean")
    assert kl < 0.05


def test_a_gguf_file_is_dequantized_then_quantized_to_fp8_as_it_loads(hf_dir, tmp_path, quantized_on_load):
    """GGUF with --quantization fp8: the file's weights, dequantized to --dtype as always, are
    quantized like any float checkpoint's (an F32 file: the same values, so the same model)."""
    from gguf_files import write_gguf

    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    path = write_gguf(hf, tmp_path / "model.gguf")
    served = _load(path, quantization="fp8")
    assert served.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    torch.testing.assert_close(_logits(served), _logits(quantized_on_load), atol=0, rtol=0)


# --- FP8 checkpoints as they are -------------------------------------------------------------------


@pytest.fixture(scope="module")
def compressed_tensors_dir(hf_dir, tmp_path_factory):
    """llm-compressor's FP8_DYNAMIC form, written by the compressed-tensors library: per-channel
    e4m3 weights, dynamic per-token activations, lm_head ignored. The scales are each row's
    largest magnitude over 448 (llm-compressor's min-max observer); the library quantizes."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in hf.modules():
            if hasattr(module, "weight_scale"):
                module.weight_scale.copy_(module.weight.abs().amax(dim=1, keepdim=True) / 448.0)
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format="float-quantized")
    compressor.compress_model(hf)
    out = tmp_path_factory.mktemp("fp8-compressed-tensors")
    hf.config.save_pretrained(out)
    compressor.update_config(str(out))
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if not k.endswith("zero_point")}
    save_file(state, out / "model.safetensors")
    assert ct.__version__
    return out


def test_compressed_tensors_checkpoint_gives_the_logits_of_quantizing_its_source(compressed_tensors_dir,
                                                                                  quantized_on_load):
    config = json.loads((compressed_tensors_dir / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", "float-quantized")
    served = _load(compressed_tensors_dir)  # no --quantization: the checkpoint says FP8
    assert torch.equal(served.model.layers[0].self_attn.qkv_proj.weight.view(torch.uint8),
                       quantized_on_load.model.layers[0].self_attn.qkv_proj.weight.view(torch.uint8))
    torch.testing.assert_close(_logits(served), _logits(quantized_on_load), atol=0, rtol=0)


# The checkpoint tensors FP8 checkpoints quantize: dense projections and per-expert weights (not
# the MoE router, the embedding, the norms or the LM head).
_QUANTIZED = re.compile(r".*(_proj|\.experts\.\d+\.w[123])\.weight$")


def _vllm_fp8_checkpoint(source_dir, out, activation_scheme: str, extra: dict | None = None):
    """vLLM's `quant_method: fp8` form (AutoFP8's), from a float checkpoint's tensors: one weight
    scale per tensor, and with static activations one input scale per tensor and the attention's
    KV cache scales (which pages in the model's dtype do not use; tests/engine/test_fp8_kv.py
    serves FP8 pages with them)."""
    state = {}
    with safe_open(str(source_dir / "model.safetensors"), framework="pt") as source:
        for name in source.keys():
            tensor = source.get_tensor(name)
            if _QUANTIZED.match(name):
                module = name.removesuffix(".weight")
                scale = tensor.abs().amax() / 448.0
                state[name] = (tensor / scale).to(torch.float8_e4m3fn)
                state[f"{module}.weight_scale"] = scale.reshape(())
                if activation_scheme == "static":
                    state[f"{module}.input_scale"] = torch.tensor(STATIC_INPUT_SCALE)
                    if name.endswith("k_proj.weight"):
                        state[f"{module.removesuffix('.k_proj')}.k_scale"] = torch.tensor(1.0)
                        state[f"{module.removesuffix('.k_proj')}.v_scale"] = torch.tensor(1.0)
            else:
                state[name] = tensor
    out.mkdir()
    config = json.loads((source_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": activation_scheme, **(extra or {})}
    (out / "config.json").write_text(json.dumps(config))
    save_file(state, out / "model.safetensors")
    return out


@pytest.mark.parametrize("activation_scheme", ["dynamic", "static"])
def test_vllm_fp8_checkpoint_with_per_tensor_scales_keeps_each_piece_scale(hf_dir, tmp_path, activation_scheme):
    model_dir = _vllm_fp8_checkpoint(hf_dir, tmp_path / "m", activation_scheme)
    served = _load(model_dir)
    qkv = served.model.layers[0].self_attn.qkv_proj
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    attn = hf.model.layers[0].self_attn
    pieces = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    expected = torch.cat([torch.full((p.shape[0],), float(p.detach().abs().amax() / 448.0)) for p in pieces])
    assert torch.equal(qkv.weight_scale, expected)
    if activation_scheme == "static":
        assert torch.equal(qkv.input_scale, torch.tensor([STATIC_INPUT_SCALE]))
    full = _logits(_load(hf_dir))
    assert (_logits(served).argmax(-1) == full.argmax(-1)).float().mean() >= 0.8


def _with_quantization_config(hf_dir, out, quantization_config: dict):
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
     "'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "'pack-quantized'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, "block-wise"),
])
def test_unsupported_checkpoint_quantization_is_refused_naming_it_and_what_is(hf_dir, tmp_path, quantization_config,
                                                                              named):
    model_dir = _with_quantization_config(hf_dir, tmp_path / "m", quantization_config)
    with pytest.raises(ModelLoadError) as refused:
        _load(model_dir, load_format="dummy")
    assert named in str(refused.value) and "compressed-tensors" in str(refused.value)


def test_an_unserved_quantization_is_refused_by_the_config():
    with pytest.raises(ValueError, match=re.escape("--quantization awq is not supported (supported: fp8")):
        EngineConfig.from_kwargs(quantization="awq")


def test_pagoda_serve_exits_2_naming_an_unserved_quantization():
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", "pagoda-tiny",
                          "--quantization", "gptq"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--quantization gptq is not supported (supported: fp8" in out.stderr, out.stderr


MOE_CASES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_fp8_experts_match_transformers_with_their_weights_rounded(tmp_path, case):
    """MoE experts in FP8: e4m3 weights with a float32 scale per expert and row, activations in the
    serving dtype (the router stays in it too); the dense projections as everywhere else."""
    config_cls, model_cls, overrides = MOE_CASES[case]
    torch.manual_seed(13)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**CONFIG, **overrides}))
    randomise(hf, std=0.15, norm_spread=0.3)
    hf.save_pretrained(tmp_path)
    served = _load(tmp_path, quantization="fp8")
    experts = served.model.layers[0].mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == FP8_DTYPE
    assert experts.w13_scale.shape == experts.w13.shape[:2] and experts.w2_scale.shape == experts.w2.shape[:2]

    reference = _hf_running_fp8(tmp_path, getattr(transformers, model_cls))
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(_logits(served), expected, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-columns", "ep-whole-experts"])
def test_each_rank_holds_its_slice_of_the_one_rank_fp8_experts_and_scales(tmp_path, expert_parallel):
    """Tensor parallelism slices each expert's intermediate rows (w13's gate and up rows with their
    scales, w2's columns under whole row scales); expert parallelism gives each rank whole experts."""
    config_cls, model_cls, overrides = MOE_CASES["qwen3_moe"]
    torch.manual_seed(17)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**CONFIG, **overrides}))
    randomise(hf, std=0.15)
    hf.save_pretrained(tmp_path)
    whole = _load(tmp_path, quantization="fp8").model.layers[1].mlp.experts
    inter = whole.w2.shape[2]
    for rank in (0, 1):
        part = _load(tmp_path, quantization="fp8", tp_size=2, tp_rank=rank,
                     enable_expert_parallel=expert_parallel).model.layers[1].mlp.experts
        if expert_parallel:
            held = slice(rank * part.num_local, (rank + 1) * part.num_local)
            expected = (whole.w13[held], whole.w13_scale[held], whole.w2[held], whole.w2_scale[held])
        else:
            half = inter // 2
            rows = torch.cat([torch.arange(rank * half, (rank + 1) * half),
                              inter + torch.arange(rank * half, (rank + 1) * half)])
            expected = (whole.w13[:, rows], whole.w13_scale[:, rows], whole.w2[:, :, rank * half:(rank + 1) * half],
                        whole.w2_scale)
        for got, want in zip((part.w13, part.w13_scale, part.w2, part.w2_scale), expected):
            assert torch.equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                               want.view(torch.uint8) if want.dtype == FP8_DTYPE else want)


def test_vllm_fp8_mixtral_checkpoint_keeps_each_experts_per_tensor_scales(tmp_path):
    config_cls, model_cls, overrides = MOE_CASES["mixtral"]
    torch.manual_seed(19)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**CONFIG, **overrides}))
    randomise(hf, std=0.15, norm_spread=0.3)
    hf.save_pretrained(tmp_path / "source")
    served = _load(_vllm_fp8_checkpoint(tmp_path / "source", tmp_path / "fp8", "dynamic"))
    experts = served.model.layers[0].mlp.experts
    inter = experts.w2.shape[2]
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), framework="pt") as f:
        for e in range(experts.num_local):
            prefix = f"model.layers.0.block_sparse_moe.experts.{e}"
            gate, up, down = (float(f.get_tensor(f"{prefix}.{w}.weight_scale")) for w in ("w1", "w3", "w2"))
            assert torch.equal(experts.w13_scale[e], torch.tensor([gate] * inter + [up] * inter))
            assert torch.equal(experts.w2_scale[e], torch.full((CONFIG["hidden_size"],), down))
            assert torch.equal(experts.w2[e].view(torch.uint8), f.get_tensor(f"{prefix}.w2.weight").view(torch.uint8))
    full = _logits(_load(tmp_path / "source"))
    assert (_logits(served).argmax(-1) == full.argmax(-1)).float().mean() >= 0.8


def test_an_fp8_tensor_for_a_float_parameter_is_refused(hf_dir, tmp_path):
    """A checkpoint whose config ignores a projection but stores it in FP8 would lose its scale."""
    model_dir = _vllm_fp8_checkpoint(hf_dir, tmp_path / "m", "dynamic",
                                     extra={"ignored_layers": ["model.layers.0.self_attn.o_proj"]})
    with pytest.raises(ModelLoadError, match="o_proj"):
        _load(model_dir)


def test_dummy_fp8_weights_are_deterministic(hf_dir):
    a, b = (_load(hf_dir, load_format="dummy", seed=5, quantization="fp8") for _ in range(2))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.float(), q.float()), name
    scale = a.model.layers[0].mlp.gate_up_proj.weight_scale
    assert (scale > 0).all()
    assert torch.isfinite(_logits(a)).all()


def test_a_disk_tier_written_by_the_float_model_gives_the_fp8_model_no_page(tmp_path):
    """--quantization fp8 computes other K and V from the same files: the tiers' fingerprint
    tells them apart, so an FP8 engine over a disk tier the float engine filled finds nothing
    there and computes its own pages (the same tokens as without the tier)."""
    from pagoda_engine.tiny import default_model_dir

    model = str(default_model_dir())
    prompts = [[(5 * i + 7 * n) % 500 + 5 for i in range(64)] for n in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6)
    small = dict(num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=4)
    disk = dict(kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_gb=0.05)
    with LLM(model, **disk, **small) as llm:
        llm.generate(prompts, params)
        assert len(llm.core.kv.offload.disk) > 0
    with LLM(model, quantization="fp8", **small) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM(model, quantization="fp8", **disk, **small) as llm:
        assert len(llm.core.kv.offload.disk) == 0
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


# --- tensor parallelism -------------------------------------------------------------------------


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(PagedRunner(model, page_size=4).step([("r", tokens)])[0][-1].argmax()))
    return tokens[len(prompt):]


def test_tensor_parallel_fp8_gives_the_tokens_of_one_rank_quantizing_its_half(tmp_path, monkeypatch):
    """Each rank quantizes whole checkpoint tensors, then slices: TP=2 holds TP=1's values, row
    scales sliced with the rows of column-parallel layers, whole for row-parallel ones. A
    row-parallel layer's input is quantized per token over each rank's half of its features (as
    vLLM does), so TP=2's tokens are those of one process whose row-parallel projections quantize
    each half of their input on its own, and where greedy choices are not near-ties, TP=1's."""
    tiny = build_tiny_model(tmp_path / "tiny", seed=3)  # its tokenizer; 4 query heads over 2 KV heads
    config = transformers.AutoConfig.from_pretrained(tiny)
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    randomise(hf, std=0.15, norm_spread=0.3)
    model_dir = tmp_path / "model"
    hf.save_pretrained(model_dir)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation")):
            (model_dir / f.name).write_bytes(f.read_bytes())
    steps = 8
    params = SamplingParams(temperature=0, max_tokens=steps, min_tokens=steps)
    outputs = []
    for tp in (1, 2):
        llm = LLM(str(model_dir), quantization="fp8", tensor_parallel_size=tp, num_kv_pages=64)
        try:
            outputs.append(llm.generate([PROMPT], params)[0].outputs[0].token_ids)
        finally:
            llm.close()

    monkeypatch.setattr(test_model_vs_hf, "VOCAB", config.vocab_size)
    one_process = _load(model_dir, quantization="fp8")
    assert _greedy(one_process, PROMPT, steps) == outputs[0]
    for layer in one_process.modules():
        if isinstance(layer, RowParallelLinear):
            def halves(x, bias, layer=layer):
                k = x.shape[-1] // 2
                return (fp8_linear(x[:, :k], layer.weight[:, :k], layer.weight_scale, bias)
                        + fp8_linear(x[:, k:], layer.weight[:, k:], layer.weight_scale))
            layer.matmul = halves
    assert _greedy(one_process, PROMPT, steps) == outputs[1]
    assert outputs[0][:4] == outputs[1][:4]  # the first choices are clear ones

"""FP8 (e4m3) linear layers: which scheme a model is served in, and the layers that hold it.

Owns: reading a checkpoint's `quantization_config` (`fp8_scheme`: compressed-tensors'
`float-quantized` form and vLLM's `quant_method: fp8` form; every other form refused, named),
and turning a built model's dense projections into FP8 layers before its weights load
(`quantize_linear_layers`), with weight loaders that quantize float weights or take FP8 ones as
they are. The numbers themselves are `fp8_math`'s.

A weight row r holds e4m3 values q[r, :] and a float32 scale s[r] (w ≈ q × s). A checkpoint's
per-tensor scale is repeated over its rows, so merged q/k/v and gate/up projections keep each
piece's own scale. Activations are quantized per token at run time, or with the checkpoint's one
static scale per projection.

Tensor parallelism: a float checkpoint tensor is quantized whole, before the layer's loader takes
this rank's slice, so every rank holds exactly the values TP=1 holds; scales are sliced with their
rows (column-parallel layers) or kept whole (row-parallel layers split the input features only).

An FP8 KV cache's scales (`load_kv_cache_scale`): a checkpoint that carries them (compressed-tensors'
`kv_cache_scheme`, vLLM's and AutoFP8's `self_attn.k_scale` / `v_scale`, the older single
`kv_scale`) gives each attention layer its K and V scale, one float each (the same on every
tensor-parallel rank); without them they are 1.0. Pages in the model's dtype ignore them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagoda_engine.errors import ModelLoadError
from pagoda_engine.worker.model.fp8_math import FP8_DTYPE, quantize_rows
from pagoda_engine.worker.model.layers import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _set_weight_loader,
    default_weight_loader,
)
from pagoda_engine.worker.model.moe import StackedExperts

# Scales an FP8 checkpoint may carry for attention (AutoFP8, llm-compressor): K and V scales for an
# FP8 KV cache (`load_kv_cache_scale`), and the query's and softmax's for FP8 attention arithmetic,
# which Pagoda does not do (its attention computes in the model's dtype), so they are passed over.
KV_CACHE_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale")
_KV_SCALE_ATTRIBUTES = {"k_scale": ("k_scale",), "v_scale": ("v_scale",), "kv_scale": ("k_scale", "v_scale")}
# What --quantization takes, and the checkpoint forms that load as they are.
QUANTIZATION_METHODS = ("fp8",)
CHECKPOINT_FORMS = ("compressed-tensors (format float-quantized: FP8 e4m3 weights, per-tensor or per-channel "
                    "scales, static per-tensor or dynamic per-token activations)",
                    "fp8 (vLLM's form, per-tensor scales, static or dynamic activations)")


@dataclass(frozen=True)
class Fp8Scheme:
    """How a model's dense projections are served in FP8.

    `serialized`: the checkpoint holds FP8 weights and their scales (else bf16/fp16/fp32 weights
    are quantized as they load). `static_input_scale`: activations use the checkpoint's
    `input_scale` (one per projection; merged pieces take the largest) instead of per-token
    scales. `ignore`: the checkpoint's modules left unquantized (compressed-tensors' names, or
    `re:` patterns)."""

    serialized: bool = False
    static_input_scale: bool = False
    ignore: tuple[str, ...] = ()

    def ignores(self, checkpoint_module: str) -> bool:
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], checkpoint_module):
                    return True
            elif checkpoint_module == entry or checkpoint_module.endswith("." + entry):
                return True
        return False


def _unsupported(what: str) -> ModelLoadError:
    return ModelLoadError(f"{what} is not supported; checkpoints that load as they are: {'; '.join(CHECKPOINT_FORMS)}"
                          f"; --quantization takes {', '.join(QUANTIZATION_METHODS)} (FP8 from bf16 weights)")


def _compressed_tensors_scheme(qc: dict) -> Fp8Scheme:
    """compressed-tensors' published config (llm-compressor's FP8 and FP8_DYNAMIC presets)."""
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise _unsupported(f"a compressed-tensors checkpoint of format {fmt!r}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _unsupported(f"a compressed-tensors checkpoint with {len(groups)} config groups (one is)")
    group = next(iter(groups.values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or not weights.get("symmetric", True) \
            or weights.get("dynamic"):
        raise _unsupported(f"compressed-tensors weights {weights!r}")
    if weights.get("strategy") not in ("tensor", "channel"):
        raise _unsupported(f"compressed-tensors weight strategy {weights.get('strategy')!r} (tensor, channel are)")
    if inputs is None:
        raise _unsupported("a compressed-tensors FP8 checkpoint with weight-only quantization")
    if (inputs.get("type"), inputs.get("num_bits")) != ("float", 8) or not inputs.get("symmetric", True):
        raise _unsupported(f"compressed-tensors input activations {inputs!r}")
    dynamic = bool(inputs.get("dynamic"))
    if (dynamic and inputs.get("strategy") != "token") or (not dynamic and inputs.get("strategy") != "tensor"):
        raise _unsupported(f"compressed-tensors input activations of strategy {inputs.get('strategy')!r} "
                           f"(dynamic: token, static: tensor are)")
    if group.get("output_activations"):
        raise _unsupported("compressed-tensors output activation quantization")
    kv = qc.get("kv_cache_scheme")
    if kv and ((kv.get("type"), kv.get("num_bits"), kv.get("strategy")) != ("float", 8, "tensor")
               or kv.get("dynamic") or not kv.get("symmetric", True)):
        raise _unsupported(f"a compressed-tensors kv_cache_scheme {kv!r} (static per-tensor FP8 scales are)")
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _unsupported(f"compressed-tensors targets {targets!r} (['Linear'] is)")
    return Fp8Scheme(serialized=True, static_input_scale=not dynamic, ignore=tuple(qc.get("ignore") or ()))


def _vllm_fp8_scheme(qc: dict) -> Fp8Scheme:
    """vLLM's `Fp8Config` form (AutoFP8, and vLLM's own exports)."""
    if qc.get("weight_block_size"):
        raise _unsupported(f"an fp8 checkpoint with block-wise weight scales (weight_block_size "
                           f"{qc['weight_block_size']})")
    activation_scheme = qc.get("activation_scheme", "dynamic")
    if activation_scheme not in ("dynamic", "static"):
        raise _unsupported(f"fp8 activation_scheme {activation_scheme!r}")
    return Fp8Scheme(serialized=qc.get("is_checkpoint_fp8_serialized", True),
                     static_input_scale=activation_scheme == "static",
                     ignore=tuple(qc.get("ignored_layers") or ()))


def fp8_scheme(quantization: str | None, hf_config: Any) -> Fp8Scheme | None:
    """The scheme a model is served in: from its checkpoint's `quantization_config` when it has
    one (loaded as it is, whether or not --quantization fp8 was given), from `quantization` for an
    unquantized checkpoint, None for plain serving. A quantization form not served here is
    refused, named, with what is."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise _unsupported(f"--quantization {quantization!r}")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if not qc:
        return Fp8Scheme() if quantization == "fp8" else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "fp8":
        return _vllm_fp8_scheme(qc)
    raise _unsupported(f"a checkpoint quantized with quant_method {method!r}")


# --- the layers -------------------------------------------------------------------------------


def _piece_rows(layer: LinearBase, shard_id) -> int:
    """Rows of one checkpoint piece of `layer`'s weight, unsharded."""
    if isinstance(layer, QKVParallelLinear):
        heads = layer.num_heads * layer.tp_size if shard_id == "q" else layer.total_num_kv_heads
        return heads * layer.head_dim
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard_id] * layer.tp_size
    if isinstance(layer, ColumnParallelLinear):
        return layer.out_features * layer.tp_size
    return layer.out_features


class _Fp8Loaders:
    """The weight loaders of one FP8 layer, around the layer's own (which slice this rank's rows
    or columns): a float weight is quantized whole, then its values and row scales go through
    them; an FP8 weight and its `weight_scale` (per tensor or per row) go through them as they are."""

    def __init__(self, layer: LinearBase, loader):
        self.layer, self.loader = layer, loader
        # Scales follow the rows: sliced as the weight is by a column-parallel layer, whole otherwise.
        self.scale_loader = loader if isinstance(layer, ColumnParallelLinear) else default_weight_loader

    def weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dtype == FP8_DTYPE:
            self.loader(param, loaded, shard_id)
            return
        if loaded.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ModelLoadError(f"weight of dtype {loaded.dtype} cannot be quantized to FP8")
        values, scale = quantize_rows(loaded)
        self.loader(param, values, shard_id)
        self.scale_loader(self.layer.weight_scale, scale, shard_id)
        self.layer.weight_scale.filled_shards.add(shard_id)

    def weight_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        self.scale_loader(param, _rows_of(loaded, _piece_rows(self.layer, shard_id)).contiguous(), shard_id)

    @staticmethod
    def input_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != 1:
            raise ModelLoadError(f"input_scale of shape {tuple(loaded.shape)}: one static scale per tensor is supported")
        # Merged pieces share one input: the largest of their scales covers each one's range.
        param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1).to(param.device)))


def _checkpoint_modules(model: nn.Module, name: str) -> list[str]:
    """The checkpoint's module names of one of `model`'s (possibly merged) projections."""
    for merged, original, _piece in getattr(model, "stacked_params", ()):
        if name.endswith("." + merged):
            names = [name[: -len(merged)] + o for m, o, _ in model.stacked_params if m == merged]
            break
    else:
        names = [name]
    for original, ours in getattr(model, "renamed_modules", ()):
        names = [n.replace(f".{ours}.", f".{original}.") for n in names]
    return names


def _dense_projections(model: nn.Module) -> list[tuple[str, LinearBase]]:
    # Column- and row-parallel layers are the dense projections (attention, MLP, shared experts);
    # the MoE router and the shared expert's gate are plain LinearBase and stay in the serving
    # dtype, as the LM head and the embedding do.
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def quantize_linear_layers(model: nn.Module, scheme: Fp8Scheme) -> int:
    """Turn `model`'s dense projections and MoE experts into FP8 layers (before its weights
    load), but for the projections the scheme ignores; the number turned."""
    turned = 0
    for name, layer in _dense_projections(model):
        pieces = _checkpoint_modules(model, name)
        ignored = [scheme.ignores(p) for p in pieces]
        if all(ignored):
            continue
        if any(ignored):
            raise ModelLoadError(f"the checkpoint quantizes some of {', '.join(pieces)} but ignores others: "
                                 "their merged projection cannot be both")
        _make_fp8(layer, scheme)
        turned += 1
    for experts in (m for m in model.modules() if isinstance(m, StackedExperts)):
        if scheme.static_input_scale:
            raise ModelLoadError("static activation scales (input_scale) for MoE experts are not supported; "
                                 "FP8 experts run on FP8 weights with activations in the serving dtype")
        _make_fp8_experts(experts)
        turned += 1
    return turned


def scale_name(weight_name: str) -> str:
    """The name of an FP8 weight's scales: `x.weight` → `x.weight_scale`, `experts.w13` → `experts.w13_scale`."""
    return weight_name + "_scale"


class _Fp8ExpertLoaders:
    """The loaders of FP8 experts, around the stacked experts' own: a float expert weight is
    quantized per row, then its values and scales go where that expert's rows go (this rank's
    experts; of w13 this rank's slice of the gate or up rows, of w2 every row, the columns being
    sliced); an FP8 one and its `weight_scale` go there as they are."""

    def __init__(self, experts: StackedExperts, load_w13, load_w2):
        self.experts, self.load_w13, self.load_w2 = experts, load_w13, load_w2

    def _held(self, expert: int) -> bool:
        e = self.experts
        return e.first <= expert < e.first + e.num_local

    def w13(self, param: nn.Parameter, loaded: torch.Tensor, piece) -> None:
        self._weight(param, loaded, piece, self.load_w13, self.w13_scale, self.experts.w13_scale)

    def w2(self, param: nn.Parameter, loaded: torch.Tensor, piece) -> None:
        self._weight(param, loaded, piece, self.load_w2, self.w2_scale, self.experts.w2_scale)

    def _weight(self, param, loaded, piece, load_values, load_scale, scale_param) -> None:
        if loaded.dtype == FP8_DTYPE:
            load_values(param, loaded, piece)
            return
        if not self._held(piece[0]):
            scale_param.filled_shards.add(piece)
            return  # another rank's expert: not quantized for nothing
        values, scale = quantize_rows(loaded)
        load_values(param, values, piece)
        load_scale(scale_param, scale, piece)
        scale_param.filled_shards.add(piece)

    def w13_scale(self, param: nn.Parameter, loaded: torch.Tensor, piece) -> None:
        expert, half = piece
        e = self.experts
        scale = _rows_of(loaded, e.shard * e.shards)
        if self._held(expert):
            param.data[expert - e.first].narrow(0, half * e.shard, e.shard).copy_(
                scale.narrow(0, e.shard_rank * e.shard, e.shard))

    def w2_scale(self, param: nn.Parameter, loaded: torch.Tensor, piece) -> None:
        expert = piece[0]
        e = self.experts
        scale = _rows_of(loaded, param.shape[1])
        if self._held(expert):
            param.data[expert - e.first].copy_(scale)


def _rows_of(loaded: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's `weight_scale` as one float32 scale per row: per tensor (repeated) or per row."""
    scale = loaded.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(rows)
    if scale.numel() != rows:
        raise ModelLoadError(f"weight_scale of shape {tuple(loaded.shape)} fits neither one scale nor "
                             f"one per row ({rows} rows)")
    return scale


def _make_fp8_experts(experts: StackedExperts) -> None:
    loaders = _Fp8ExpertLoaders(experts, experts.w13.weight_loader, experts.w2.weight_loader)
    for name, load in (("w13", loaders.w13), ("w2", loaders.w2)):
        old = getattr(experts, name)
        weight = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), requires_grad=False)
        _set_weight_loader(weight, load, old.shard_ids)
        setattr(experts, name, weight)
        scale = nn.Parameter(torch.empty(old.shape[:2], dtype=torch.float32, device=old.device), requires_grad=False)
        _set_weight_loader(scale, getattr(loaders, f"{name}_scale"), old.shard_ids)
        scale.filled_shards = set()
        setattr(experts, f"{name}_scale", scale)


def _make_fp8(layer: LinearBase, scheme: Fp8Scheme) -> None:
    old = layer.weight
    loaders = _Fp8Loaders(layer, old.weight_loader)
    layer.weight = nn.Parameter(torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), requires_grad=False)
    _set_weight_loader(layer.weight, loaders.weight, old.shard_ids)
    layer.weight_scale = nn.Parameter(torch.empty(old.shape[0], dtype=torch.float32, device=old.device),
                                      requires_grad=False)
    _set_weight_loader(layer.weight_scale, loaders.weight_scale, old.shard_ids)
    # Pieces quantized from float weights: their scales came with them (the loader counts them loaded).
    layer.weight_scale.filled_shards = set()
    if scheme.static_input_scale:
        layer.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=old.device), requires_grad=False)
        _set_weight_loader(layer.input_scale, loaders.input_scale, old.shard_ids)


def load_kv_cache_scale(model: nn.Module, name: str, read: Callable[[], torch.Tensor]) -> None:
    """Checkpoint tensor `name` (this stage's `...self_attn.<k_scale|v_scale|kv_scale|q_scale|
    prob_scale>`) into its attention layer's `k_scale` / `v_scale`; a query or softmax scale is
    passed over (see KV_CACHE_SCALE_SUFFIXES). Refused: a scale per head, a scale not above 0."""
    module_name, _, kind = name.rpartition(".")
    attributes = _KV_SCALE_ATTRIBUTES.get(kind)
    if attributes is None:
        return
    try:
        attention = model.get_submodule(module_name)
    except AttributeError:
        attention = None
    if attention is None or not hasattr(attention, "k_scale"):
        raise ModelLoadError(f"{name}: a KV cache scale for {module_name}, which is no attention layer of this model")
    value = read()
    if value.numel() != 1:
        raise ModelLoadError(f"{name}: KV cache scales of shape {tuple(value.shape)} (one per layer is supported)")
    scale = float(value.float().item())
    if not (math.isfinite(scale) and scale > 0):
        raise ModelLoadError(f"{name}: a KV cache scale of {scale} (must be a positive number)")
    for attribute in attributes:
        setattr(attention, attribute, scale)

"""The Llama-family decoder: Llama 2/3/3.1, Mistral, Qwen2 and Qwen3, and their mixture-of-experts
siblings Mixtral, Qwen2-MoE and Qwen3-MoE, in one implementation.

The architectures differ only in flags read from config.json (`DecoderFlags`): biases on the
q/k/v and output projections (Qwen2 has q/k/v bias only), per-head RMSNorm on q and k before
rotary (Qwen3), an explicit `head_dim`, tied embeddings, the rotary variant, and, in the MoE
models, which layers' MLP is a `FusedMoE` block (`MoESettings`).

Input is ragged: the new tokens of every request in a step, concatenated, with their absolute
positions; the attention backend knows which request each token belongs to (`attn.plan`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda_engine.errors import ModelLoadError
from pagoda_engine.worker.attention.base import AttentionBackend, KVCacheSpec
from pagoda_engine.worker.model.layers import (
    GatedMLP,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    norm_and_linear,
)
from pagoda_engine.worker.model.moe import FusedMoE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderFlags:
    """What sets one Llama-family architecture apart from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def decoder_flags(architecture: str, cfg: PretrainedConfig) -> DecoderFlags:
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    if architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"):
        return DecoderFlags(qkv_bias=True)
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
    # Llama and Mistral: `attention_bias` covers all four projections, `mlp_bias` the MLP.
    return DecoderFlags(qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)))


@dataclass(frozen=True)
class MoESettings:
    """The expert blocks of an MoE architecture, from config.json."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0
    sparse_step: int = 1  # every sparse_step-th layer is MoE (Qwen2/3-MoE's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers kept dense (Qwen2/3-MoE's mlp_only_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.sparse_step == 0


def moe_settings(architecture: str, cfg: PretrainedConfig) -> MoESettings | None:
    if architecture == "MixtralForCausalLM":
        # Mixtral always renormalises the top-k weights.
        return MoESettings(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, renormalize=True)
    if architecture in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return MoESettings(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                           renormalize=bool(cfg.norm_topk_prob),
                           shared_expert_intermediate_size=getattr(cfg, "shared_expert_intermediate_size", 0) or 0,
                           sparse_step=getattr(cfg, "decoder_sparse_step", 1) or 1,
                           dense_layers=tuple(getattr(cfg, "mlp_only_layers", None) or ()))
    return None


def rope_settings(cfg: PretrainedConfig) -> tuple[float, dict | None]:
    """(theta, scaling dict) from either transformers 5's `rope_parameters` or 4's
    `rope_theta` + `rope_scaling`."""
    params = getattr(cfg, "rope_parameters", None)
    if params is None:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return float(params.get("rope_theta", 10000.0)), params


def head_dim(cfg: PretrainedConfig) -> int:
    """config.json's `head_dim`, else hidden_size / num_attention_heads."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def sliding_window(cfg: PretrainedConfig) -> int | None:
    """The attention window config.json asks for, or None when attention is full."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if hasattr(cfg, "use_sliding_window"):  # Qwen2/Qwen3 in transformers 4
        return window if cfg.use_sliding_window else None
    return window


class DecoderAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig, flags: DecoderFlags, rotary: RotaryEmbedding, tp_size: int = 1,
                 tp_rank: int = 0):
        super().__init__()
        hidden = cfg.hidden_size
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        if total_heads % total_kv_heads:
            raise ModelLoadError(f"num_attention_heads ({total_heads}) is not a multiple of num_key_value_heads ({total_kv_heads})")
        self.head_dim = head_dim(cfg)
        # Tensor parallelism splits heads here: each rank's qkv_proj holds its share.
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_kv_heads, flags.qkv_bias, tp_size, tp_rank)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, flags.o_bias, tp_size, tp_rank)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if flags.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if flags.qk_norm else None
        self.rotary_emb = rotary  # one cos/sin cache, shared by every layer
        # FP8 KV pages' scales, from the checkpoint where it has them (`fp8.load_kv_cache_scale`).
        self.k_scale = self.v_scale = 1.0

    def qkv(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention inputs of the hidden states x [T, H] after the layer's input `norm` (x
        added to the residual stream first; x is the stream in the first layer, whose residual is
        None): q [T, Hq, D], k and v [T, Hkv, D], slices of one projection's output, and the
        residual stream. q and k are not normalised per head (Qwen3) nor rotated yet: `attend`
        hands the norms and the rotary to the attention backend, which applies them as it writes
        K/V (one kernel on the GPU)."""
        t = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        projected, residual = norm_and_linear(norm, x, residual, self.qkv_proj)
        q, k, v = projected.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return q, k, v, residual

    def attend(self, attn: AttentionBackend, layer_id: int, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the KV pages of `layer_id` for `qkv`'s q, k, v at `positions`, per-head
        norms and rotary included."""
        return attn.forward(layer_id, q, k, v, out=out, positions=positions, rotary=self.rotary_emb,
                            q_norm=self.q_norm, k_norm=self.k_norm)

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention result o [T, Hq, D]."""
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))


def _require_silu(cfg: PretrainedConfig) -> None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")


class DecoderLayer(nn.Module):
    """One decoder layer, in two halves around attention: `pre_attention` (input norm, q/k/v)
    and `post_attention` (output projection, norm, MLP: dense, or a FusedMoE block in the MoE
    models' sparse layers). The eager forward runs them with `attend` between; the piecewise
    CUDA graphs (`cuda_graphs.py`) capture the halves and run `attend` eagerly."""

    def __init__(self, cfg: PretrainedConfig, flags: DecoderFlags, rotary: RotaryEmbedding, tp_size: int = 1,
                 tp_rank: int = 0, moe: MoESettings | None = None, layer_idx: int = 0, expert_parallel: bool = False,
                 data_parallel: tuple[int, int] = (1, 0)):
        super().__init__()
        self.self_attn = DecoderAttention(cfg, flags, rotary, tp_size, tp_rank)
        _require_silu(cfg)
        if moe is not None and moe.is_moe_layer(layer_idx):
            self.mlp = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size, moe.renormalize,
                                moe.shared_expert_intermediate_size, tp_size, tp_rank, expert_parallel, data_parallel)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, flags.mlp_bias, tp_size, tp_rank)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def pre_attention(self, positions, x, residual):
        """Input norm (adding x to the residual stream first, except in the first layer, whose
        residual is None) and the attention inputs: (q, k, v, residual), q and k not normalised
        per head nor rotated yet."""
        return self.self_attn.qkv(self.input_layernorm, x, residual)

    def attend(self, attn, layer_id, positions, q, k, v, out=None):
        """Attention of `pre_attention`'s q, k, v (per-head norms and rotary included) over the
        pages of `layer_id`."""
        return self.self_attn.attend(attn, layer_id, positions, q, k, v, out)

    def post_attention(self, o, residual):
        """From the attention output o: output projection, post-attention norm, MLP → (x, residual)."""
        return self._mlp(self.self_attn.out(o), residual)

    def _mlp(self, x, residual):
        return self.mlp.normed(self.post_attention_layernorm, x, residual)

    def forward(self, layer_id, positions, x, residual, attn):
        x, residual = self._attention(layer_id, positions, x, residual, attn)
        return self._mlp(x, residual)

    def _attention(self, layer_id, positions, x, residual, attn):
        # A frame of its own: q, k, v and the attention output are freed before the MLP runs, which
        # keeps the peak of a long prefill (and so the profile step that sizes the KV pool) down.
        q, k, v, residual = self.pre_attention(positions, x, residual)
        return self.self_attn.out(self.attend(attn, layer_id, positions, q, k, v)), residual


class MissingLayer(nn.Module):
    """Stands for a decoder layer another pipeline stage holds: no weights, never run."""


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm: the checkpoint's `model.*` weights.

    Under pipeline parallelism a stage holds the layers [start, end) of `layers` (each under its
    checkpoint index; the others are `MissingLayer`s), the embedding only on the first stage and
    the final norm only on the last."""

    def __init__(self, cfg: PretrainedConfig, flags: DecoderFlags, max_position: int, tp_size: int = 1, tp_rank: int = 0,
                 moe: MoESettings | None = None, expert_parallel: bool = False, layers: tuple[int, int] | None = None,
                 data_parallel: tuple[int, int] = (1, 0)):
        super().__init__()
        self.start_layer, self.end_layer = layers or (0, cfg.num_hidden_layers)
        self.is_first_stage = self.start_layer == 0
        self.is_last_stage = self.end_layer == cfg.num_hidden_layers
        if self.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp_size, tp_rank)
        theta, rope_params = rope_settings(cfg)
        # One cos/sin cache shared by all layers.
        self.rotary_emb = RotaryEmbedding(head_dim(cfg), max_position, theta, rope_params,
                                          getattr(cfg, "rope_freq_factors", None))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, flags, self.rotary_emb, tp_size, tp_rank, moe, i, expert_parallel, data_parallel)
            if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(cfg.num_hidden_layers))
        if self.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # EAGLE-3 (`worker/drafter.py`): the layers whose input hidden state an eager forward keeps
        # in `aux_hidden` (vLLM's aux hidden states).
        self.aux_hidden_layers: tuple[int, ...] = ()
        self.aux_hidden: list[torch.Tensor] = []

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The last layer's output added to the residual stream, normalised: the hidden states."""
        x, _ = self.norm(x, residual)
        return x

    def forward(self, input_ids, positions, attn, intermediate=None):
        """Hidden states on the last stage; (x, residual) for the next stage on any other.
        `intermediate` is the previous stage's (x, residual) (None on the first stage)."""
        if self.is_first_stage:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate
        aux, kept = self.aux_hidden_layers, {}
        for i in range(self.start_layer, self.end_layer):
            if i in aux:
                kept[i] = x if residual is None else x + residual
            # The stage's KV pool holds its own layers only: layer i is its (i - start)-th.
            x, residual = self.layers[i](i - self.start_layer, positions, x, residual, attn)
        if aux:
            self.aux_hidden = [kept[i] for i in aux]  # a layer may be named twice
        if not self.is_last_stage:
            return x, residual
        return self.final_norm(x, residual)


class LlamaForCausalLM(nn.Module):
    """`model(input_ids [T], positions [T], attn) -> hidden [T, H]`; `compute_logits(hidden [N, H])
    -> float32 [N, vocab]`. Serves every architecture listed in `pagoda_engine.worker.model.models`.

    `layers` = [start, end): one pipeline stage's share (default: all); only the last stage has
    the LM head (with tied embeddings it is loaded from the checkpoint's embedding), and a stage
    other than the last returns (x, residual) for the next one (`forward`'s `intermediate`)."""

    def __init__(self, cfg: PretrainedConfig, architecture: str = "LlamaForCausalLM", tp_size: int = 1, tp_rank: int = 0,
                 enable_expert_parallel: bool = False, layers: tuple[int, int] | None = None,
                 data_parallel: tuple[int, int] = (1, 0)):
        super().__init__()
        self.config = cfg
        self.flags = decoder_flags(architecture, cfg)
        self.vocab_size = cfg.vocab_size
        self.moe = moe_settings(architecture, cfg)
        if enable_expert_parallel and self.moe is None:
            raise ModelLoadError(f"--enable-expert-parallel needs a mixture-of-experts model; {architecture} is dense")
        self.model = DecoderModel(cfg, self.flags, cfg.max_position_embeddings, tp_size, tp_rank, self.moe,
                                  enable_expert_parallel, layers, data_parallel)
        self.max_position_embeddings = self.model.rotary_emb.max_position
        window = sliding_window(cfg)
        if window is not None and window < self.max_position_embeddings:
            # Within the window, sliding-window attention is full attention: serve that far, exactly.
            logger.warning("config.json sets sliding_window=%d; serving at most %d tokens per sequence "
                           "(longer sequences would need windowed attention)", window, window)
            self.max_position_embeddings = window
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp_size, tp_rank)
            if self.tie_word_embeddings and self.model.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def is_first_stage(self) -> bool:
        return self.model.is_first_stage

    @property
    def is_last_stage(self) -> bool:
        return self.model.is_last_stage

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, positions, attn, intermediate)

    # What the piecewise CUDA graphs run (`cuda_graphs.PiecewiseModel`): the embedding, the
    # layers' halves around attention, the final norm; under pipeline parallelism this stage's.
    @functools.cached_property
    def layers(self) -> tuple[nn.Module, ...]:
        """This stage's own decoder layers (all of them without pipeline parallelism). Made once: a
        slice of the ModuleList builds a new ModuleList, 32 `add_module` calls for Llama-8B, and the
        piecewise graphs ask for a layer 32 times a step (about 2 ms of an H100 host's launch). A
        tuple in the instance's __dict__, so not registered as submodules a second time."""
        return tuple(self.model.layers[self.model.start_layer:self.model.end_layer])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.model.final_norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_spec(self, page_size: int, dtype: torch.dtype, compute_dtype: torch.dtype | None = None
                      ) -> KVCacheSpec:
        """This stage's KV pages of `dtype`: its own layers', at this rank's heads (and, FP8
        pages, its layers' K/V scales)."""
        attn = self.model.layers[self.model.start_layer].self_attn
        fp8 = dtype == torch.float8_e4m3fn
        return KVCacheSpec(
            num_layers=self.model.end_layer - self.model.start_layer,
            num_kv_heads=attn.num_kv_heads,
            num_qo_heads=attn.num_heads,
            head_dim=attn.head_dim,
            page_size=page_size,
            dtype=dtype,
            compute_dtype=compute_dtype,
            k_scales=tuple(layer.self_attn.k_scale for layer in self.layers) if fp8 else (),
            v_scales=tuple(layer.self_attn.v_scale for layer in self.layers) if fp8 else (),
        )

    # Checkpoint names that land in one merged parameter: (merged name, checkpoint name, piece).
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # Checkpoint module names that stand elsewhere here: Mixtral's MoE block is its layers' `mlp`.
    renamed_modules = (("block_sparse_moe", "mlp"),)
    def checkpoint_weight_name(self, name: str) -> str | None:
        """Where checkpoint tensor `name` goes in this stage: `name`, or None for another stage's
        weight; with tied embeddings a last stage without the embedding loads its LM head from it."""
        if name.startswith("model.layers."):
            layer = int(name.split(".", 3)[2])
            return name if self.model.start_layer <= layer < self.model.end_layer else None
        if name.startswith("model.embed_tokens."):
            if self.is_first_stage:
                return name
            return name.replace("model.embed_tokens.", "lm_head.") if self.is_last_stage and self.tie_word_embeddings else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.is_last_stage else None
        return name

    # Checkpoint entries that are not weights (old exports saved rotary buffers).
    ignored_suffixes = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

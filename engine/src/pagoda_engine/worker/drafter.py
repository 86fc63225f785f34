"""The drafting model of speculative decoding on rank 0: a small model of the target's tokenizer
(`draft_model`) or an EAGLE-3 head over the target's hidden states (`eagle3`,
`model/eagle3.py`), its own KV tensors in the target's page ids, and the drafting loop.

The engine core plans each engine step's drafting (`core/draft_proposer.py`): which tokens catch
each request's drafting KV up to its last known token, at which positions and slots, then one
single-token step per further draft. `propose` runs that plan and returns the drafted tokens,
drafted greedily (the argmax of the drafting model's logits): a point-mass draft, which the
verification's rule keeps exact (`core/spec_decode.py`).

Pages: the drafter's KV tensors have as many pages as the target's and are indexed by the same
page ids, so a request's draft KV lives in the pages the scheduler gave it; nothing else is
allocated, freed or hashed for the drafter.

EAGLE-3 reads the target's hidden states at three layers (vLLM's choice: 2, L/2, L-3, or the
head's `eagle_config.eagle_aux_hidden_state_layer_ids`), concatenated and projected by the head's
`fc` as every target forward runs (`store_target_hidden`), into a buffer with one row per KV
slot: a request's catch-up reads the rows of its positions, as it reads their KV.

On rank 0 only: under tensor parallelism a draft model or a head sits whole beside rank 0's shard
of the target (the KV pool's size counts its pages on that rank), while the other ranks wait for
the verification step. An EAGLE-3 head without an embedding of its own embeds with a whole copy of
the target's, gathered to rank 0 at start-up (the target's is sharded); the hidden states it reads
are whole on every rank. The worker refuses a drafter under pipeline parallelism, as the config
does first.
"""

from __future__ import annotations

import logging

import torch
from transformers import PretrainedConfig

from pagoda_engine.errors import ModelLoadError
from pagoda_engine.executor_types import (AttentionBatch, DraftPlan, DraftStep, KVCacheSpec, aligned_numel,
                                          host_to_device)
from pagoda_engine.worker.attention import get_attention_backend
from pagoda_engine.worker.attention.base import AttentionBackend
from pagoda_engine.worker.model.eagle3 import Eagle3Head, load_eagle3_config, load_eagle3_head
from pagoda_engine.worker.model.loader import load_hf_config, load_model

logger = logging.getLogger(__name__)


class Drafter:
    """A drafting model on rank 0 (`load_drafter`), then its KV (`init_kv_cache`)."""

    def __init__(self, method: str, model_dir: str, model: torch.nn.Module, device: torch.device,
                 dtype: torch.dtype, target: torch.nn.Module):
        self.method = method
        self.model_dir = model_dir
        self.model = model
        self.device = device
        self.dtype = dtype
        self.target = target
        self.attn: AttentionBackend | None = None
        # EAGLE-3: the projected target features of every KV slot, and the target layers they come from.
        self.features: torch.Tensor | None = None
        self.aux_layers: tuple[int, ...] = ()
        if isinstance(model, Eagle3Head):
            self.aux_layers = model.aux_layers(target.config.num_hidden_layers)
            self.max_position = model.config.max_position_embeddings
        else:
            self.max_position = model.max_position_embeddings

    @property
    def reads_target_hidden(self) -> bool:
        return self.method == "eagle3"

    def kv_cache_spec(self, page_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return self.model.kv_cache_spec(page_size, dtype)

    def bytes_per_page(self, page_size: int, dtype: torch.dtype) -> int:
        """What one page costs the drafter beside the target's: its KV, and for EAGLE-3 the features."""
        extra = page_size * self.model.config.hidden_size * dtype.itemsize if self.reads_target_hidden else 0
        return self.kv_cache_spec(page_size, dtype).bytes_per_page() + extra

    def init_kv_cache(self, backend: str, page_size: int, dtype: torch.dtype, num_pages: int) -> None:
        self.attn = get_attention_backend(backend, self.kv_cache_spec(page_size, dtype), num_pages, self.device)
        if self.reads_target_hidden:
            self.features = torch.zeros(num_pages * page_size, self.model.config.hidden_size, dtype=dtype,
                                        device=self.device)

    def store_target_hidden(self, aux: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """EAGLE-3: the target's hidden states at `aux_layers` for a forward's tokens, projected by
        the head's `fc` into the rows of their slots."""
        self.features[slot_mapping] = self.model.combine(torch.cat(aux, dim=-1))

    @torch.inference_mode()
    def propose(self, plan: DraftPlan) -> list[list[int]]:
        """Run `plan`; each request's drafted tokens (as many as the steps it takes part in). Each
        step's integers go to the device in one copy that does not wait for it; the drafts come
        back once, at the end."""
        drafts = torch.full((plan.num_requests, plan.num_tokens), -1, dtype=torch.int64, device=self.device)
        tokens = hidden = None
        j = 0  # the drafted token's index
        for step in plan.steps:
            positions, slots, feature_slots, fed, last, requests = _on_device(step, self.device)
            input_ids = fed if step.token_ids is not None else tokens[fed]  # `fed`: ids, or rows of the step before
            self.attn.plan(AttentionBatch(query_lens=step.query_lens, seq_lens=step.seq_lens,
                                          page_tables=step.page_tables, slot_mapping=slots,
                                          num_decodes=step.num_decodes))
            if step.writes_only:
                if self.reads_target_hidden:
                    self.model(input_ids, positions, self.features[feature_slots], self.attn)
                else:
                    self.model(input_ids, positions, self.attn)
                continue
            if self.reads_target_hidden:
                features = self.features[feature_slots] if step.token_ids is not None else hidden[fed]
                normed, prenorm = self.model(input_ids, positions, features, self.attn)
                tokens = self.model.draft_token_ids(self.model.compute_logits(normed[last]))
                hidden = prenorm[last]
            else:
                out = self.model(input_ids, positions, self.attn)
                tokens = self.model.compute_logits(out[last]).argmax(dim=-1)
            drafts[requests, j] = tokens
            j += 1
        out = drafts.tolist()
        return [[t for t in row if t >= 0] for row in out]


def _on_device(step: DraftStep, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A step's positions, slots, feature slots, fed ids (or rows), last rows and requests, on the
    device, from one host buffer (each part starting aligned)."""
    parts = [step.positions, step.slots, step.feature_slots or [],
             step.token_ids if step.token_ids is not None else step.from_rows, _last_rows(step.query_lens),
             step.requests]
    flat, bounds = [], []
    for part in parts:
        start = len(flat)
        flat += part
        bounds.append((start, len(flat)))
        flat += [0] * (aligned_numel(len(flat), torch.int64) - len(flat))
    dev = host_to_device(torch.tensor(flat, dtype=torch.int64), device)
    return tuple(dev[a:b] for a, b in bounds)


def _last_rows(query_lens: list[int]) -> list[int]:
    rows, end = [], 0
    for n in query_lens:
        end += n
        rows.append(end - 1)
    return rows


def load_drafter(method: str, model_dir: str, target: torch.nn.Module, target_config: PretrainedConfig,
                 dtype: torch.dtype, device: torch.device, load_format: str, seed: int,
                 target_embed: torch.nn.Module | None = None) -> Drafter:
    """The drafting model of `method` from `model_dir`, checked against the target: the same
    vocabulary (a draft model) or the target's vocabulary and hidden size (an EAGLE-3 head, which
    embeds with `target_embed`, else the target's own embedding, when it has none of its own)."""
    if method == "eagle3":
        config = load_eagle3_config(model_dir)
        embed = target_embed if target_embed is not None else target.model.embed_tokens
        model = load_eagle3_head(model_dir, config, embed, target_config, dtype, device, load_format, seed)
    else:
        config = load_hf_config(model_dir)
        if config.vocab_size != target_config.vocab_size:
            raise ModelLoadError(f"the draft model {model_dir} has a vocabulary of {config.vocab_size} tokens, the "
                                 f"target's has {target_config.vocab_size}: a draft model must share the target's "
                                 "tokenizer")
        model = load_model(model_dir, config, dtype, device, load_format, seed)
    logger.info("speculative decoding: %s drafts from %s (%d parameters)", method, model_dir,
                sum(p.numel() for p in model.parameters()))
    return Drafter(method, model_dir, model, device, dtype, target)

"""One step's sampling inputs from its requests (`sampling_batch`): the per-row settings of their
SamplingParams (`SamplingBatch.from_params`), then what needs the requests' own tokens: each
seeded row's step (output tokens, those still in flight included), the penalties' token counts,
min_tokens' masked stop ids and the grammars' masks. Host-side work of the engine core, once per
step; the tensors go to the sampling rank without waiting for the device."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from pagoda_engine.core.request import Request
from pagoda_engine.executor_types import SamplingBatch, to_device


def sampling_batch(reqs: list[Request], vocab_size: int, device: torch.device,
                   drafts: list[list[int]] | None = None) -> SamplingBatch:
    """Row i samples for `reqs[i]`, after the draft tokens `drafts[i]` where given (speculative
    decoding's verification rows: only a grammar reads them, the rest of a row's view is in
    `reqs[i]`, `spec_decode.verification_rows`)."""
    device = torch.device(device)
    params = [r.sampling_params for r in reqs]
    # The output index counts tokens still in flight (async scheduling).
    steps = [r.num_output_tokens + r.num_output_placeholders for r in reqs]
    batch = SamplingBatch.from_params(params, vocab_size, device, steps)
    num_rows = len(reqs)

    if any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32,
                                                device=device)
        batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32,
                                               device=device)
        batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
        outputs = _flat_token_index([np.array(r.output_token_ids, dtype=np.int64) for r in reqs], vocab_size, device)
        output_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
        output_counts.index_add_(0, outputs, torch.ones(outputs.shape, dtype=torch.float32, device=device))
        batch.output_counts = output_counts.view(num_rows, vocab_size)
        batch.seen_mask = batch.output_counts > 0
        batch.seen_mask.view(-1)[_flat_token_index([_prompt_array(r) for r in reqs], vocab_size, device)] = True

    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, (r, p, step) in enumerate(zip(reqs, params, steps)):
        if step < p.min_tokens:
            # vLLM masks `all_stop_token_ids`: the stop token ids plus every EOS id, ignore_eos or
            # not (an EOS sampled under ignore_eos would not stop, but vLLM still keeps it out).
            ids = {t for t in (*p.stop_token_ids, *r.eos_token_ids) if 0 <= t < vocab_size}
            mask_rows.extend([i] * len(ids))
            mask_ids.extend(sorted(ids))
    if mask_rows:
        batch.min_tokens_rows = to_device(mask_rows, torch.int64, device)
        batch.min_tokens_ids = to_device(mask_ids, torch.int64, device)

    grammar_idx = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if grammar_idx:
        from pagoda_engine.structured_outputs import fill_bitmask

        batch.grammar_rows = to_device(grammar_idx, torch.int64, device)
        row_drafts = [drafts[i] for i in grammar_idx] if drafts is not None else None
        batch.grammar_bitmask = to_device(fill_bitmask([reqs[i].grammar for i in grammar_idx], vocab_size, row_drafts),
                                          torch.int32, device)
    return batch


# Each request's prompt as an array, made on its first penalised step: converting a long prompt
# from a Python list again on every step would cost more than the penalties themselves. A request's
# prompt list is never edited in place; a new list (or length) makes a new array.
_prompt_arrays: weakref.WeakKeyDictionary[Request, tuple[list[int], np.ndarray]] = weakref.WeakKeyDictionary()


def _prompt_array(req: Request) -> np.ndarray:
    cached = _prompt_arrays.get(req)
    if cached is None or cached[0] is not req.prompt_token_ids or len(cached[1]) != len(req.prompt_token_ids):
        cached = _prompt_arrays[req] = (req.prompt_token_ids, np.array(req.prompt_token_ids, dtype=np.int64))
    return cached[1]


def _flat_token_index(token_arrays: list[np.ndarray], vocab_size: int, device: torch.device) -> torch.Tensor:
    """int64 [N]: `row * V + token_id` for every token of every row, for indexing a flattened [B, V]
    tensor; one host-to-device copy for the whole batch. Ids outside the vocabulary (a tokenizer
    larger than the LM head) are left out."""
    ids = np.concatenate(token_arrays) if token_arrays else np.zeros(0, dtype=np.int64)
    rows = np.repeat(np.arange(len(token_arrays), dtype=np.int64), [len(a) for a in token_arrays])
    valid = (ids >= 0) & (ids < vocab_size)
    return torch.from_numpy(rows[valid] * vocab_size + ids[valid]).to(device)

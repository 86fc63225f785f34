"""Sampling from raw logits in one pass over the vocabulary, on CUDA (Triton).

`argmax(logits / T + G)` with `G ~ Gumbel(0, 1)` per token draws from `softmax(logits / T)` exactly
(the Gumbel-max trick, the same race as the sampler's `argmax(probs / Exponential)`), so a row
without top-k, top-p or min-p needs no softmax, no float32 copy of its logits and no second pass:
the kernel reads the LM head's bf16 logits once. Each row brings its own Philox seed and the
counter is the token id, so a row's draw depends on its seed alone, never on its batch or position.

The vocabulary is cut into chunks of `_CHUNK` tokens: one program per (row, chunk) keeps every SM
busy at batch 1, and a second pass over the `[rows, chunks]` partial maxima picks the winner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda_engine.worker import pdl

_CHUNK = 8192
_BLOCK = 1024


@triton.jit
def _gumbel_max_kernel(logits_ptr, row_stride, inv_temp_ptr, seed_ptr, best_val_ptr, best_idx_ptr,
                       vocab_size, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    seed = tl.load(seed_ptr + row)
    inv_temp = tl.load(inv_temp_ptr + row)
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    first = chunk * CHUNK
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_col = first + tl.arange(0, BLOCK)
    for off in range(0, CHUNK, BLOCK):
        cols = first + off + tl.arange(0, BLOCK)
        valid = cols < vocab_size
        x = tl.load(row_logits + cols, mask=valid, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, cols)  # uniform in [0, 1); 0 gives a Gumbel of -inf: never picked
        score = x * inv_temp - tl.log(-tl.log(u))
        take = score > best  # strict: the lowest column wins a tie within a lane
        best = tl.where(take, score, best)
        best_col = tl.where(take, cols, best_col)
    top = tl.max(best, axis=0)
    col = tl.min(tl.where(best == top, best_col, vocab_size), axis=0)
    tl.store(best_val_ptr + row * num_chunks + chunk, top)
    tl.store(best_idx_ptr + row * num_chunks + chunk, col)


def gumbel_max_sample(logits: torch.Tensor, seeds: torch.Tensor, temperature: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """One token per row of `logits` `[R, V]` (bf16, fp16 or fp32, on CUDA), drawn from
    `softmax(logits / temperature)`; `seeds` int64 `[R]` (`sampling.row_seeds`), `temperature` float32 `[R]`
    (None = 1). Masked tokens (-inf) are never drawn. Returns int64 `[R]`."""
    num_rows, vocab_size = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_chunks = triton.cdiv(vocab_size, _CHUNK)
    best_val = torch.empty((num_rows, num_chunks), dtype=torch.float32, device=logits.device)
    best_idx = torch.empty((num_rows, num_chunks), dtype=torch.int32, device=logits.device)
    if num_rows:
        # Temperature is a runtime input, not a compile-time switch: one compiled kernel per logits
        # dtype, all of them compiled by the engine's warm-up (a cold Triton compile takes seconds).
        inv_temp = (temperature.reciprocal() if temperature is not None
                    else torch.ones(num_rows, dtype=torch.float32, device=logits.device))
        _gumbel_max_kernel[(num_rows, num_chunks)](
            logits, logits.stride(0), inv_temp, seeds, best_val, best_idx, vocab_size, num_chunks,
            CHUNK=_CHUNK, BLOCK=_BLOCK, num_warps=4, **pdl.launch(logits.device))
    # argmax returns the first maximum: among equal scores the lowest chunk, hence the lowest id.
    return best_idx.gather(1, best_val.argmax(dim=1, keepdim=True)).squeeze(1).long()

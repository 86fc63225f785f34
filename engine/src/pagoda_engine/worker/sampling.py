"""Token sampling: from one step's logits `[B, V]` to one token (and optional logprobs) per row.

Owns what vLLM's sampler does, with vLLM's semantics and order:
  raw logprobs (log_softmax of the model's logits, before anything below)
  → the grammar mask (structured outputs: tokens the request's grammar forbids next get -inf)
  → logit_bias (added to the logits of the given token ids)
  → penalties (repetition on prompt+output tokens, frequency and presence on output tokens)
  → min_tokens (EOS and stop tokens masked until the request has `min_tokens` outputs)
  → greedy rows: argmax; random rows: temperature → min_p → top_k → top_p → sample.

Sampling is the exponential race: `argmax(probs / q)` with `q ~ Exponential(1)` draws from `probs`
exactly, and lets each row bring its own noise. A seeded row's noise comes from a generator seeded
by `(seed, number of output tokens so far)` alone, so its tokens do not depend on which other rows
share the batch, on its position, or on whether it was preempted and recomputed. Unseeded rows use
the sampler's engine-wide generator.

The engine core turns its requests into per-row tensors once per step (`executor_types.SamplingBatch`,
built by `core.sampling_batch`, copied without waiting for the device, which may still run the
step before);
`Sampler.sample` is then a fixed sequence of whole-batch tensor ops (no loops over the vocabulary).
`Sampler.sample_on_device` stops before the host reads anything, for async scheduling.
Everything is plain torch on whatever device the logits live on. The GPU seam is two methods:
`Sampler._sample_random` (logits of the random rows in, one token per row out) and
`Sampler._draws_from_raw_logits` (whether a batch may skip the float32 copy of the logits).
`CudaSampler` replaces both (the Gumbel-max kernel of `gumbel.py` for plain temperature rows,
FlashInfer for top-k/top-p/min-p); everything around them (penalties, masks, greedy, logprobs)
stays shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda_engine.executor_types import MASK64, SamplingBatch, splitmix64, to_device
from pagoda_engine.messages import Logprob, TokenLogprobs
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.worker.compile_ahead import compile_ahead

SEED_MASK = (1 << 63) - 1  # seeds are int64 on the device: 63 random bits


def row_seeds(stream_seed: int, first_draw: int, num_rows: int) -> np.ndarray:
    """int64 `[num_rows]`: the Philox seeds of draws `first_draw, first_draw + 1, …` of an unseeded
    stream (splitmix64 of the stream seed plus the draw number: distinct, well-mixed keys)."""
    draws = np.arange(first_draw, first_draw + num_rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        draws += np.uint64(stream_seed & MASK64)
    return (splitmix64(draws) & np.uint64(SEED_MASK)).astype(np.int64)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where the request asked for none


@dataclass
class PendingSample:
    """A step's sampled tokens while still on the device; `resolve` reads them (and waits)."""

    token_ids: torch.Tensor  # int64 [B] on the logits' device
    num_logprobs: list[int | None]
    raw_logprobs: tuple[list[int], torch.Tensor] | None  # rows wanting logprobs, their log_softmax
    # On CUDA the tokens are copied to pinned host memory as soon as they are sampled: reading
    # them later waits for this copy only, not for a next step queued behind it.
    host_token_ids: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        if self.token_ids.is_cuda:
            self.host_token_ids = torch.empty(self.token_ids.shape, dtype=torch.int64, pin_memory=True)
            self.host_token_ids.copy_(self.token_ids, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def resolve(self) -> SamplerOutput:
        if self.copied is not None:
            self.copied.synchronize()
            token_list = self.host_token_ids.tolist()
        else:
            token_list = self.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_list)
        if self.raw_logprobs is not None:
            rows, lp = self.raw_logprobs
            entries = token_logprobs(lp, self.token_ids[rows], [self.num_logprobs[i] for i in rows])
            for i, entry in zip(rows, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_list, logprobs=logprobs)


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        # One engine-wide generator per device, made on first use (the sampler does not know the
        # device until it sees logits). It draws the noise of every unseeded random row.
        self._generators: dict[torch.device, torch.Generator] = {}

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed & MASK64)
            self._generators[device] = gen
        return gen

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if batch.num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        return self.sample_on_device(logits, batch).resolve()

    def sample_on_device(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """Queue the whole draw on the logits' device; nothing is read back to the host."""
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, (logits.shape, batch.num_rows)
        assert logits.shape[1] == batch.vocab_size, (logits.shape, batch.vocab_size)
        if not self._draws_from_raw_logits(batch):
            logits = logits.float()

        raw_logprobs = None
        if batch.needs_logprobs:
            rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
            raw_logprobs = (rows, torch.log_softmax(logits[rows], dim=-1))

        logits = apply_penalties_and_masks(logits, batch)
        # Greedy is the argmax after penalties and masks, before temperature (as in vLLM).
        if batch.all_greedy:
            token_ids = logits.argmax(dim=-1)
        elif batch.all_random:  # no argmax, no gather of the random rows: one pass less over the logits
            token_ids = self._sample_random(logits, batch)
        else:
            sampled = self._sample_random(logits[batch.random_rows], batch)
            token_ids = logits.argmax(dim=-1).index_copy(0, batch.random_rows, sampled)
        return PendingSample(token_ids=token_ids, num_logprobs=batch.num_logprobs, raw_logprobs=raw_logprobs)

    def _draws_from_raw_logits(self, batch: SamplingBatch) -> bool:
        """Whether this batch samples straight from the LM head's logits (bf16 on GPU), with no
        float32 copy: nothing reads probabilities, and argmax picks the same token either way."""
        return batch.only_draw_reads_logits and batch.all_greedy

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Sample one token per random row from logits `[R, V]` after penalties and masks."""
        if batch.temperature is not None:
            logits = logits / batch.temperature[:, None]
        if batch.min_p is not None:
            # Keep tokens whose probability is at least min_p times the most likely token's.
            probs = torch.softmax(logits, dim=-1)
            threshold = batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
        probs = torch.softmax(logits, dim=-1)
        return probs.div_(self._exponential_noise(probs.shape, probs.device, batch.seeded)).argmax(dim=-1)

    def _exponential_noise(self, shape: torch.Size, device: torch.device,
                           seeded: list[tuple[int, int]]) -> torch.Tensor:
        """Exponential(1) noise as -log(U), U uniform in [0, 1): never 0 (so no 0/0 for masked
        tokens), and several times faster on CPU than `Tensor.exponential_`."""
        uniform = torch.empty(shape, dtype=torch.float32, device=device)
        if len(seeded) < shape[0]:
            uniform.uniform_(generator=self._engine_generator(device))
        for row, seed in seeded:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            uniform[row].uniform_(generator=gen)
        return uniform.log_().neg_()


class CudaSampler(Sampler):
    """The sampler on CUDA. Everything before the draw (penalties, masks, greedy, logprobs) is the
    shared code above; the draw of the random rows is:

    - rows without top-k, top-p or min-p (plain temperature sampling): the Gumbel-max kernel
      (`gumbel.py`), one pass over the bf16 logits, seeded per row. When the whole batch is such
      rows (and wants no logprobs, penalties or masks), the logits are never copied to float32.
    - rows with top-k, top-p or min-p: FlashInfer's fused sampling kernels, except seeded rows and
      min_p combined with top-k/top-p, which keep the torch path (FlashInfer draws row i's
      randomness from Philox subsequence i, so a seeded row's token would depend on its position
      in the batch, which Pagoda's seeds promise it does not).

    A plain row takes the kernel whatever else shares its batch, so its seeded tokens never
    depend on its neighbours.
    """

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        self._num_draws = 0  # draws taken so far by unseeded plain rows: each gets a fresh key

    def _draws_from_raw_logits(self, batch: SamplingBatch) -> bool:
        # Greedy rows take the argmax, plain random rows the Gumbel-max kernel: both read any dtype.
        return batch.only_draw_reads_logits and not any(batch.filtered)

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if not logits.is_cuda:
            return super()._sample_random(logits, batch)
        from pagoda_engine.worker.gumbel import gumbel_max_sample

        plain = [j for j, f in enumerate(batch.filtered) if not f]
        seeds = self._plain_row_seeds(batch, plain, logits.device)
        if len(plain) == len(batch.filtered):
            return gumbel_max_sample(logits, seeds, batch.temperature)
        tokens = self._sample_filtered(logits, batch)
        if plain:
            rows = to_device(plain, torch.int64, logits.device)
            temperature = batch.temperature[rows] if batch.temperature is not None else None
            tokens[rows] = gumbel_max_sample(logits[rows], seeds, temperature)
        return tokens

    def _plain_row_seeds(self, batch: SamplingBatch, plain: list[int], device: torch.device) -> torch.Tensor:
        """int64 [len(plain)] on `device`: a seeded row's step seed, else a fresh key of the
        engine-wide stream."""
        seeds = row_seeds(self.seed, self._num_draws, len(plain))
        self._num_draws += len(plain)
        at = {j: i for i, j in enumerate(plain)}
        for j, seed in batch.seeded:
            if j in at:
                seeds[at[j]] = seed & SEED_MASK
        return torch.from_numpy(seeds).pin_memory().to(device, non_blocking=True)

    def _sample_filtered(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Every random row through top-k / top-p / min-p (rows without them pass unfiltered)."""
        has_top = batch.top_k is not None or batch.top_p is not None
        seeded_filtered = any(batch.filtered[j] for j, _ in batch.seeded)
        if seeded_filtered or (batch.min_p is not None and has_top):
            return super()._sample_random(logits, batch)
        from flashinfer import sampling as fs

        gen = self._engine_generator(logits.device)
        if batch.temperature is not None:
            logits = logits / batch.temperature[:, None]
        logits = logits.contiguous()
        if batch.min_p is not None:
            probs = torch.softmax(logits, dim=-1)
            tokens = fs.min_p_sampling_from_probs(probs, batch.min_p, generator=gen)
        else:
            top_k = batch.top_k.int() if batch.top_k is not None else batch.vocab_size
            top_p = batch.top_p if batch.top_p is not None else 1.0
            tokens = fs.top_k_top_p_sampling_from_logits(logits, top_k, top_p, generator=gen)
        return tokens.long()


def warm_up_sampler(sampler: Sampler, vocab_size: int, dtype: torch.dtype, device: torch.device,
                    compile_first: bool = False) -> None:
    """Draw once along each of the sampler's paths (greedy, plain temperature, top-p): Triton's
    Gumbel-max kernel takes seconds to compile on a cold cache, which no request should wait for.
    `compile_first`: its variants (one per logits dtype) compile ahead, at once
    (`note_sampler_kernels`; cache hits where the profile step's pass compiled them)."""
    if compile_first:
        with compile_ahead(torch.device(device), "the sampler") as ahead:
            if ahead:
                note_sampler_kernels(vocab_size, dtype, device)
    _draw_each_path(sampler, vocab_size, dtype, device)


def note_sampler_kernels(vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    """Inside a `compile_ahead` block: the warm-up's draws by a sampler of their own (the engine's
    draws no random numbers for this), so that the block notes the sampler's Triton variants. Its
    tokens are whatever the skipped kernels' outputs held; nothing reads them."""
    _draw_each_path(make_sampler(0, device), vocab_size, dtype, device)


def _draw_each_path(sampler: Sampler, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
    paths = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(top_p=0.9)]
    logits = torch.zeros(len(paths), vocab_size, dtype=dtype, device=device)
    for rows in (paths[:1], paths[1:2], paths):  # all greedy, all plain, mixed
        sampler.sample(logits[:len(rows)], SamplingBatch.from_params(rows, vocab_size, device))


def make_sampler(seed: int, device: torch.device) -> Sampler:
    """CudaSampler on CUDA when FlashInfer and Triton (which torch's CUDA builds bring) import,
    else the torch Sampler."""
    if torch.device(device).type == "cuda":
        import importlib.util

        if all(importlib.util.find_spec(m) is not None for m in ("flashinfer", "triton")):
            return CudaSampler(seed)
    return Sampler(seed)


def apply_penalties_and_masks(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Returns new logits (the input, which raw logprobs were taken from, is left alone)."""
    if batch.grammar_rows is not None:
        logits = apply_token_bitmask(logits, batch.grammar_rows, batch.grammar_bitmask)
    if batch.logit_bias_rows is not None:
        logits = logits.index_put((batch.logit_bias_rows, batch.logit_bias_ids),
                                  batch.logit_bias_values.to(logits.dtype), accumulate=True)
    if batch.repetition_penalty is not None:
        # HF-style repetition penalty: positive logits shrink, negative ones grow, for every
        # token seen in the prompt or the output. Then OpenAI-style frequency and presence.
        rep = torch.where(batch.seen_mask, batch.repetition_penalty[:, None], 1.0)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
        logits = logits - batch.frequency_penalty[:, None] * batch.output_counts
        logits = logits - batch.presence_penalty[:, None] * (batch.output_counts > 0).float()
    if batch.min_tokens_rows is not None:
        logits = logits.index_put((batch.min_tokens_rows, batch.min_tokens_ids),
                                  torch.full((), float("-inf"), device=logits.device))
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """New logits where, in each of `rows` (ascending), every token whose bit is 0 in that row of
    `bitmask` (int32 [len(rows), ceil(V / 32)]) is -inf. Other rows are left as they are."""
    vocab_size = logits.shape[1]
    if bitmask.is_cuda:
        bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab_size]
    else:  # numpy unpacks bits far faster than torch's shifts on CPU (little-endian words)
        unpacked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(unpacked[:, :vocab_size].view(np.bool_))
    if rows.numel() == logits.shape[0]:  # every row is constrained
        return torch.where(allowed, logits, float("-inf"))
    return logits.index_copy(0, rows, torch.where(allowed, logits[rows], float("-inf")))


# Top-k/top-p first look at this many of each row's most likely tokens (more if a top_k asks):
# sorting the whole vocabulary is by far the slowest step on CPU (about 0.7 s for 32 rows of a
# 128k vocabulary, against 30 ms for this top-k), and a nucleus rarely needs more.
_NUM_CANDIDATES = 256


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int | None = None) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k, then outside its top-p nucleus of what is
    left (renormalised). `top_k` [R] holds V for rows without one; `max_top_k` is its largest value
    below V, when the caller knows it without reading the device. Among equal logits the lower token
    id ranks first, so top_k=1 and a tiny top_p keep exactly the token `argmax` picks."""
    num_rows, vocab_size = logits.shape
    if top_k is None:
        top_k = torch.full((num_rows,), vocab_size, dtype=torch.int64, device=logits.device)
    if max_top_k is None:
        max_top_k = int(top_k.masked_fill(top_k >= vocab_size, 0).max())
    width = min(vocab_size, max(_NUM_CANDIDATES, max_top_k))
    keep, token_ids = _top_k_top_p_keep(logits, top_k, top_p, width)
    if keep is None:  # some nucleus reaches past the candidates: rank the whole vocabulary
        keep, token_ids = _top_k_top_p_keep(logits, top_k, top_p, vocab_size)
    remove = torch.ones_like(logits, dtype=torch.bool).scatter_(-1, token_ids, ~keep)
    unfiltered = top_k >= vocab_size
    if top_p is not None:
        unfiltered &= top_p >= 1.0
    return logits.masked_fill(remove & ~unfiltered[:, None], float("-inf"))


def _top_k_top_p_keep(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None,
                      width: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Over each row's `width` most likely tokens (`token_ids` [R, width], most likely first): which
    to keep. Returns (None, _) when some row's nucleus may reach past them."""
    vocab_size = logits.shape[-1]
    if width >= vocab_size:
        values, token_ids = logits.sort(dim=-1, descending=True, stable=True)
    else:
        values, token_ids = logits.topk(width, dim=-1)
        # topk leaves the order of equal values open: put them in token-id order, as argmax does.
        token_ids, order = token_ids.sort(dim=-1)
        values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
        token_ids = token_ids.gather(-1, order)
    ranks = torch.arange(width, device=logits.device)
    keep = ranks[None, :] < top_k[:, None]
    if top_p is None:
        return keep, token_ids
    values = values.masked_fill(~keep, float("-inf"))
    # Probabilities renormalised over the top-k; over the whole vocabulary for rows without top_k.
    has_top_k = top_k < vocab_size
    log_norm = torch.where(has_top_k, values.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (values - log_norm[:, None]).exp()
    if width < vocab_size:
        # Every token past the candidates has at least their mass before it: if that mass reaches
        # top_p, all of them are outside the nucleus, and the candidates decide exactly.
        covered = has_top_k | (top_p >= 1.0) | (probs.sum(dim=-1) >= top_p)
        if not bool(covered.all()):
            return None, token_ids
    # Keep a token while the mass of the more likely tokens before it is below top_p (vLLM's
    # rule). The most likely token has mass 0 before it, so it is always kept (top_p > 0); rows
    # with top_p = 1 keep everything, even where the rounded mass reaches 1.
    mass_before = probs.cumsum(dim=-1) - probs
    return keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)), token_ids


def token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """For each row of `logprobs` `[N, V]`: the given token's logprob and rank (1 = most likely; tokens
    tied with it count as ahead, as in vLLM), then the row's `num_top[i]` most likely tokens."""
    token_ids = token_ids.to(logprobs.device, torch.int64)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs >= chosen).sum(dim=-1)
    k = max(num_top, default=0)
    top_vals = top_ids = []
    if k > 0:
        vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    out = []
    for i, (tok, lp, rank) in enumerate(zip(token_ids.tolist(), chosen[:, 0].tolist(), ranks.tolist())):
        n = num_top[i]
        top = [Logprob(t, v, r + 1) for r, (t, v) in enumerate(zip(top_ids[i][:n], top_vals[i][:n]))] if n else []
        out.append(TokenLogprobs(chosen=Logprob(tok, lp, rank), top=top))
    return out


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt: `logits[i]` is the model's output at position i, `target_ids[i]` the
    prompt token that follows it. Returns one entry per position with `num_top` top tokens."""
    assert logits.dim() == 2 and target_ids.shape == (logits.shape[0],), (logits.shape, target_ids.shape)
    if logits.shape[0] == 0:
        return []
    return token_logprobs(torch.log_softmax(logits.float(), dim=-1), target_ids, [num_top] * logits.shape[0])

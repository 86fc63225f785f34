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

`SamplingBatch.from_requests` turns the Python-side requests into per-row tensors once per step
(copied without waiting for the device, which may still run the step before);
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

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from pagoda_engine.core.request import Request
from pagoda_engine.messages import Logprob, TokenLogprobs
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.worker.compile_ahead import compile_ahead

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 values (wrapping arithmetic, as in the reference)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request at its `step`-th output token. A fixed mixing function
    (not Python's `hash`), so the same request samples the same tokens in every process and release."""
    mixed = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64)) ^ np.uint64(step & _MASK64)
    return int(_splitmix64(mixed)[0])


SEED_MASK = (1 << 63) - 1  # seeds are int64 on the device: 63 random bits


def row_seeds(stream_seed: int, first_draw: int, num_rows: int) -> np.ndarray:
    """int64 `[num_rows]`: the Philox seeds of draws `first_draw, first_draw + 1, …` of an unseeded
    stream (splitmix64 of the stream seed plus the draw number: distinct, well-mixed keys)."""
    draws = np.arange(first_draw, first_draw + num_rows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        draws += np.uint64(stream_seed & _MASK64)
    return (_splitmix64(draws) & np.uint64(SEED_MASK)).astype(np.int64)


@dataclass
class SamplingBatch:
    """One step's sampling inputs as per-row tensors on the logits' device. Row i is request i.

    Fields that a step does not need are None, and the sampler skips the work they stand for.
    """

    num_rows: int
    vocab_size: int
    device: torch.device
    # Greedy vs random. `random_rows` indexes the non-greedy rows; the per-row sampling tensors
    # below are for those rows only, in that order.
    all_greedy: bool
    all_random: bool  # no greedy row: the random rows are all rows, in order
    random_rows: torch.Tensor | None  # int64 [R]
    temperature: torch.Tensor | None  # float32 [R], None when every random row's temperature is 1
    min_p: torch.Tensor | None  # float32 [R], None when no random row uses min_p
    top_k: torch.Tensor | None  # int64 [R] in 1..V (V = off), None when no random row uses top_k
    max_top_k: int  # the largest top_k in use (0 = none), known on the host without a device sync
    top_p: torch.Tensor | None  # float32 [R], None when no random row uses top_p
    filtered: list[bool]  # per random row: it uses top_k, top_p or min_p
    # Seeded random rows: (index into the random rows, seed for this step). Empty = all unseeded.
    seeded: list[tuple[int, int]]
    # Penalties over all rows, None when no row has any.
    repetition_penalty: torch.Tensor | None  # float32 [B]
    frequency_penalty: torch.Tensor | None  # float32 [B]
    presence_penalty: torch.Tensor | None  # float32 [B]
    output_counts: torch.Tensor | None  # float32 [B, V]: occurrences of each token in the output
    seen_mask: torch.Tensor | None  # bool [B, V]: token occurs in prompt or output
    # min_tokens: logits[min_tokens_rows[j], min_tokens_ids[j]] = -inf. None when nothing is masked.
    min_tokens_rows: torch.Tensor | None  # int64 [M]
    min_tokens_ids: torch.Tensor | None  # int64 [M]
    # Logprobs: per row the number of top logprobs wanted, None for rows that want none.
    num_logprobs: list[int | None]
    # Structured outputs: the constrained rows and their allowed tokens (bit t of row j's words:
    # token t allowed), int32 [G, ceil(V / 32)] filled by their grammars on the host. None: no row.
    grammar_rows: torch.Tensor | None = None  # int64 [G]
    grammar_bitmask: torch.Tensor | None = None  # int32 [G, W]
    # logit_bias: logits[logit_bias_rows[j], logit_bias_ids[j]] += logit_bias_values[j]. None: no row.
    logit_bias_rows: torch.Tensor | None = None  # int64 [L]
    logit_bias_ids: torch.Tensor | None = None  # int64 [L]
    logit_bias_values: torch.Tensor | None = None  # float32 [L]

    @property
    def needs_logprobs(self) -> bool:
        return any(n is not None for n in self.num_logprobs)

    @property
    def only_draw_reads_logits(self) -> bool:
        """No logprobs, penalties, masks or biases: nothing but the draw itself reads the logits."""
        return (not self.needs_logprobs and self.repetition_penalty is None and self.min_tokens_rows is None
                and self.grammar_rows is None and self.logit_bias_rows is None)

    @classmethod
    def from_requests(cls, reqs: list[Request], vocab_size: int, device: torch.device) -> SamplingBatch:
        device = torch.device(device)
        params = [r.sampling_params for r in reqs]
        num_rows = len(reqs)
        num_logprobs = [p.logprobs for p in params]

        random_idx = [i for i, p in enumerate(params) if not p.greedy]
        all_greedy = not random_idx
        random_rows = temperature = min_p = top_k = top_p = None
        max_top_k = 0
        seeded: list[tuple[int, int]] = []
        filtered: list[bool] = []
        if not all_greedy:
            rparams = [params[i] for i in random_idx]
            filtered = [0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0 for p in rparams]
            random_rows = _to_device(random_idx, torch.int64, device)
            if any(p.temperature != 1.0 for p in rparams):  # dividing by 1 changes nothing: skip it
                temperature = _to_device([p.temperature for p in rparams], torch.float32, device)
            if any(p.min_p > 0 for p in rparams):
                min_p = _to_device([p.min_p for p in rparams], torch.float32, device)
            row_top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in rparams]
            max_top_k = max((k for k in row_top_k if k < vocab_size), default=0)
            if max_top_k:
                top_k = _to_device(row_top_k, torch.int64, device)
            if any(p.top_p < 1.0 for p in rparams):
                top_p = _to_device([p.top_p for p in rparams], torch.float32, device)
            # The output index counts tokens still in flight (async scheduling).
            seeded = [(j, step_seed(params[i].seed, reqs[i].num_output_tokens + reqs[i].num_output_placeholders))
                      for j, i in enumerate(random_idx) if params[i].seed is not None]

        repetition = frequency = presence = output_counts = seen_mask = None
        if any(p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
               for p in params):
            repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
            presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
            outputs = _flat_token_index([np.array(r.output_token_ids, dtype=np.int64) for r in reqs],
                                        vocab_size, device)
            output_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
            output_counts.index_add_(0, outputs, torch.ones(outputs.shape, dtype=torch.float32, device=device))
            output_counts = output_counts.view(num_rows, vocab_size)
            seen_mask = output_counts > 0
            seen_mask.view(-1)[_flat_token_index([_prompt_array(r) for r in reqs], vocab_size, device)] = True

        mask_rows: list[int] = []
        mask_ids: list[int] = []
        for i, (r, p) in enumerate(zip(reqs, params)):
            if r.num_output_tokens + r.num_output_placeholders < p.min_tokens:
                # vLLM masks `all_stop_token_ids`: the stop token ids plus every EOS id, ignore_eos or
                # not (an EOS sampled under ignore_eos would not stop, but vLLM still keeps it out).
                ids = {t for t in (*p.stop_token_ids, *r.eos_token_ids) if 0 <= t < vocab_size}
                mask_rows.extend([i] * len(ids))
                mask_ids.extend(sorted(ids))
        min_tokens_rows = min_tokens_ids = None
        if mask_rows:
            min_tokens_rows = _to_device(mask_rows, torch.int64, device)
            min_tokens_ids = _to_device(mask_ids, torch.int64, device)

        grammar_rows = grammar_bitmask = None
        grammar_idx = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if grammar_idx:
            from pagoda_engine.structured_outputs import fill_bitmask

            grammar_rows = _to_device(grammar_idx, torch.int64, device)
            grammar_bitmask = _to_device(fill_bitmask([reqs[i].grammar for i in grammar_idx], vocab_size),
                                         torch.int32, device)

        bias_rows, bias_ids, bias_values = [], [], []
        for i, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                if token_id < vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(token_id)
                    bias_values.append(bias)
        logit_bias_rows = logit_bias_ids = logit_bias_values = None
        if bias_rows:
            logit_bias_rows = _to_device(bias_rows, torch.int64, device)
            logit_bias_ids = _to_device(bias_ids, torch.int64, device)
            logit_bias_values = _to_device(bias_values, torch.float32, device)

        return cls(num_rows=num_rows, vocab_size=vocab_size, device=device, all_greedy=all_greedy,
                   all_random=len(random_idx) == num_rows,
                   random_rows=random_rows, temperature=temperature, min_p=min_p, top_k=top_k,
                   max_top_k=max_top_k, top_p=top_p, filtered=filtered,
                   seeded=seeded, repetition_penalty=repetition, frequency_penalty=frequency,
                   presence_penalty=presence, output_counts=output_counts, seen_mask=seen_mask,
                   min_tokens_rows=min_tokens_rows, min_tokens_ids=min_tokens_ids, num_logprobs=num_logprobs,
                   grammar_rows=grammar_rows, grammar_bitmask=grammar_bitmask, logit_bias_rows=logit_bias_rows,
                   logit_bias_ids=logit_bias_ids, logit_bias_values=logit_bias_values)


def _to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or array) as a tensor on `device`. On CUDA through pinned memory and a
    non-blocking copy: a plain copy would wait for every kernel queued before it (a whole step,
    under async scheduling)."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


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
            gen.manual_seed(self.seed & _MASK64)
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
            rows = _to_device(plain, torch.int64, logits.device)
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
    reqs = [Request(request_id=f"warm-up-{i}", prompt_token_ids=[0], sampling_params=p) for i, p in enumerate(paths)]
    logits = torch.zeros(len(reqs), vocab_size, dtype=dtype, device=device)
    for rows in (reqs[:1], reqs[1:2], reqs):  # all greedy, all plain, mixed
        sampler.sample(logits[:len(rows)], SamplingBatch.from_requests(rows, vocab_size, device))


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

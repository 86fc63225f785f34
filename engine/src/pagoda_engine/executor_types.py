"""The plain data that crosses the engine core's boundary with its executor, both ways: what a
step hands every rank (`AttentionBatch`, `SamplingBatch`, beside the input tensors), the KV page
layout (`KVCacheSpec`) and what rank 0's device is (`DeviceFacts`, which the config's device
defaults are resolved from); and the few rules both sides must apply alike: a seeded row's seed
at each step (`step_seed`), host-to-device copies that do not wait for the device
(`host_to_device`), and where a tensor packed after another may start (`aligned_numel`).

The engine core (`core/`) builds these from its requests; the workers (`worker/`) read them and
run the device. This module imports neither side, so both can import it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagoda_engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class DeviceFacts:
    """What the engine core needs to know about rank 0's device (`worker.executor.probe_device`):
    the config's defaults are resolved from it (`config.resolve_for_device`), and the core's steps
    follow it. On a GPU every field is what it says; on CPU a step has ended when its launch
    returns, and no kernel compiles."""

    device: str  # where rank 0 runs: "cuda:0", "cpu"
    kind: str  # its type: "cuda", "cpu"
    # A launched step runs on the device after its launch returns, and an event recorded behind it
    # tells when it has ended: async scheduling's default, step launch pacing, early publishing.
    steps_run_ahead: bool
    # A step of a new shape pays one-time costs on its first run (kernel variants, plans): the core
    # runs warm-up steps before it serves (`core.warm_up`).
    first_steps_pay_once: bool
    total_memory: int = 0  # bytes of device memory (0: host memory, not sized here)
    name: str = ""  # the device's name ("NVIDIA H200")
    collectives: str = "gloo"  # the ranks' process groups' backend (`parallel_state.dist_backend`)
    # The attention backend "auto" picks here can replay CUDA graphs (FlashInfer is installed).
    graph_attention: bool = False


@dataclass
class AttentionBatch:
    """CPU-side metadata for one step, built by the engine core (`core.step_runner`).

    Requests are in batch order and their new tokens are concatenated in that order. The first
    `num_decodes` requests are decodes (query_len == 1 with at least one cached token before it);
    the rest are prefill chunks (which may start after cached tokens: prefix hits, chunked prefill).
    """

    query_lens: list[int]  # new tokens per request in this step
    seq_lens: list[int]  # tokens in the cache after this step (cached + new), per request
    page_tables: list[list[int]]  # page ids per request, covering at least seq_len tokens
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the device: page * page_size + offset per new token
    num_decodes: int = 0
    # --enable-lora: each request's adapter slot on the device (-1: the base model); None: all base.
    lora_slots: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)


# --kv-cache-dtype's values and the page dtype each names (None: the model's dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def kv_page_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV pages for `--kv-cache-dtype` with a model computing in `model_dtype`."""
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


@dataclass
class DraftStep:
    """One forward of the drafting model (`DraftPlan`), as host lists: rows in batch order, decodes
    (one token after cached ones) first, as `AttentionBatch` wants them."""

    query_lens: list[int]
    seq_lens: list[int]
    page_tables: list[list[int]]
    positions: list[int]  # per token
    slots: list[int]  # per token: page * page_size + offset, in the target's page ids
    num_decodes: int
    requests: list[int]  # per row: the plan's request index; the row's last token drafts that request's next token
    # The first step: the tokens fed (per token). A later step feeds each row the token the step
    # before drafted for its request: `from_rows`, that row's index in the step before.
    token_ids: list[int] | None = None
    from_rows: list[int] | None = None
    # EAGLE-3's first step: the slot of each token's target hidden state (where `slots` writes the
    # token's KV elsewhere: a shared page's last entry, `core/draft_proposer.py`).
    feature_slots: list[int] | None = None
    # A forward that only writes the drafting KV (a long catch-up's earlier part): nothing drafted.
    writes_only: bool = False


@dataclass
class DraftPlan:
    """What a draft-model or EAGLE-3 proposer runs on rank 0 for one engine step
    (`worker.drafter.Drafter.propose`): a first step catches each request's drafting KV up to its
    last known token (after forwards that only write KV, where that is longer than a step's token
    budget) and drafts its first token; each later step drafts one more. A request drafting fewer
    tokens leaves the later steps. Positions and pages are the target's: the drafter keeps its
    KV in the same page ids (`core/draft_proposer.py` says why)."""

    num_requests: int
    num_tokens: int  # the most tokens any request drafts (the number of steps)
    steps: list[DraftStep]


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # per TP rank
    num_qo_heads: int  # per TP rank
    head_dim: int
    page_size: int
    dtype: torch.dtype  # the pages' (float8_e4m3fn under --kv-cache-dtype fp8)
    # The queries' and outputs' dtype, the model's; None: the pages'.
    compute_dtype: torch.dtype | None = None
    # FP8 pages: each of this stage's layers' K and V scale (stored value = value / scale, as vLLM
    # and the checkpoints that carry them define it). Empty: 1.0 for every layer.
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    @property
    def query_dtype(self) -> torch.dtype:
        return self.compute_dtype or self.dtype

    @property
    def quantized(self) -> bool:
        """Pages in FP8: K and V are scaled and rounded as they are written."""
        return self.dtype == torch.float8_e4m3fn

    def kv_scales(self, layer_id: int) -> tuple[float, float]:
        """(k_scale, v_scale) of this stage's `layer_id`-th layer: 1.0 for pages in the model's dtype."""
        if not self.quantized:
            return 1.0, 1.0
        return (self.k_scales[layer_id] if self.k_scales else 1.0,
                self.v_scales[layer_id] if self.v_scales else 1.0)

    def bytes_per_page(self) -> int:
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


MASK64 = (1 << 64) - 1


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 values (wrapping arithmetic, as in the reference)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request at its `step`-th output token. A fixed mixing function
    (not Python's `hash`), so the same request samples the same tokens in every process and release."""
    mixed = splitmix64(np.array([seed & MASK64], dtype=np.uint64)) ^ np.uint64(step & MASK64)
    return int(splitmix64(mixed)[0])


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
    def from_params(cls, params: list[SamplingParams], vocab_size: int, device: torch.device,
                    output_steps: list[int] | None = None) -> SamplingBatch:
        """The rows' sampling settings (greedy or random, temperature, min_p, top-k, top-p, seeds,
        logit_bias, logprobs); `output_steps[i]`: row i's output index (its seed's step, 0 when not
        given). Penalties, min_tokens and grammars need the requests' tokens: the engine core adds
        them (`core.sampling_batch`)."""
        device = torch.device(device)
        num_rows = len(params)
        random_idx = [i for i, p in enumerate(params) if not p.greedy]
        random_rows = temperature = min_p = top_k = top_p = None
        max_top_k = 0
        seeded: list[tuple[int, int]] = []
        filtered: list[bool] = []
        if random_idx:
            rparams = [params[i] for i in random_idx]
            filtered = [0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0 for p in rparams]
            random_rows = to_device(random_idx, torch.int64, device)
            if any(p.temperature != 1.0 for p in rparams):  # dividing by 1 changes nothing: skip it
                temperature = to_device([p.temperature for p in rparams], torch.float32, device)
            if any(p.min_p > 0 for p in rparams):
                min_p = to_device([p.min_p for p in rparams], torch.float32, device)
            row_top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in rparams]
            max_top_k = max((k for k in row_top_k if k < vocab_size), default=0)
            if max_top_k:
                top_k = to_device(row_top_k, torch.int64, device)
            if any(p.top_p < 1.0 for p in rparams):
                top_p = to_device([p.top_p for p in rparams], torch.float32, device)
            seeded = [(j, step_seed(params[i].seed, output_steps[i] if output_steps else 0))
                      for j, i in enumerate(random_idx) if params[i].seed is not None]

        bias_rows, bias_ids, bias_values = [], [], []
        for i, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                if token_id < vocab_size:
                    bias_rows.append(i)
                    bias_ids.append(token_id)
                    bias_values.append(bias)
        logit_bias_rows = logit_bias_ids = logit_bias_values = None
        if bias_rows:
            logit_bias_rows = to_device(bias_rows, torch.int64, device)
            logit_bias_ids = to_device(bias_ids, torch.int64, device)
            logit_bias_values = to_device(bias_values, torch.float32, device)

        return cls(num_rows=num_rows, vocab_size=vocab_size, device=device, all_greedy=not random_idx,
                   all_random=len(random_idx) == num_rows, random_rows=random_rows, temperature=temperature,
                   min_p=min_p, top_k=top_k, max_top_k=max_top_k, top_p=top_p, filtered=filtered, seeded=seeded,
                   repetition_penalty=None, frequency_penalty=None, presence_penalty=None, output_counts=None,
                   seen_mask=None, min_tokens_rows=None, min_tokens_ids=None,
                   num_logprobs=[p.logprobs for p in params], logit_bias_rows=logit_bias_rows,
                   logit_bias_ids=logit_bias_ids, logit_bias_values=logit_bias_values)


def to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list (or array) as a tensor on `device`. On CUDA through pinned memory and a
    non-blocking copy: a plain copy would wait for every kernel queued before it (a whole step,
    under async scheduling)."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    return host_to_device(t, device)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, without waiting for the device (pinned, non-blocking, on CUDA)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


# Triton specialises kernels on their pointers' 16-byte alignment: a tensor packed after another
# in one buffer (a step's positions after an odd number of int64 input ids) would make the first
# step of each parity compile a second variant, on a live step.
ALIGN_BYTES = 16


def aligned_numel(numel: int, dtype: torch.dtype) -> int:
    """`numel` rounded up to whole `ALIGN_BYTES` of `dtype`: where the next tensor packed into the
    same buffer may start."""
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    return -(-numel // per) * per

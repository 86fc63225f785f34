"""Batch → tensors → the executor's ranks → sampled tokens, for one step: the engine core's side.

The runner turns the scheduler's decision into flat, ragged tensors (input ids, positions, slot
mapping) plus the attention backend's plan (`AttentionBatch`) and the sampling rows
(`SamplingBatch`), has every rank run the model once (`Executor.execute_model`), and samples one
token for every request whose known tokens are now all computed. Decodes go first in the batch.
The ranks see only those plain descriptions and tensors (`executor_types`), never a request.

Speculative decoding: a request verifying drafts feeds its last token and the drafts, and samples
at every one of those positions (`core.spec_decode.verification_rows`); its tokens come back in
`RunnerOutput.verified`. Such a row is not a one-token decode: the ranks replay a verification
graph where the step fits one (`worker.verify_graphs`), else run it as a prefill step (piecewise
CUDA graphs up to their size, else eagerly).

`launch` queues a step and returns it unresolved (`LaunchedStep`); `execute` is launch + resolve.
Under async scheduling the next step is launched before the last one is resolved: a decode whose
input token is still in flight (an output placeholder) reads it from the previous step's sampled
tensor on the device, so nothing waits for the host.

Which steps replay CUDA graphs is each rank's choice (`worker.cuda_graphs`): the same on every
rank, from the step's shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.lora import LoRASlots
from pagoda_engine.core.request import Request
from pagoda_engine.core.sampling_batch import sampling_batch
from pagoda_engine.core.scheduler import ScheduledRequest, SchedulerOutput
from pagoda_engine.core.spec_decode import verification_rows
from pagoda_engine.executor_types import AttentionBatch, aligned_numel, host_to_device
from pagoda_engine.messages import TokenLogprobs
from pagoda_engine.worker.executor import ArrivingSample, Executor, PendingSample, StepEnd

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    """One step's batch: what every rank gets (the input ids, positions and sample rows on the
    device, and the attention plan's `AttentionBatch`), and what the core keeps of it (the batch
    order, the requests that sample, the prompt-logprob spans)."""

    order: list[ScheduledRequest]  # batch order: decodes first
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_batch: AttentionBatch
    sample_rows: torch.Tensor  # token index of each sampling request's last token (each verified position)
    sample_reqs: list[Request]  # the request of each sample row (a verifying one once per position)
    sample_views: list[Request]  # what each row samples as (`verification_rows` for verified positions)
    sample_drafts: list[list[int]] | None  # the drafts before each row's position, where a step verifies
    # request id -> (first token index in the batch, number of positions) for prompt logprobs
    prompt_logprob_spans: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: a verifying request's token at each drafted position and the one
    # after (and their logprobs, where asked).
    verified: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not read yet. Under pipeline
    parallelism the last stage samples, and its tokens may still be on their way: `sample` then
    reads them once they are here (at `resolve`)."""

    sched: SchedulerOutput
    sample_reqs: list[Request]
    sample: PendingSample | ArrivingSample | None
    prompt_logprobs: dict[str, list[TokenLogprobs]]
    verifying: frozenset[str] = frozenset()  # ids of the requests verifying drafts
    ended: StepEnd | None = None  # after rank 0's work for the step (with `StepRunner.record_ends`)
    _rows: dict[Request, int] | None = field(default=None, init=False, repr=False)

    def sample_row(self, req: Request) -> int:
        """The row of `req`'s token in `sample.token_ids`."""
        if self._rows is None:
            self._rows = {r: i for i, r in enumerate(self.sample_reqs)}
        return self._rows[req]

    def has_ended(self) -> bool | None:
        """Whether the device has finished the step (None: not known without waiting)."""
        return None if self.ended is None else self.ended.query()

    def resolve(self) -> RunnerOutput:
        """Wait for the step and read its tokens (and logprobs) back."""
        out = RunnerOutput(prompt_logprobs=self.prompt_logprobs)
        if self.sample is not None:
            result = self.sample.resolve()
            for req, token, lp in zip(self.sample_reqs, result.token_ids, result.logprobs):
                rid = req.request_id
                if rid in self.verifying:
                    out.verified.setdefault(rid, []).append(token)
                    out.verified_logprobs.setdefault(rid, []).append(lp)
                    continue
                out.sampled[rid] = token
                if lp is not None:
                    out.logprobs[rid] = lp
        return out


class StepRunner:
    """Builds each step's inputs from the scheduler's output and launches it on the executor's
    ranks (rank 0 in this process): the forward, prompt logprobs where asked, then the sample."""

    def __init__(self, executor: Executor, kv: KVCacheManager, vocab_size: int, record_ends: bool = False,
                 lora: LoRASlots | None = None):
        self.executor = executor
        self.lora = lora  # --enable-lora: each request's adapter slot goes to the ranks with the batch
        self.kv = kv
        self.device = executor.device
        self.page_size = kv.page_size
        self.vocab_size = vocab_size
        # Each step records `LaunchedStep.ended` (step launch pacing and early publishing read it).
        self.record_ends = record_ends

    def prepare(self, sched: SchedulerOutput, prev: LaunchedStep | None = None) -> StepInputs:
        """`prev`: the step still in flight, whose sampled tokens feed this step's placeholder decodes."""
        def is_decode(s: ScheduledRequest) -> bool:
            return s.num_new_tokens == 1 and s.request.num_computed_tokens > 0

        order = [s for s in sched.scheduled if is_decode(s)] + [s for s in sched.scheduled if not is_decode(s)]
        num_decodes = sum(1 for s in order if is_decode(s))
        # Plain Python lists for the per-token arrays: a step is mostly single-token decodes, for
        # which small numpy arrays cost more than they save. One host-to-device copy at the end.
        ids, pos, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        sample_rows, sample_reqs, sample_views, sample_drafts, spans = [], [], [], [], {}
        fed_at, fed_from = [], []
        page_size = self.page_size
        offset = 0
        for s in order:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            table = self.kv.page_ids(req.request_id)
            if req.num_output_placeholders:
                # A decode of the token the step in flight samples: filled in on the device below.
                assert n == 1 and start == req.num_tokens and prev is not None, req.request_id
                fed_at.append(offset)
                fed_from.append(prev.sample_row(req))
                ids.append(0)
            else:
                ids += _new_token_ids(req, start, n - len(s.draft_token_ids)) + s.draft_token_ids
            if n == 1:
                pos.append(start)
                slots.append(table[start // page_size] * page_size + start % page_size)
            else:
                positions = np.arange(start, start + n, dtype=np.int64)
                pos += positions.tolist()
                slots += (np.asarray(table, dtype=np.int64)[positions // page_size] * page_size
                          + positions % page_size).tolist()
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                spans[req.request_id] = (offset, min(n, req.num_prompt_tokens - 1 - start))
            if s.draft_token_ids:
                views = verification_rows(req, s.draft_token_ids)
                sample_rows += range(offset + n - len(views), offset + n)
                sample_reqs += [req] * len(views)
                sample_views += views
                sample_drafts += [s.draft_token_ids[:j] for j in range(len(views))]
            elif s.completes_sequence:
                sample_rows.append(offset + n - 1)
                sample_reqs.append(req)
                sample_views.append(req)
                sample_drafts.append([])
            offset += n
        # Each per-token segment starts aligned (`aligned_numel`): after an odd token count
        # the positions started 8 bytes off, a kernel variant that a fresh server compiled during
        # a live step (about 200 ms, on an H100 its first 1,025-token step).
        t, r, f = offset, len(sample_rows), len(fed_at)
        span = aligned_numel(t, torch.int64)
        pad = [0] * (span - t)
        host = torch.tensor(ids + pad + pos + pad + slots + pad + sample_rows + fed_at + fed_from, dtype=torch.int64)
        dev = host_to_device(host, self.device)
        rest = 3 * span
        input_ids = dev[:t]
        if f:
            input_ids.index_copy_(0, dev[rest + r:rest + r + f], prev.sample.token_ids[dev[rest + r + f:]])
        lora_slots = None
        if self.lora is not None and any(s.request.lora_request is not None for s in order):
            lora_slots = self.lora.slots_for(s.request.lora_request for s in order)
        attn_batch = AttentionBatch(query_lens=query_lens, seq_lens=seq_lens, page_tables=tables,
                                    slot_mapping=dev[2 * span:2 * span + t], num_decodes=num_decodes,
                                    lora_slots=lora_slots)
        return StepInputs(order=order, input_ids=input_ids, positions=dev[span:span + t], attn_batch=attn_batch,
                          sample_rows=dev[rest:rest + r], sample_reqs=sample_reqs, sample_views=sample_views,
                          sample_drafts=sample_drafts if any(sample_drafts) else None, prompt_logprob_spans=spans)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.launch(sched).resolve()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None = None,
               layer_hook: Callable[[int], None] | None = None) -> LaunchedStep:
        """Queue the step on the device; `prev` is the step in flight (async scheduling).
        `layer_hook`: rank 0's attention backend calls it with the layer's index before each
        layer's attention while this step's forward is launched (once its inputs are prepared)."""
        inputs = self.prepare(sched, prev)
        # The hidden states stay on the ranks: the logits are computed from rows of them.
        self.executor.execute_model(inputs.input_ids, inputs.positions, inputs.attn_batch, layer_hook=layer_hook)
        prompt_logprobs = {}
        # Prompt logprobs are read back here (a sync): such steps are not overlapped.
        for rid, (first, count) in inputs.prompt_logprob_spans.items():
            req = next(s.request for s in inputs.order if s.request.request_id == rid)
            start = req.num_computed_tokens
            targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + count], device=self.device)
            prompt_logprobs[rid] = self.executor.prompt_logprobs(torch.arange(first, first + count, device=self.device),
                                                                 targets, req.sampling_params.prompt_logprobs)
        sample = None
        if inputs.sample_reqs:
            # Under pipeline parallelism the last stage samples; its tokens are read when they
            # arrive, so that the core can launch the next batch meanwhile (the batch queue).
            sample = self.executor.sample(inputs.sample_rows,
                                          sampling_batch(inputs.sample_views, self.vocab_size, self.device,
                                                         inputs.sample_drafts))
        ended = self.executor.mark_step_end() if self.record_ends else None
        verifying = frozenset(s.request.request_id for s in sched.scheduled if s.draft_token_ids)
        return LaunchedStep(sched=sched, sample_reqs=inputs.sample_reqs, sample=sample,
                            prompt_logprobs=prompt_logprobs, ended=ended, verifying=verifying)


def _new_token_ids(req: Request, start: int, n: int) -> list[int]:
    """The request's tokens [start, start + n) without building prompt + output in full."""
    num_prompt = req.num_prompt_tokens
    if start >= num_prompt:
        return req.output_token_ids[start - num_prompt:start - num_prompt + n]
    if start + n <= num_prompt:
        return req.prompt_token_ids[start:start + n]
    return req.all_token_ids[start:start + n]

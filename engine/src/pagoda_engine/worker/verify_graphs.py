"""Speculative decoding's verification steps as whole-forward CUDA graphs (`VerifyGraphs`).

A verification step feeds each speculating request its last token and up to k drafts: k + 1 query
rows a request. Run as a prefill step (piecewise graphs, attention eager between them, FlashInfer's
prefill planned on the host each step) it cost about 1.5 decode steps on an H200 for one request
(docs/benchmarks.md, 2026-11-28), where its GEMMs over k + 1 rows cost about what one row does.
Here such steps replay one graph of the whole forward, as a decode step does: captured once per
batch size at batch × (k + 1) rows in `verify_triton`'s padded layout (request b's new tokens
from row b × (k + 1) on, the rest of its block padding), attention by the verification kernel
over fixed buffers the backend plans into (`plan_graph_verify`). Any step whose requests each have
1 .. k + 1 new tokens fits (a request with no draft, or fewer drafts than k, pads its block): the
scheduler's verification steps, and also a batch of decodes beside short prompt chunks.

The step's tokens go into the graph's fixed inputs at their padded rows (padding rows: token 0 at
position 0, K/V into the null page), and the hidden states come back gathered from those rows in
batch order, as every other path returns them. Rows are independent through every GEMM and norm,
and a real row's attention reads only its own request's pages, so the padding changes nothing
real; `tests/engine/test_verify_graphs.py` checks the layout's forward against the packed one on
CPU, `tests/gpu/test_spec_decode_gpu.py` the graphs.

One rank's graphs; under tensor parallelism every rank captures the same sizes in the same order
and picks the same graph from the step's shape. Not under pipeline parallelism (speculation is
refused there) and not for an EAGLE-3 drafter (its target steps run eagerly, `Worker._graphs_for`).
"""

from __future__ import annotations

import time

import torch

from pagoda_engine.worker.attention.base import AttentionBackend, AttentionBatch
from pagoda_engine.worker.compile_ahead import compile_ahead
from pagoda_engine.worker.cuda_graphs import stage_forward

# Requests a verification graph holds at most: speculation pays at low load, and each size's
# kernel scratch grows with it (`verify_triton.VerifyDecode`).
MAX_VERIFY_BATCH = 16


def verify_batch_sizes(decode_batch_sizes: list[int], disable_by_batch_size: int | None) -> list[int]:
    """The decode graphs' batch sizes a verification graph is captured at: up to
    `MAX_VERIFY_BATCH`, and up to the first that holds `disable_by_batch_size` requests (steps
    with more running requests do not speculate)."""
    cap = MAX_VERIFY_BATCH
    if disable_by_batch_size is not None:
        cap = min(cap, next((s for s in sorted(decode_batch_sizes) if s >= disable_by_batch_size), cap))
    return [s for s in sorted(decode_batch_sizes) if s <= cap]


def fits_verify(batch: AttentionBatch, query_len: int, max_batch_size: int) -> bool:
    """A step a verification graph of `query_len` rows a request can run: at most `max_batch_size`
    requests of at most `query_len` new tokens each, not all of them one (decode graphs take those)."""
    lens = batch.query_lens
    return 0 < len(lens) <= max_batch_size and max(lens) <= query_len and batch.num_tokens > len(lens)


def verify_dummy(batch_size: int, query_len: int, page_size: int, device: torch.device) -> AttentionBatch:
    """A batch of `batch_size` whole sequences of `query_len` tokens on the null page, to capture with."""
    pages = [0] * -(-query_len // page_size)
    return AttentionBatch(query_lens=[query_len] * batch_size, seq_lens=[query_len] * batch_size,
                          page_tables=[pages] * batch_size,
                          slot_mapping=torch.zeros(batch_size * query_len, dtype=torch.int64, device=device))


class VerifyGraphs:
    """The forward of verification steps, one CUDA graph per batch size (see the module)."""

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, device: torch.device,
                 batch_sizes: list[int], query_len: int, max_pages_per_seq: int, pool: tuple,
                 compile_first: bool = False):
        if not (model.is_first_stage and model.is_last_stage):
            raise ValueError("verification graphs run the whole model: not under pipeline parallelism")
        self.model, self.attn, self.query_len = model, attn, query_len
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        attn.init_verify_buffers(self.max_batch_size, query_len, max_pages_per_seq)
        rows = self.max_batch_size * query_len
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        page_size = attn.spec.page_size
        dummies = {bs: verify_dummy(bs, query_len, page_size, device) for bs in self.batch_sizes}
        started = time.monotonic()
        with torch.inference_mode(), compile_ahead(device, "the verification graphs", compile_first) as ahead:
            for bs in self.batch_sizes if ahead else ():  # smallest first, as `DecodeGraphs`
                attn.plan_graph_verify(dummies[bs], bs)
                self._forward(bs)
        if ahead:
            torch.cuda.empty_cache()
        compiled = time.monotonic()
        with torch.inference_mode():
            for bs in reversed(self.batch_sizes):  # largest first: the smaller reuse its pool memory
                attn.plan_graph_verify(dummies[bs], bs)
                self._forward(bs)  # warm-up: lazy inits stay out of the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self._forward(bs)
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.seconds = (compiled - started if ahead else 0.0, time.monotonic() - compiled)  # as DecodeGraphs'

    def _forward(self, bs: int) -> torch.Tensor:
        rows = bs * self.query_len
        return stage_forward(self.model, self.input_ids[:rows], self.positions[:rows], self.attn, None)

    def fits(self, batch: AttentionBatch) -> bool:
        return fits_verify(batch, self.query_len, self.max_batch_size)

    def padded_size(self, num_reqs: int) -> int:
        return next(s for s in self.batch_sizes if s >= num_reqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """The hidden states of the step's tokens, in batch order."""
        bs = self.padded_size(batch.num_reqs)
        rows = self.attn.plan_graph_verify(batch, bs)
        load_verify_rows(self.input_ids, self.positions, input_ids, positions, rows, bs * self.query_len)
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs].index_select(0, rows)


def load_verify_rows(id_buffer: torch.Tensor, position_buffer: torch.Tensor, input_ids: torch.Tensor,
                     positions: torch.Tensor, rows: torch.Tensor, size: int) -> None:
    """A step's token ids and positions into their padded `rows` of the graph's fixed buffers, the
    other rows of the first `size` padding: token 0 at position 0."""
    id_buffer[:size].zero_()
    position_buffer[:size].zero_()
    id_buffer.index_copy_(0, rows, input_ids)
    position_buffer.index_copy_(0, rows, positions)

"""The model's forward as CUDA graphs: whole for decode steps, piecewise for the others.

A step's host cost (hundreds of kernel launches, each through Python) would otherwise exceed its
device time whenever the batch is small. Two kinds, as vLLM's FULL_AND_PIECEWISE mode:
- `DecodeGraphs` captures the whole forward of all-decode batches, attention included, once per
  batch size; a step pads to the next captured size and replays.
- `PiecewiseGraphs` serves every other step of up to `MAX_PIECEWISE_TOKENS` tokens (prefill
  chunks, decodes mixed with them), at sizes that skip the row counts cuBLAS runs slowly
  (`drop_slow_sizes`, measured on the device before the capture): each stretch of the forward
  between two attention calls (a segment, `run_segment`) is a graph, captured once per token
  count; attention runs eagerly between them, planned for the real batch, because its work
  depends on every request's lengths. Longer steps run eagerly: their kernels outlast the launches.
Speculative decoding's verification steps (a few new tokens a request) have a third kind, whole
forwards in a padded layout: `verify_graphs.py`.
The split lives here, not in the model: a model offers its embedding, its layers' halves around
attention and its final norm (`PiecewiseModel`), the same code its eager forward runs, so a new
architecture gets piecewise graphs by writing its layers in two halves.
Each rank's `Worker` owns both: under tensor parallelism every rank captures the same sizes in
the same order (the all-reduces inside are captured too) and replays the same graphs for every
step. All graphs share one memory pool: one step replays one kind at a time, on one stream, so
what a graph frees is free for any other (only each graph's output stays reserved).

Under pipeline parallelism each stage captures its own layers' forward (`stage_forward`), at the
same sizes in the same order as every other stage, so that all stages pick the same graph and
padded size for a step. The stage-to-stage transfers stay outside the graphs (as in vLLM): a
later stage receives the stage before's (x, residual) straight into its graph's fixed input
(`StageInput`, `input_buffer`) before the replay, and a stage other than the last sends its
graph's fixed output, (x, residual) stacked [2, padded size, hidden], after it. Reusing these
buffers for the next batch of the batch queue is safe without copies: a rank runs its steps one
after another on one stream, and a send or receive is ordered with that stream both ways (NCCL's
stream waits for the graph that wrote or will read the buffer, and the stream waits for the
transfer before the next replay; host-staged gloo transfers are synchronous).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from pagoda_engine.worker.attention.base import AttentionBackend, AttentionBatch
from pagoda_engine.worker.compile_ahead import compile_ahead
from pagoda_engine.worker.model.layers import LinearBase


# Steps of more tokens run eagerly: their kernels outlast the launches. On an H100 with
# Llama-3.1-8B an eager step takes 11-17 ms to launch (more on slow hosts): a 512-token chunk ran
# 11 ms on the GPU, a 1,024-token one 21 ms (docs/benchmarks.md, 2026-11-28).
MAX_PIECEWISE_TOKENS = 512
# Above this many tokens the candidate sizes are 32 apart, and a candidate is captured only where
# no larger one runs the layer's GEMMs as fast (`drop_slow_sizes`): cuBLAS picks a slow kernel at
# some row counts (an H100 runs Llama-3.1-8B's gate/up projection at 448 rows in 293 µs, at 488-512
# in 161 µs), and a step padded past such a size is faster, not slower.
_FIXED_SIZES_UP_TO = 256
_CANDIDATE_STRIDE = 32


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """Token counts the piecewise graphs may be captured at, up to `max_tokens`: a step pads to
    the next one. Finer steps at the bottom, where padding is relatively dearest; GEMMs of up to a
    few hundred rows cost about the same whatever their row count (they read the weights). Those
    above `_FIXED_SIZES_UP_TO` are candidates that `drop_slow_sizes` may leave out."""
    sizes = [8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    sizes += list(range(_FIXED_SIZES_UP_TO + _CANDIDATE_STRIDE, MAX_PIECEWISE_TOKENS + 1, _CANDIDATE_STRIDE))
    return [s for s in sizes if s < max_tokens] + [max_tokens]


def sizes_to_measure(sizes: list[int]) -> list[int]:
    """The sizes `drop_slow_sizes` needs a cost for: those above `_FIXED_SIZES_UP_TO` tokens."""
    return [s for s in sizes if s > _FIXED_SIZES_UP_TO]


def drop_slow_sizes(sizes: list[int], cost: dict[int, float]) -> list[int]:
    """`sizes` less each candidate above `_FIXED_SIZES_UP_TO` tokens that some larger one runs at
    no more `cost` (a step of that many tokens then pads further, for less); the largest stays, so
    the graphs still reach as far. Sizes without a cost stay."""
    kept, cheapest_above = [], float("inf")
    for i, size in enumerate(reversed(sizes)):
        c = cost.get(size)
        if i == 0 or size <= _FIXED_SIZES_UP_TO or c is None or c < cheapest_above:
            kept.append(size)
        if c is not None:
            cheapest_above = min(cheapest_above, c)
    return kept[::-1]


def linear_row_costs(model: torch.nn.Module, sizes: list[int], device: torch.device,
                     dtype: torch.dtype, repeats: int = 5) -> dict[int, float]:
    """Device µs of one decoder layer's dense projections (its `LinearBase` modules' weights, this
    rank's shards, through `LinearBase.matmul`: no collective) at each of `sizes` rows of `dtype`
    activations: the median of `repeats` runs after one warm-up. What `drop_slow_sizes` compares."""
    projections = [m for m in model.layers[0].modules() if isinstance(m, LinearBase)]
    if not projections:
        return {}
    inputs = {m.in_features: torch.randn(max(sizes), m.in_features, device=device, dtype=dtype) for m in projections}
    costs = {}
    with torch.inference_mode():
        for size in sizes:
            def run():
                for m in projections:
                    m.matmul(inputs[m.in_features][:size], None)
            run()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            costs[size] = sorted(times)[len(times) // 2]
    return costs


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is always included): a
    decode batch pads to the next size, wasting at most 15 rows once batches are large."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class PiecewiseLayer(Protocol):
    """A decoder layer in two halves around its attention call."""

    def pre_attention(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before attention: (q [T, Hq, D], k, v [T, Hkv, D], residual stream [T, H]);
        the first layer gets residual None and the embeddings as x."""

    def attend(self, attn: AttentionBackend, layer_id: int, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention call between the halves (it may rotate q and k, in place)."""

    def post_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything after attention, from its output o [T, Hq, D]: (x, residual) for the next layer."""


class PiecewiseModel(Protocol):
    """A model (an nn.Module with `config.hidden_size`) the piecewise graphs can split: its
    embedding, its layers and its final norm, which its own eager forward runs too. Under
    pipeline parallelism: one stage's, whose `layers` are its own (the embedding only on the
    first stage, the final norm only on the last)."""

    layers: Sequence[PiecewiseLayer]
    is_first_stage: bool
    is_last_stage: bool

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...


def run_segment(model: PiecewiseModel, i: int, input_ids: torch.Tensor, positions: torch.Tensor,
                o: torch.Tensor | None, residual: torch.Tensor | None, received: torch.Tensor | None = None):
    """The forward between attention calls i-1 and i. Segment 0 embeds `input_ids` (on a later
    pipeline stage it starts from the (x, residual) `received` [2, T, H] from the stage before)
    and ends with layer 0's attention inputs; segment i (0 < i < num_layers) takes layer i-1's
    attention output `o` and the residual stream and ends with layer i's (q, k, v, residual); the
    last segment returns the hidden states after the final norm (on a stage other than the
    last: (x, residual) stacked [2, T, H] for the next stage)."""
    layers = model.layers
    if i == 0:
        x, residual = (model.embed(input_ids), None) if received is None else (received[0], received[1])
    else:
        x, residual = layers[i - 1].post_attention(o, residual)
    if i == len(layers):
        return model.final_norm(x, residual) if model.is_last_stage else torch.stack((x, residual))
    return layers[i].pre_attention(positions, x, residual)


def stage_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                  received: torch.Tensor | None) -> torch.Tensor:
    """A pipeline stage's forward, eager or captured: from the (x, residual) `received` [2, T, H]
    from the stage before (None on the first stage) to the hidden states on the last stage, and
    on any other to (x, residual) stacked [2, T, H], the one tensor the next stage receives."""
    out = model(input_ids, positions, attn, None if received is None else (received[0], received[1]))
    return out if isinstance(out, torch.Tensor) else torch.stack(out)


class StageInput:
    """The fixed buffer a later pipeline stage's graphs read the stage before's (x, residual)
    from: one flat tensor for up to `max_tokens` rows, seen as [2, size, hidden] for a step padded
    to `size` rows, so that a step of any size arrives as one contiguous tensor."""

    def __init__(self, model: torch.nn.Module, device: torch.device, max_tokens: int):
        self.hidden_size = model.config.hidden_size
        self.flat = torch.zeros(2 * max_tokens * self.hidden_size, dtype=next(model.parameters()).dtype,
                                device=device)

    @staticmethod
    def of(model: torch.nn.Module, device: torch.device, max_tokens: int) -> StageInput | None:
        """`model`'s stage's input buffer; None on the first stage (or without pipeline parallelism)."""
        return None if model.is_first_stage else StageInput(model, device, max_tokens)

    def view(self, size: int) -> torch.Tensor:
        return self.flat[:2 * size * self.hidden_size].view(2, size, self.hidden_size)


def load_padded(id_buffer: torch.Tensor, position_buffer: torch.Tensor, input_ids: torch.Tensor,
                positions: torch.Tensor, size: int) -> None:
    """A step's token ids and positions into the first rows of a graph's fixed buffers; rows up
    to `size` become padding: token 0 at position 0."""
    n = input_ids.shape[0]
    id_buffer[:n].copy_(input_ids)
    position_buffer[:n].copy_(positions)
    if size > n:
        id_buffer[n:size].zero_()
        position_buffer[n:size].zero_()


class DecodeGraphs:
    """The model's forward for all-decode batches, captured as one CUDA graph per batch size.

    Inputs live in fixed buffers; the attention backend plans each step into its own fixed
    buffers (`plan_graph_decode`) before the replay. Padding rows decode token 0 at position 0
    into the null page; their outputs are dropped (a pipeline stage passes them on to the next,
    whose graph of the same padded size reads them).
    """

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, device: torch.device,
                 batch_sizes: list[int], max_pages_per_seq: int, pool: tuple, compile_first: bool = False):
        if not hasattr(attn, "plan_graph_decode"):
            raise ValueError(f"attention backend {attn.name!r} cannot run in CUDA graphs")
        self.model, self.attn = model, attn
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.input_ids = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        self.received = StageInput.of(model, device, self.max_batch_size)
        self.is_last_stage = model.is_last_stage
        attn.init_graph_buffers(self.batch_sizes, max_pages_per_seq)
        # (batch size, the backend's variant): a backend may capture a size more than once, e.g.
        # with another attention kernel for short contexts (`graph_variants`).
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.replays = 0
        dummies = {bs: AttentionBatch(query_lens=[1] * bs, seq_lens=[1] * bs, page_tables=[[0]] * bs,
                                      slot_mapping=torch.zeros(bs, dtype=torch.int64, device=device), num_decodes=bs)
                   for bs in self.batch_sizes}
        started = time.monotonic()
        with torch.inference_mode(), compile_ahead(device, "the decode graphs", compile_first) as ahead:
            # Smallest first: the few-row sizes hold most of the distinct kernel variants, which
            # then compile while the rest of the pass runs.
            for bs in self.batch_sizes if ahead else ():
                for variant in attn.graph_variants(bs):
                    attn.plan_graph_decode(dummies[bs], bs, variant)
                    self._forward(bs)
        if ahead:  # the pass's activations, cached at growing sizes, go back before the capture
            torch.cuda.empty_cache()
        compiled = time.monotonic()
        with torch.inference_mode():
            # Largest first: the smaller graphs reuse the pool memory the largest one reserved.
            for bs in reversed(self.batch_sizes):
                dummy = dummies[bs]
                for variant in attn.graph_variants(bs):
                    key = (bs, attn.plan_graph_decode(dummy, bs, variant))
                    self._forward(bs)  # warm-up: lazy inits stay out of the graph
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self.outputs[key] = self._forward(bs)
                    self.graphs[key] = graph
        torch.cuda.synchronize()
        # Seconds spent compiling ahead (0 without it) and capturing.
        self.seconds = (compiled - started if ahead else 0.0, time.monotonic() - compiled)

    def _forward(self, bs: int) -> torch.Tensor:
        received = self.received.view(bs) if self.received is not None else None
        return stage_forward(self.model, self.input_ids[:bs], self.positions[:bs], self.attn, received)

    def fits(self, batch: AttentionBatch) -> bool:
        """An all-decode batch no larger than the largest graph."""
        return batch.num_decodes == batch.num_reqs <= self.max_batch_size

    def padded_size(self, num_reqs: int) -> int:
        return next(s for s in self.batch_sizes if s >= num_reqs)

    def input_buffer(self, batch: AttentionBatch) -> torch.Tensor:
        """Later pipeline stages: where the stage before's (x, residual) for `batch` must be
        received before `run`, [2, padded size, hidden]."""
        return self.received.view(self.padded_size(batch.num_reqs))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
            size: int | None = None) -> torch.Tensor:
        """The hidden states of the batch's rows; on a pipeline stage other than the last, the
        graph's fixed output for the next stage: (x, residual) [2, padded size, hidden]. `size`:
        the captured size to replay (data-parallel cores agree on one: `dp_padding.py`), by
        default the batch's own padded size."""
        n = batch.num_reqs
        bs = self.padded_size(n) if size is None else size
        load_padded(self.input_ids, self.positions, input_ids, positions, bs)
        key = (bs, self.attn.plan_graph_decode(batch, bs))
        self.graphs[key].replay()
        self.replays += 1
        return self.outputs[key][:n] if self.is_last_stage else self.outputs[key]


class SegmentBuffers:
    """Fixed buffers for running the forward one segment (`run_segment`) at a time over the
    first `size` rows, as the piecewise graphs do: token ids and positions in; each segment's q,
    k, v (copied here, so a graph pool can reuse the segment's other memory for the next one) and
    the residual stream (updated in place by the fused add+norm); the attention output the next
    segment reads. Padding rows (id 0, position 0) pass through the GEMMs and norms and are never
    attended to: their attention rows keep what an earlier step left, which no real row reads.
    On a later pipeline stage the first segment starts from `received` (`StageInput`) instead of
    the token ids.
    """

    def __init__(self, model: PiecewiseModel, attn: AttentionBackend, device: torch.device, max_tokens: int):
        self.model, self.attn = model, attn
        self.num_segments = len(model.layers) + 1
        self.received = StageInput.of(model, device, max_tokens)
        spec = attn.spec
        dtype = next(model.parameters()).dtype
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.residual = torch.zeros(max_tokens, model.config.hidden_size, dtype=dtype, device=device)
        self.attn_out = torch.zeros(max_tokens, spec.num_qo_heads, spec.head_dim, dtype=dtype, device=device)
        # q, k, v side by side per token as the fused projection lays them out: one copy in, and
        # K and V adjacent for the one-kernel K/V write.
        self.qkv = torch.zeros(max_tokens, spec.num_qo_heads + 2 * spec.num_kv_heads, spec.head_dim, dtype=dtype,
                               device=device)
        self.q, self.k, self.v = self.qkv.split([spec.num_qo_heads, spec.num_kv_heads, spec.num_kv_heads], dim=1)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, size: int) -> None:
        """A step's tokens into the first rows, padding rows up to `size`."""
        load_padded(self.input_ids, self.positions, input_ids, positions, size)

    def segment(self, i: int, size: int) -> torch.Tensor | None:
        """Segment i over the first `size` rows. The last returns the hidden states (or what a
        pipeline stage sends on); the others leave q, k, v and the residual in the buffers."""
        received = self.received.view(size) if i == 0 and self.received is not None else None
        out = run_segment(self.model, i, self.input_ids[:size], self.positions[:size],
                          self.attn_out[:size] if i else None, self.residual[:size] if i else None, received)
        if i == self.num_segments - 1:
            return out
        q, k, v, residual = out
        projected = _fused_projection(q, k, v)
        if projected is not None:
            self.qkv[:size].view(projected.shape).copy_(projected)
        else:  # q, k and v are not slices of one projection output
            self.q[:size].copy_(q)
            self.k[:size].copy_(k)
            self.v[:size].copy_(v)
        # Segment 0 (from the embeddings, or the stage before's residual); later ones update it in place.
        if residual.data_ptr() != self.residual.data_ptr():
            self.residual[:size].copy_(residual)
        return None

    def attend(self, layer_id: int, num_tokens: int) -> None:
        """Attention of layer `layer_id` over the real rows (as planned), into the output buffer."""
        n = num_tokens
        self.model.layers[layer_id].attend(self.attn, layer_id, self.positions[:n], self.q[:n], self.k[:n],
                                           self.v[:n], out=self.attn_out[:n])


class PiecewiseGraphs:
    """The forward of mixed and prefill steps of up to `max_tokens` tokens: one CUDA graph per
    segment and captured token count, over one set of `SegmentBuffers`; attention runs eagerly
    between the replays, planned for the real batch."""

    def __init__(self, model: PiecewiseModel, attn: AttentionBackend, device: torch.device, token_sizes: list[int],
                 pool: tuple, compile_first: bool = False):
        self.attn = attn
        self.token_sizes = sorted(token_sizes)
        self.max_tokens = self.token_sizes[-1]
        self.buffers = SegmentBuffers(model, attn, device, self.max_tokens)
        self.is_last_stage = model.is_last_stage
        num_segments = self.buffers.num_segments
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # The last segment's hidden states (on a pipeline stage other than the last, what it sends on), per size.
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps run
        started = time.monotonic()
        with torch.inference_mode(), compile_ahead(device, "the piecewise graphs", compile_first) as ahead:
            for size in self.token_sizes if ahead else ():  # smallest first, as `DecodeGraphs`
                for i in range(num_segments):
                    self.buffers.segment(i, size)
        if ahead:
            torch.cuda.empty_cache()
        compiled = time.monotonic()
        with torch.inference_mode():
            # Largest first: the smaller sizes reuse the pool memory the largest one reserved.
            for size in reversed(self.token_sizes):
                for i in range(num_segments):  # warm-up: lazy inits stay out of the graphs
                    self.buffers.segment(i, size)
                torch.cuda.synchronize()
                graphs = []
                for i in range(num_segments):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        out = self.buffers.segment(i, size)
                    graphs.append(graph)
                self.graphs[size] = graphs
                self.outputs[size] = out
        torch.cuda.synchronize()
        self.seconds = (compiled - started if ahead else 0.0, time.monotonic() - compiled)  # as DecodeGraphs'

    def fits(self, batch: AttentionBatch) -> bool:
        return batch.num_tokens <= self.max_tokens

    def padded_size(self, num_tokens: int) -> int:
        return next(s for s in self.token_sizes if s >= num_tokens)

    def input_buffer(self, batch: AttentionBatch) -> torch.Tensor:
        """Later pipeline stages: where the stage before's (x, residual) for `batch` must be
        received before `run`, [2, padded size, hidden]."""
        return self.buffers.received.view(self.padded_size(batch.num_tokens))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """As `DecodeGraphs.run`, per token."""
        n = batch.num_tokens
        size = self.padded_size(n)
        self.buffers.load(input_ids, positions, size)
        self.attn.plan(batch)
        graphs = self.graphs[size]
        for i, graph in enumerate(graphs[:-1]):
            graph.replay()
            self.buffers.attend(i, n)
        graphs[-1].replay()
        self.replays += 1
        return self.outputs[size][:n] if self.is_last_stage else self.outputs[size]


def _fused_projection(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The fused q/k/v projection's output [T, (Hq + 2 Hkv) * D] when q, k and v are its
    consecutive slices, else None."""
    base = q._base
    if base is None or k._base is not base or v._base is not base or base.dim() != 2 or not base.is_contiguous():
        return None
    q_width, kv_width = q.shape[1] * q.shape[2], k.shape[1] * k.shape[2]
    item = q.element_size()
    if (base.shape[1] != q_width + 2 * kv_width or q.data_ptr() != base.data_ptr()
            or k.data_ptr() != q.data_ptr() + q_width * item or v.data_ptr() != k.data_ptr() + kv_width * item):
        return None
    return base

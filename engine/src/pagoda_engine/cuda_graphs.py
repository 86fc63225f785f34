"""The model's decode forward as CUDA graphs, one per batch size.

A decode step's host cost (hundreds of kernel launches) would otherwise exceed its device time
at small batches. `DecodeGraphs` captures the forward of all-decode batches once per size; a step
pads to the next captured size and replays. The executor owns them: under tensor parallelism
every rank captures the same sizes in the same order (the all-reduces inside are captured too)
and replays the same graph for every step.
"""

from __future__ import annotations

import torch

from pagoda_engine.attention.base import AttentionBackend, AttentionBatch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_num_seqs (which is always included): a
    decode batch pads to the next size, wasting at most 15 rows once batches are large."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """The model's forward for all-decode batches, captured as one CUDA graph per batch size.

    Inputs live in fixed buffers; the attention backend plans each step into its own fixed
    buffers (`plan_graph_decode`) before the replay. Padding rows decode token 0 at position 0
    into the null page; their outputs are dropped.
    """

    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, device: torch.device,
                 batch_sizes: list[int], max_pages_per_seq: int):
        if not hasattr(attn, "plan_graph_decode"):
            raise ValueError(f"attention backend {attn.name!r} cannot run in CUDA graphs")
        self.model, self.attn = model, attn
        self.batch_sizes = sorted(batch_sizes)
        self.max_batch_size = self.batch_sizes[-1]
        self.input_ids = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch_size, dtype=torch.int64, device=device)
        attn.init_graph_buffers(self.batch_sizes, max_pages_per_seq)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            # Largest first: the smaller graphs reuse the pool memory the largest one reserved.
            for bs in reversed(self.batch_sizes):
                dummy = AttentionBatch(query_lens=[1] * bs, seq_lens=[1] * bs, page_tables=[[0]] * bs,
                                       slot_mapping=torch.zeros(bs, dtype=torch.int64, device=device),
                                       num_decodes=bs)
                attn.plan_graph_decode(dummy, bs)
                model(self.input_ids[:bs], self.positions[:bs], attn)  # warm-up: lazy inits stay out of the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = model(self.input_ids[:bs], self.positions[:bs], attn)
                self.graphs[bs] = graph
        torch.cuda.synchronize()

    def fits(self, batch: AttentionBatch) -> bool:
        """An all-decode batch no larger than the largest graph."""
        return batch.num_decodes == batch.num_reqs <= self.max_batch_size

    def padded_size(self, num_reqs: int) -> int:
        return next(s for s in self.batch_sizes if s >= num_reqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        n = batch.num_reqs
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
        self.attn.plan_graph_decode(batch, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

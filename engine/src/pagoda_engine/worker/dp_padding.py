"""Data-parallel padding (vLLM's DP padding): where the MoE layers' experts span the pod's engine
cores, every forward is a collective of all of them, and a CUDA graph replays collectives of the
sizes it was captured with. So before each forward the cores agree on its shape, in one gloo
all-gather over the cores' count group (the exchange of token counts an eager forward needs
anyway, so it costs nothing more):

- every core reports its rows and whether its step is all-decode (an idle core, running a dummy
  batch for the others, reports none);
- where every core's step is all-decode (or idle) and the largest fits the largest padded size,
  all of them run that largest count rounded up to a padded size (`common_size`): the same
  decode graph on every core, or, where no graphs were captured (CPU, gloo collectives), the
  same padded batch eagerly. Padding rows are dummy tokens (token 0 at position 0, KV into the
  null page), dropped after the forward;
- otherwise (some core prefills, or decodes more rows than the graphs hold) every core runs
  eagerly at its own count, an idle one a single dummy token, and the MoE dispatch learns every
  count from the agreement (`moe.DataParallelDispatch.set_counts`).

The padded sizes are the decode graphs' (`cuda_graphs.graph_batch_sizes`), given to every rank at
start-up (`parallel_state.DataParallelRank.padded_sizes`); none (`--enforce-eager`) turns padding
off: every forward then runs eagerly at its own count, as before graphs.
"""

from __future__ import annotations

import torch

from pagoda_engine.executor_types import AttentionBatch
from pagoda_engine.worker.model.layers import TPGroup


def common_size(reports: list[tuple[int, bool]], sizes: list[int]) -> int | None:
    """The padded size every core runs, from each core's (rows, all-decode or idle), or None: each
    core runs eagerly at its own count. `sizes`: ascending; empty: never padded."""
    if not sizes or not all(decode for _, decode in reports):
        return None
    largest = max(1, max(rows for rows, _ in reports))
    return next((s for s in sizes if s >= largest), None)


def eager_counts(reports: list[tuple[int, bool]]) -> list[int]:
    """Each core's rows in an eager forward: an idle core runs one dummy token."""
    return [rows or 1 for rows, _ in reports]


class CoreStepAgreement:
    """One rank's side of the agreement, over `group` (gloo: the ranks of its TP position in every
    core). `agree` returns the padded size of this forward, or None (then `counts` holds every
    core's rows for the eager forward)."""

    def __init__(self, group: TPGroup, sizes: list[int]):
        self.group = group
        self.sizes = sorted(sizes)
        self.counts: list[int] = []  # every core's rows in this forward
        self.real: list[int] = []  # of them, its requests' tokens
        self.padded_forwards = 0  # forwards run at an agreed padded size
        self.eager_forwards = 0  # forwards run at every core's own count

    def agree(self, rows: int, decode: bool) -> int | None:
        """`rows`: this core's (0: it is idle, running a dummy batch); `decode`: its step is all-decode."""
        gathered = self.group.all_gather(torch.tensor([rows, int(decode or rows == 0)], dtype=torch.int64))
        reports = [(int(r), bool(d)) for r, d in (g.tolist() for g in gathered)]
        size = common_size(reports, self.sizes)
        self.real = [rows for rows, _ in reports]
        if size is None:
            self.counts = eager_counts(reports)
            self.eager_forwards += 1
        else:
            self.counts = [size] * len(reports)
            self.padded_forwards += 1
        return size


def is_all_decode(batch: AttentionBatch) -> bool:
    return batch.num_decodes == batch.num_reqs > 0


def padded_batch(input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
    """An all-decode batch of `size` rows for an eager forward: the step's rows, then padding rows
    decoding token 0 at position 0 into the null page (as the decode graphs' padding)."""
    pad = size - batch.num_reqs
    if pad == 0:
        return input_ids, positions, batch
    zeros = torch.zeros(pad, dtype=input_ids.dtype, device=input_ids.device)
    padded = AttentionBatch(query_lens=batch.query_lens + [1] * pad, seq_lens=batch.seq_lens + [1] * pad,
                            page_tables=batch.page_tables + [[0]] * pad,
                            slot_mapping=torch.cat((batch.slot_mapping, zeros.to(batch.slot_mapping.dtype))),
                            num_decodes=size)
    return torch.cat((input_ids, zeros)), torch.cat((positions, zeros.to(positions.dtype))), padded

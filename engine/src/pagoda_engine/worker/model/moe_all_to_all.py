"""Expert parallelism across data-parallel engine cores by all-to-all (`--all2all-backend
alltoallv`): each token goes only to the ranks that hold one of its chosen experts, once per rank
(not once per expert there), with its expert ids and routing weights; each rank runs its experts'
grouped GEMMs over what it received and sends every token's weighted partial sum back, where the
partials are added up.

One layer's exchange over the dispatch group (the ranks of this TP position in every core):
1. route this core's own tokens (every TP rank of a core has the same tokens and routes alike);
2. each (token, rank) pair to send: a token goes to rank d of the group where one of its experts
   lives on (core d, this TP position); experts on another TP position are that TP rank's to
   serve, and the core's TP all-reduce sums the positions afterwards;
3. the send counts, exchanged first (`all_to_all` of one count per rank), then the tokens and,
   packed in one float32 tensor, their expert ids (local to the receiving rank, `num_local` for
   an expert held elsewhere, as the expert kernels take them) and weights;
4. the experts over the received rows; the reverse all-to-all; the partials added per token.

With two micro-batches (`--enable-dbo`) the rows go in two halves, all counts in one exchange:
both halves' dispatches start at once, the first half's experts run while the second half's
tokens travel, and the second half's experts while the first half's results travel back (NCCL
runs the exchanges on its own stream; `TPGroup.all_to_all_async`).

The counts reach the host (one device sync per layer on CUDA) and the pieces differ in size, so
this exchange cannot be captured in a CUDA graph: steps replayed in graphs take the all-gather /
reduce-scatter, whose pieces are equal-sized (`moe.DataParallelDispatch`). Its gain is in bytes
and in the rows each rank's experts run over: with top-k of E experts on R ranks a rank receives
a token with probability 1 - C(E - E/R, k) / C(E, k), which for Qwen3-30B-A3B (top-8 of 128) is
0.997 at R = 2, 0.91 at R = 4, 0.67 at R = 8: the all-to-all pays as EP widens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagoda_engine.worker.model.layers import TPGroup

# (tokens [m, H], routing weights [m, k], local expert ids [m, k]) -> the weighted sum over the
# pairs whose expert this rank holds [m, H]: the experts' grouped GEMMs.
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dispatch_and_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, group: TPGroup, tp_size: int,
                         tp_rank: int, num_local: int, experts: Experts, real: torch.Tensor | None = None,
                         microbatches: int = 1) -> torch.Tensor:
    """This TP position's share of the routed output for this core's tokens `x` [n, H], whose
    chosen experts are `ids` [n, k] (global ids; rank e // num_local of the EP group holds expert
    e, and EP rank = core × tp_size + TP rank) with `weights` [n, k]: what every rank of `group`
    computed for them, summed. `real` [n] bool: the rows that are tokens of requests (the others,
    padding and dummy rows, go nowhere and come back zero). `microbatches` 2 (`--enable-dbo`):
    the rows in two halves, each exchanged while the other's experts run."""
    n, k = ids.shape
    size = group.size
    ep_rank = ids // num_local
    dest = ep_rank // tp_size
    here = (ep_rank % tp_size) == tp_rank
    if real is not None:
        here &= real[:, None]
    # send[t, d]: token t goes to group rank d (a spare last column takes the other positions' pairs)
    send = torch.zeros(n, size + 1, dtype=torch.bool, device=x.device)
    send.scatter_(1, torch.where(here, dest, size), True)
    send = send[:, :size]
    bounds = [n * b // microbatches for b in range(microbatches + 1)]
    # Every micro-batch's counts in one exchange: to each rank, one count per micro-batch.
    send_counts = torch.stack([send[lo:hi].sum(0) for lo, hi in zip(bounds, bounds[1:])], dim=1)  # [size, mb]
    recv_counts = group.all_to_all(send_counts.flatten(), [microbatches] * size, [microbatches] * size)
    counts = torch.cat((send_counts.flatten(), recv_counts)).view(2, size, microbatches).tolist()  # one sync
    plans, arriving = [], []
    for b, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        sent, received = [c[b] for c in counts[0]], [c[b] for c in counts[1]]
        dst, token = send[lo:hi].t().nonzero(as_tuple=True)  # by destination, then token: the runs sent
        token = token + lo
        # Ids local to the receiving rank: its first expert is (d × tp_size + tp_rank) × num_local.
        local = ids[token] - ((dst * tp_size + tp_rank) * num_local)[:, None]
        local = local.masked_fill((local < 0) | (local >= num_local), num_local)
        # float32 holds the ids exactly (fewer than 2^24 experts) and the weights of any half type.
        meta = torch.cat((local.to(torch.float32), weights[token].to(torch.float32)), dim=1)
        plans.append((token, sent, received))
        arriving.append((group.all_to_all_async(x[token], sent, received),
                         group.all_to_all_async(meta, sent, received)))
    returning = []
    for (token, sent, received), (tokens_in, meta_in) in zip(plans, arriving):
        recv_x, recv_meta = tokens_in.wait(), meta_in.wait()
        partial = experts(recv_x, recv_meta[:, k:].to(weights.dtype), recv_meta[:, :k].to(torch.int64))
        returning.append(group.all_to_all_async(partial, received, sent))
    out = torch.zeros_like(x)
    for (token, _, _), back in zip(plans, returning):
        out.index_add_(0, token, back.wait().to(x.dtype))
    return out

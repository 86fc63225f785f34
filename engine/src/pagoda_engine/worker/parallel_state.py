"""Which ranks work together: the process-group layout of tensor, pipeline, data and expert
parallelism, computed from the sizes alone (no processes, no torch).

Global ranks are laid out as vLLM lays them out (`arange(world).reshape(DP, PP, TP)`), TP
innermost so that a TP group is a run of consecutive ranks (on one host, its GPUs side by side):

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

- a TP group: the `tp` ranks of one pipeline stage of one DP replica (same dp_rank, pp_rank);
- a PP group: the `pp` stages one token passes through (same dp_rank, tp_rank);
- a DP group: the `dp` replicas of one (pp_rank, tp_rank) position;
- the EP group (MoE layers only, `enable_expert_parallel`): every TP rank of every DP replica of
  one pipeline stage (same pp_rank), so experts are spread over TP × DP.

- the world group: every rank (under pipeline parallelism a call's tensors are broadcast over it).

One engine core's executor numbers its own ranks with dp = 1 and creates the groups they need at
run time: TP, and under pipeline parallelism PP and the world group. Data-parallel engine cores
are independent unless the MoE layers' experts span them (`--enable-expert-parallel` with
`--data-parallel-size`): then every rank also joins the pod-wide numbering above (`DataParallelRank`,
`pod_layout`), through a store that core 0 hosts, and its DP group carries the MoE dispatch.
`pp_layer_partition` splits the decoder layers into pipeline stages; `dist_backend` picks the
process groups' backend.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda_engine import envs
from pagoda_engine.envs import DIST_BACKEND_ENV, PP_LAYER_PARTITION_ENV
from pagoda_engine.errors import ModelLoadError

AXES = ("tp", "pp", "dp", "ep")
# The process groups' backend on CUDA (PAGODA_DIST_BACKEND): nccl (the default) or gloo, whose ranks
# may share a GPU (NCCL refuses two ranks on one device), so that pipeline parallelism runs on one GPU for tests.
DIST_BACKENDS = ("nccl", "gloo")


@dataclass(frozen=True)
class RankCoordinates:
    """One global rank's place on every axis; `ep_rank` is None without expert parallelism."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int | None


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "dp"):
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis} size must be an integer >= 1, got {size!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def coordinates(self, rank: int) -> RankCoordinates:
        self._check_rank(rank)
        tp_rank = rank % self.tp
        pp_rank = rank // self.tp % self.pp
        dp_rank = rank // (self.tp * self.pp)
        ep_rank = dp_rank * self.tp + tp_rank if self.enable_expert_parallel else None
        return RankCoordinates(rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank, ep_rank=ep_rank)

    def group(self, axis: str, rank: int) -> tuple[int, ...]:
        """The global ranks of `rank`'s group on `axis`, in group-rank order (a member's index is
        its rank within the group: its tp_rank, pp_rank, dp_rank or ep_rank)."""
        c = self.coordinates(rank)
        if axis == "tp":
            return tuple(self.rank_of(c.dp_rank, c.pp_rank, t) for t in range(self.tp))
        if axis == "pp":
            return tuple(self.rank_of(c.dp_rank, p, c.tp_rank) for p in range(self.pp))
        if axis == "dp":
            return tuple(self.rank_of(d, c.pp_rank, c.tp_rank) for d in range(self.dp))
        if axis == "ep":
            if not self.enable_expert_parallel:
                raise ValueError("no EP group: expert parallelism is not enabled")
            return tuple(self.rank_of(d, c.pp_rank, t) for d in range(self.dp) for t in range(self.tp))
        if axis == "world":
            return tuple(range(self.world_size))
        raise ValueError(f"axis must be one of {', '.join(AXES)} or world, got {axis!r}")

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group on `axis`, ordered by their lowest rank: a partition of all ranks."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.group(axis, rank))
        return sorted(seen, key=lambda g: g[0])

    def group_index(self, axis: str, rank: int) -> int:
        """Which of `groups(axis)` holds `rank`: names a group's own rendezvous keys."""
        return self.groups(axis).index(self.group(axis, rank))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")


@dataclass(frozen=True)
class DataParallelRank:
    """Which data-parallel engine core a rank belongs to, and where the pod's cores meet (the
    store core 0's first rank hosts at master_addr:master_port); how the MoE layers reach the
    other cores' experts (`all2all_backend`, `--all2all-backend`) and the sizes every core pads
    its decode steps to (`padded_sizes`, ascending: the decode graphs'; empty: no padding,
    `worker/dp_padding.py`)."""

    size: int
    rank: int
    master_addr: str
    master_port: int
    all2all_backend: str = "allgather_reducescatter"
    padded_sizes: tuple[int, ...] = ()
    # --enable-eplb's settings (`eplb.EPLBConfig`'s fields), or None without it.
    eplb: dict | None = None
    microbatches: int = 1  # the all-to-all's (2 with --enable-dbo)


def pod_layout(layout: ParallelLayout, dp: DataParallelRank) -> tuple[ParallelLayout, int]:
    """The pod-wide layout (the core's tp × pp times dp.size) and a core-local rank's place in it."""
    pod = ParallelLayout(tp=layout.tp, pp=layout.pp, dp=dp.size, enable_expert_parallel=layout.enable_expert_parallel)
    return pod, dp.rank * layout.world_size


def pp_layer_partition(num_layers: int, pp: int, explicit: str | None = None) -> list[tuple[int, int]]:
    """Each pipeline stage's layers as [start, end): `explicit` ("a,b,..." layer counts, one per
    stage, summing to `num_layers`; default: $PAGODA_PP_LAYER_PARTITION) or vLLM's split
    (`get_pp_indices`): `num_layers // pp` each, the remainder one more per stage from the
    second-to-last backwards. Every stage needs at least one layer (ModelLoadError otherwise)."""
    explicit = envs.pp_layer_partition() if explicit is None else explicit
    if explicit:
        try:
            counts = [int(part) for part in explicit.split(",")]
        except ValueError:
            raise ModelLoadError(f"{PP_LAYER_PARTITION_ENV}={explicit!r} must be comma-separated layer counts, "
                                 f"one per pipeline stage") from None
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise ModelLoadError(f"{PP_LAYER_PARTITION_ENV}={explicit!r} must give each of the {pp} pipeline stages "
                                 f"at least one layer and sum to the model's {num_layers} layers")
    else:
        if num_layers < pp:
            raise ModelLoadError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers "
                                 "(every stage needs at least one)")
        counts = [num_layers // pp] * pp
        for i in range(2, num_layers % pp + 2):
            counts[-i] += 1
    starts = [sum(counts[:i]) for i in range(pp)]
    return [(start, start + n) for start, n in zip(starts, counts)]


def dist_backend(device_type: str) -> str:
    """The backend of the process groups of ranks (or host-side groups) on `device_type`: gloo on
    CPU, whatever PAGODA_DIST_BACKEND says; on CUDA NCCL, or gloo when PAGODA_DIST_BACKEND=gloo (a
    CUDA tensor then passes through host memory on its way: `model.layers.TPGroup`; slow, and the
    ranks may share GPUs). ModelLoadError for a value other than nccl or gloo."""
    wanted = envs.dist_backend()
    if wanted and wanted not in DIST_BACKENDS:
        raise ModelLoadError(f"{DIST_BACKEND_ENV}={wanted!r} must be one of {', '.join(DIST_BACKENDS)}")
    if device_type != "cuda":
        return "gloo"
    return wanted or "nccl"


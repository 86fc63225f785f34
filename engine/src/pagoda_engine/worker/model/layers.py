"""The building blocks of Pagoda's decoder models: RMSNorm, rotary embedding, SiluAndMul, and the
linear, embedding and LM-head layers whose weights the loader fills.

Every layer that holds weights creates them uninitialised (`torch.empty`): the loader overwrites
them from a checkpoint or, for `--load-format dummy`, with seeded random values. Layers whose
weights a checkpoint stores in pieces (q/k/v, gate/up) give their parameter a `weight_loader`
that places one piece; tensor parallelism slots in there (each rank keeps its slice of heads).

Tensor parallelism (Megatron-style): column-parallel layers split output features and need no
communication; row-parallel layers split input features and all-reduce their partial sums (one
all-reduce per row-parallel layer); the embedding splits the vocabulary and all-reduces; the LM
head splits the vocabulary and all-gathers the logits. Collectives run on the model's own
`TPGroup` (attached after construction with `attach_tp_group`; `pagoda_engine.worker.worker` makes
it from the process-group layout), never on torch.distributed's global default group, so one
process may hold several engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagoda_engine.errors import ModelLoadError
from pagoda_engine.worker.model.fp8_math import fp8_linear


def _set_weight_loader(param: nn.Parameter, loader, shard_ids: Sequence = (None,)) -> None:
    """Attach how the loader fills `param` and which checkpoint pieces it expects."""
    param.weight_loader = loader
    param.shard_ids = tuple(shard_ids)


def _check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    """A checkpoint tensor must have exactly the (unsharded) shape the config implies."""
    if tuple(loaded.shape) != tuple(expected):
        raise ModelLoadError(f"weight of shape {tuple(loaded.shape)} does not fit parameter of shape {tuple(expected)}")


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    _check_shape(loaded, param.shape)
    param.data.copy_(loaded)


# --- normalisation and activation -------------------------------------------------------------


_FLASHINFER = None  # the flashinfer module once imported; False when it is not installed
_GEMV = None  # model/gemv_triton.py once imported (CUDA only)
# FlashInfer's rotary kernel takes these head sizes (others fault with a misaligned address).
_FUSED_ROPE_HEAD_DIMS = (64, 128, 256)


def _fused_kernels(x: torch.Tensor):
    """FlashInfer's module when `x` is a half-precision CUDA tensor and FlashInfer imports, else
    None (the torch code runs, unchanged: CPU results stay bit-identical)."""
    global _FLASHINFER
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    if _FLASHINFER is None:
        try:
            import flashinfer

            _FLASHINFER = flashinfer
        except ImportError:
            _FLASHINFER = False
    return _FLASHINFER or None


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32 as the reference models do.

    `norm(x)` returns the normalised x; `norm(x, residual)` first adds x to the residual stream and
    returns `(normalised sum, sum)`, the fused form every decoder layer uses.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))
        _set_weight_loader(self.weight, default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None and x.dim() > 2 and _fused_kernels(x) is not None and x.shape[-1] % 8 == 0:
            # Per-head norms (Qwen3's q/k norm under the reference attention backend; FlashInfer's
            # fuses them into its rotary + K/V-write kernel) on [tokens, heads, head_dim]: one kernel
            # over the rows (after one copy when the heads are a strided view) instead of torch's seven.
            return self.forward(x.reshape(-1, x.shape[-1]).contiguous()).view(x.shape)
        # 16-byte vectors: the hidden size must be a multiple of 8 half-precision values.
        fi = _fused_kernels(x) if x.dim() == 2 and x.is_contiguous() and x.shape[-1] % 8 == 0 else None
        if fi is not None:
            if residual is None:
                return fi.rmsnorm(x, self.weight, self.eps)
            # One kernel, in place: residual += x, then x = norm(residual).
            fi.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def _gemv_kernels(x: torch.Tensor, weight: torch.Tensor):
    """The Triton matrix-vector module when x is one half-precision CUDA row, or a few, that it
    serves (`gemv_triton.linear_applies`), else None: `F.linear` runs, and CPU results stay
    bit-identical."""
    global _GEMV
    if not x.is_cuda:
        return None
    if _GEMV is None:  # imported on first use: Triton is there only where CUDA is
        from pagoda_engine.worker.model import gemv_triton

        _GEMV = gemv_triton
    # `linear_applies` first: it turns away a prefill's rows at its first test.
    return _GEMV if _GEMV.linear_applies(x, weight) and _fused_kernels(x) is not None else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; a small decode batch's rows on CUDA take the matrix-vector kernels (`gemv_triton`)."""
    gemv = _gemv_kernels(x, weight)
    return gemv.gemv(x, weight, bias) if gemv is not None else F.linear(x, weight, bias)


def _gemv_norm_kernels(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor):
    """The Triton matrix-vector module when it can fold `norm` into the projection of x's one row
    (`gemv_triton.norm_applies`), else None."""
    gemv = _gemv_kernels(x, weight)
    return gemv if gemv is not None and gemv.norm_applies(x, residual, norm.weight, weight) else None


def norm_and_linear(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
                    layer: LinearBase) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer(normalised), residual) after `norm(x, residual)`, or `norm(x)` with x as the
    residual when there is none yet (the first layer); `layer` adds no collective (a
    column-parallel projection). A batch-1 decode's row on CUDA takes one kernel for both
    (`gemv_triton.gemv_rmsnorm`); with LoRA its extra programs shrink the normalised row for the
    row's adapter, and the expand follows."""
    gemv = _gemv_norm_kernels(norm, x, residual, layer.weight)
    if gemv is not None:
        if layer.lora is None:
            return gemv.gemv_rmsnorm(x, residual, norm.weight, norm.eps, layer.weight, layer.bias,
                                     scale=layer.weight_scale)
        y, residual, shrunk = gemv.gemv_rmsnorm(x, residual, norm.weight, norm.eps, layer.weight, layer.bias,
                                                scale=layer.weight_scale, lora=layer.lora.one_row(x))
        return layer.lora.expand(shrunk, y), residual
    if residual is None:
        residual, x = x, norm(x)
    else:
        x, residual = norm(x, residual)
    return layer.matmul(x, layer.bias), residual


class SiluAndMul(nn.Module):
    """[..., 2 * d] → silu(first half) * second half: the gated MLP's activation. On CUDA, a few
    rows (decode batches) take a Triton kernel that spreads each row over many SMs, more rows
    FlashInfer's kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fi = _fused_kernels(x)
        if fi is not None and x.is_contiguous() and x.shape[-1] % 16 == 0:
            from pagoda_engine.worker.model import silu_and_mul_triton

            if x.dim() == 2 and x.shape[0] <= silu_and_mul_triton.MAX_ROWS:
                return silu_and_mul_triton.silu_and_mul(x)
            return fi.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


# --- rotary embedding -------------------------------------------------------------------------


def _default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short kept,
    the band between them interpolated smoothly."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, base: float, params: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate low frequencies, extrapolate high ones, ramp between,
    and scale cos/sin by the attention factor."""
    factor = params["factor"]
    original_max = params.get("original_max_position_embeddings") or max_position

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) from a precomputed float32 cos/sin cache.

    `rope_params` is the Hugging Face `rope_parameters` / `rope_scaling` dict (None = default);
    supported types are in ROPE_TYPES. `freq_factors` (head_dim / 2 of them, from a GGUF file's
    `rope_freqs`) divide the frequencies dimension by dimension after that, as llama.cpp does. `forward(positions, q, k)` rotates q [T, Hq, D] and
    k [T, Hkv, D] at their absolute positions. The layers hand it to the attention backend, which
    calls it (the reference) or reads `cos_cache` / `sin_cache` in a kernel that rotates while it
    writes K/V (FlashInfer's backend, `attention/rope_kv_triton.py`).
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_params: dict | None = None,
                 freq_factors: list[float] | None = None):
        super().__init__()
        params = dict(rope_params or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ModelLoadError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
        attention_factor = 1.0
        if rope_type == "default":
            inv_freq = _default_inv_freq(head_dim, base)
        elif rope_type == "linear":
            inv_freq = _default_inv_freq(head_dim, base) / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(_default_inv_freq(head_dim, base), params)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(head_dim, base, params, max_position)
            # YaRN stretches the original context by `factor`; cover that even if config.json
            # still states the original length.
            original = params.get("original_max_position_embeddings") or max_position
            max_position = max(max_position, int(original * params["factor"]))
        else:
            raise ModelLoadError(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        if freq_factors is not None:
            if len(freq_factors) != head_dim // 2 or min(freq_factors) <= 0:
                raise ModelLoadError(f"rotary frequency factors: {len(freq_factors)} given (head_dim {head_dim} needs "
                                     f"{head_dim // 2}), each above 0")
            inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        self.head_dim = head_dim
        self.max_position = max_position
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # Buffers, not parameters: the loader skips them and `model.to(device)` moves them.
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fi = _fused_kernels(q) if self.head_dim in _FUSED_ROPE_HEAD_DIMS else None
        if fi is not None:
            # FlashInfer rotates q and k in place from one float32 [max_position, D] cache (cos | sin),
            # made on first use from the same cos/sin as below (so every rope variant applies).
            if getattr(self, "_cos_sin_cache", None) is None:
                self._cos_sin_cache = torch.cat((self.cos_cache, self.sin_cache), dim=-1).contiguous()
            fi.apply_rope_with_cos_sin_cache_inplace(positions, q, k, self.head_dim, self._cos_sin_cache, is_neox=True)
            return q, k
        # [T, 1, D/2]: broadcast over heads; cast like the reference (cos/sin in the activations' dtype).
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


# --- linear layers (tensor-parallel aware) ------------------------------------------------------


class TPGroup:
    """The collectives of one tensor-parallel model, on a torch.distributed backend object
    (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on CUDA) that belongs to this model alone.
    `rank` is this member's index in the group, `ranks` the members' global ranks
    (`worker.parallel_state.ParallelLayout.group`).

    `stages_on_host`: gloo serving CUDA ranks (PAGODA_DIST_BACKEND=gloo, e.g. several pipeline
    stages on one GPU). Gloo's send and recv hand the tensor's pointer to its TCP transport as
    host memory, so every CUDA tensor goes through a host copy here, for every operation alike
    (a synchronous copy: never inside a CUDA graph). CPU tensors are used as they are."""

    def __init__(self, backend, rank: int, size: int, ranks: tuple[int, ...] | None = None,
                 stages_on_host: bool = False):
        self.backend = backend
        self.rank = rank
        self.size = size
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(size))
        self.stages_on_host = stages_on_host

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        staged = self._staged(x)
        self.backend.allreduce([staged]).wait()
        return _copy_back(x, staged)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x`, in rank order."""
        staged = self._staged(x.contiguous())
        parts = [torch.empty_like(staged) for _ in range(self.size)]
        self.backend.allgather([parts], [staged]).wait()
        return [part.to(x.device) for part in parts]

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """`x` [size × n, ...] summed over the ranks; this rank's n rows of the sum."""
        staged = self._staged(x.contiguous())
        out = torch.empty_like(staged[:staged.shape[0] // self.size])
        self.backend.reduce_scatter([out], [list(staged.chunk(self.size))]).wait()
        return out.to(x.device)

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """`x`'s rows in runs of `send_counts[r]` to each rank r, in rank order; what every rank r
        sent this one, `recv_counts[r]` rows each, concatenated in rank order."""
        return self.all_to_all_async(x, send_counts, recv_counts).wait()

    def all_to_all_async(self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> _Arriving:
        """`all_to_all` started: the returned object's `wait()` gives its result (on NCCL the
        exchange runs on its own stream meanwhile; through host memory it has finished already)."""
        staged = self._staged(x.contiguous())
        out = staged.new_empty((sum(recv_counts), *staged.shape[1:]))
        work = self.backend.alltoall_base(out, staged, list(recv_counts), list(send_counts), dist.AllToAllOptions())
        return _Arriving(work, out, x.device)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` into every rank's `x`, in place."""
        staged = self._staged(x)
        self.backend.broadcast(staged, src).wait()
        return _copy_back(x, staged)

    def send(self, x: torch.Tensor, dst: int) -> None:
        """`x` to group member `dst` (pipeline stages pass hidden states and logits on)."""
        self.backend.send([self._staged(x.contiguous())], dst, 0).wait()

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Member `src`'s `send` into `x`, in place."""
        self.recv_async(x, src).wait()
        return x

    def recv_async(self, x: torch.Tensor, src: int):
        """`recv` without waiting: the returned work's `wait()` does (receives match sends in order)."""
        staged = self._staged(x, copy=False)
        work = self.backend.recv([staged], src, 0)
        return work if staged is x else _CopiedBack(work, x, staged)

    def _staged(self, x: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """What the backend works on for `x`: `x` itself, or a host tensor like it (holding its
        values when `copy`) where CUDA tensors go through host memory."""
        if not (self.stages_on_host and x.is_cuda):
            return x
        return x.cpu() if copy else torch.empty(x.shape, dtype=x.dtype)


def _copy_back(x: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """`x` holding the result an operation left in `staged` (its host copy, or `x` itself). In
    inference mode: `x` may have been made in it (a receive waited for after the forward)."""
    if staged is not x:
        with torch.inference_mode():
            x.copy_(staged)
    return x


class _Arriving:
    """A collective's output, still arriving: `wait()` returns it on `device`."""

    def __init__(self, work, out: torch.Tensor, device: torch.device):
        self.work, self.out, self.device = work, out, device

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.out.to(self.device)


class _CopiedBack:
    """A receive into a host copy of `x`: `wait()` waits for it, then copies it into `x`."""

    def __init__(self, work, x: torch.Tensor, staged: torch.Tensor):
        self.work, self.x, self.staged = work, x, staged

    def wait(self) -> None:
        self.work.wait()
        _copy_back(self.x, self.staged)


def attach_tp_group(model: nn.Module, group: TPGroup) -> None:
    """Give every tensor-parallel layer of `model` the group its collectives run on."""
    for module in model.modules():
        if getattr(module, "tp_size", 1) > 1:
            if module.tp_size != group.size or module.tp_rank != group.rank:
                raise ValueError(f"layer built for rank {module.tp_rank} of {module.tp_size}, "
                                 f"group is rank {group.rank} of {group.size}")
            module.tp_group = group


def _group(layer: nn.Module) -> TPGroup:
    if layer.tp_group is None:
        raise RuntimeError(f"{type(layer).__name__} is sharded {layer.tp_size} ways but has no TPGroup "
                           "(attach one with attach_tp_group)")
    return layer.tp_group


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ModelLoadError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class LinearBase(nn.Module):
    """y = x W^T (+ b) with an uninitialised weight of shape [out_features, in_features].

    An FP8 layer (`fp8.quantize_linear_layers`) holds an e4m3 weight with a float32 scale per
    output row in `weight_scale` (and, for static activation scales, `input_scale`).

    `lora`: the projection's multi-LoRA weights (`worker/model/lora.py`), added to its output."""

    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_scale: nn.Parameter | None = None
        self.input_scale: nn.Parameter | None = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ bias) on this rank's shard, no collective. An FP8 layer's few decode rows on
        CUDA take the matrix-vector kernels with the weight widened in registers (half the bytes
        of bf16 read, the activations unquantized); more rows, the FP8 GEMM (`fp8_linear`). With
        adapters, their part is added (`lora`), a lone row's shrunk in the matrix-vector kernel."""
        one_row = self.lora.one_row(x) if self.lora is not None else None
        gemv = _gemv_kernels(x, self.weight) if self.weight_scale is not None or one_row is not None else None
        if gemv is not None and one_row is not None:
            # One row with adapters: the kernel's extra programs shrink it for the row's adapter.
            y, shrunk = gemv.gemv(x, self.weight, bias, self.weight_scale, lora=one_row)
            return self.lora.expand(shrunk, y)
        if gemv is not None:
            y = gemv.gemv(x, self.weight, bias, self.weight_scale)
        elif self.weight_scale is not None:
            y = fp8_linear(x, self.weight, self.weight_scale, bias, self.input_scale)
        else:
            y = linear(x, self.weight, bias)
        return y if self.lora is None else self.lora(x, y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across TP ranks; each rank keeps rows [rank*n, (rank+1)*n)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.tp_group: TPGroup | None = None
        super().__init__(in_features, _divide(out_features, tp_size, "output features"), bias)
        for p in self.parameters():
            _set_weight_loader(p, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        _check_shape(loaded, (n * self.tp_size, *param.shape[1:]))
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up).

    The checkpoint stores each piece separately; `shard_id` is its index in `output_sizes`.
    """

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False, tp_size: int = 1, tp_rank: int = 0):
        self.output_sizes = [_divide(s, tp_size, "output features") for s in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp_size, tp_rank)
        for p in self.parameters():
            _set_weight_loader(p, self._load_piece, range(len(output_sizes)))

    def _load_piece(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        n = self.output_sizes[shard_id]
        start = sum(self.output_sizes[:shard_id])
        _check_shape(loaded, (n * self.tp_size, *param.shape[1:]))
        default_weight_loader(param.narrow(0, start, n), loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul; output layout [q heads | k heads | v heads].

    Under TP each rank keeps its query heads and its KV heads (KV heads are replicated when there
    are fewer of them than ranks).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_size: int = 1, tp_rank: int = 0):
        self.head_dim = head_dim
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_offset = tp_rank * self.num_kv_heads
        else:
            # Each rank keeps one KV head, the one its query heads attend with: that needs every
            # KV head's query group to fall on whole ranks.
            if tp_size % num_kv_heads:
                raise ModelLoadError(f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads "
                                     f"({num_kv_heads}) when it exceeds it, so KV heads replicate evenly")
            self.num_kv_heads = 1
            self.kv_head_offset = tp_rank * num_kv_heads // tp_size
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_size, tp_rank)
        for p in self.parameters():
            _set_weight_loader(p, self._load_piece, ("q", "k", "v"))

    def _load_piece(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        rows = q_size * self.tp_size if shard_id == "q" else self.total_num_kv_heads * d
        _check_shape(loaded, (rows, *param.shape[1:]))
        if shard_id == "q":
            dst, src = param.narrow(0, 0, q_size), loaded.narrow(0, self.tp_rank * q_size, q_size)
        else:
            start = q_size if shard_id == "k" else q_size + kv_size
            dst = param.narrow(0, start, kv_size)
            src = loaded.narrow(0, self.kv_head_offset * d, kv_size)
        default_weight_loader(dst, src)


class RowParallelLinear(LinearBase):
    """Input features split across TP ranks; partial sums are all-reduced (bias added once).
    `reduce_results=False` leaves the sum to the caller (an MoE layer reduces once for all its parts)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_size: int = 1, tp_rank: int = 0,
                 reduce_results: bool = True):
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.reduce_results = reduce_results
        self.tp_group: TPGroup | None = None
        super().__init__(_divide(in_features, tp_size, "input features"), out_features, bias)
        _set_weight_loader(self.weight, self._load_weight)
        if self.bias is not None:
            _set_weight_loader(self.bias, default_weight_loader)

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[1]
        _check_shape(loaded, (param.shape[0], n * self.tp_size))
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1 and self.reduce_results:
            _group(self).all_reduce(y)
        return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across TP ranks (ids outside a rank's slice give
    zeros there; the all-reduce sums the one rank that holds each id)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_size: int = 1, tp_rank: int = 0):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.tp_group: TPGroup | None = None
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp_size)  # ceil: the last rank's slice may be short
        self.vocab_start = tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size))
        _set_weight_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ModelLoadError(f"embedding has {loaded.shape[0]} rows, config.json says vocab_size {self.vocab_size}")
        piece = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        param.data.zero_()
        default_weight_loader(param[: piece.shape[0]], piece)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0)
        return _group(self).all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden → float32 logits over the full vocabulary (each rank computes its slice, then they
    are gathered). With tied embeddings the model points `weight` at the embedding's."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = torch.cat(_group(self).all_gather(logits), dim=-1)
        return logits[..., : self.vocab_size].float()


class GatedMLP(nn.Module):
    """down(silu(gate(x)) × up(x)): the dense MLP of every decoder (and Qwen2-MoE's shared expert).
    Gate and up are one column-parallel matmul, down is row-parallel; `reduce_results=False`
    leaves its all-reduce to the caller."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, tp_size: int = 1,
                 tp_rank: int = 0, reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, tp_size, tp_rank)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp_size, tp_rank, reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        gemv = _gemv_kernels(x, gate_up.weight) if gate_up.bias is None and gate_up.lora is None else None
        if gemv is not None:  # a few rows: gate, up and the activation in one kernel
            return self.down_proj(gemv.gemv_silu_and_mul(x, gate_up.weight, gate_up.weight_scale))
        return self.down_proj(self.act(gate_up(x)))

    def normed(self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(normalised), residual) after `norm(x, residual)`: at one row on CUDA the norm,
        gate, up and the activation are one kernel; with LoRA the norm, gate/up and the row's
        shrink are, and the adapter's part joins gate/up before the activation (`LoRALayer.expand_act`)."""
        gate_up = self.gate_up_proj
        gemv = _gemv_norm_kernels(norm, x, residual, gate_up.weight) if gate_up.bias is None else None
        if gemv is not None:
            if gate_up.lora is None:
                act, residual = gemv.gemv_rmsnorm(x, residual, norm.weight, norm.eps, gate_up.weight, gated=True,
                                                  scale=gate_up.weight_scale)
            else:
                y, residual, shrunk = gemv.gemv_rmsnorm(x, residual, norm.weight, norm.eps, gate_up.weight,
                                                        scale=gate_up.weight_scale, lora=gate_up.lora.one_row(x))
                act = gate_up.lora.expand_act(shrunk, y, self.act)
            return self.down_proj(act), residual
        x, residual = norm(x, residual)
        return self(x), residual

"""Multi-LoRA on one rank: the adapters' device slots, their weights read from PEFT files and
sharded like the layers they wrap, and the batched computation each wrapped projection adds.

Every q/k/v/o and gate/up/down projection of the model gets a `LoRALayer` (`LinearBase.lora`):
per device slot an A [slices × R, in] and per output slice a B [out, R] (R = --max-lora-rank, an
adapter of lower rank zero-padded), plus one scale per slot shared by every layer. A step's rows
carry a slot index each (-1: the base model, no LoRA); `LoRABatch` turns the step's per-request
slots into the buffers both computations read:

- on CPU (and for any tensor off CUDA) the torch path groups the rows of each slot and adds
  `scale × (x A^T) B^T` to the projection's output slice, exactly as PEFT does;
- on CUDA the Triton kernels (`lora_triton.py`, punica's SGMV shape: rows sorted by slot, one
  program per row block and slot) shrink and expand with a fixed grid, reading fixed-size device
  buffers (the sorted rows and each slot's start), so CUDA graphs capture them once and every
  replay serves whatever adapters the step's rows name.

Tensor parallelism: a column-parallel projection (q/k/v, gate/up) keeps A whole and B's rows of
its output shard (KV heads as the layer keeps them); a row-parallel one (o, down) keeps A's
columns of its input shard and B whole, so each rank's partial `x_r A_r^T B^T` joins the base
layer's partial sum in the layer's one all-reduce.

The host copies: each rank keeps up to --max-cpu-loras adapters, already sharded, in an LRU of
host memory; a slot load takes one from there, or reads it from disk first.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from pagoda_engine.executor_types import host_to_device
from pagoda_engine.lora import ADAPTER_WEIGHTS, TARGET_MODULES, LoRAAdapterError, LoRARequest, read_adapter_config

# PEFT's tensor names: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_TENSOR_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class _Slice:
    """One output piece of a wrapped projection: the checkpoint module it stands for, where its
    columns start in the layer's output and how many this rank keeps, and how this rank's shard
    of the adapter's B is cut from the full one (`b_rows`: start, count, full rows)."""

    module: str
    out_offset: int
    out_size: int
    b_rows: tuple[int, int, int]


class LoRABatch:
    """The step's rows and their slots, shared by every `LoRALayer` of the rank.

    For the kernels, fixed device buffers rewritten in place each step (captured graphs read the
    current step's): `sorted_rows`, the rows that run under an adapter grouped by slot, and
    `blocks`, one (slot, start in `sorted_rows`, row count) per block of at most `block_m` rows of
    one slot, (0, 0, 0) past the step's: at most `max_blocks(rows)` of them, the kernels' grid.
    For the torch path: `groups`, the (slot, rows) list built on the host. `scales`: each slot's
    adapter's scale."""

    block_m = 32  # rows per kernel program: A's and B's tiles are loaded once per this many rows

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device):
        self.num_slots = num_slots
        self.device = device
        self.use_kernels = device.type == "cuda"
        # Room for the step budget and for any graph's padded rows (the kernels' grid reads this many
        # blocks): a few bytes a row.
        self.max_tokens = max_tokens = max(max_tokens, 16384)
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.scales = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.sorted_rows = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.blocks = torch.zeros(self.max_blocks(max_tokens), 3, dtype=torch.int32, device=device)
        self._used_blocks = 0

    def max_blocks(self, num_rows: int) -> int:
        """The blocks a step of `num_rows` rows can need: every slot's last block may be short, and
        no block is empty (a lone decode row: one)."""
        return max(1, min(num_rows, -(-num_rows // self.block_m) + self.num_slots))

    def set(self, query_lens: list[int], lora_slots: list[int] | None) -> None:
        """The step's requests' new-token counts and slots (None: all base)."""
        rows_of: dict[int, list[int]] = {}
        row = 0
        for n, slot in zip(query_lens, lora_slots or [-1] * len(query_lens)):
            if slot >= 0:
                rows_of.setdefault(slot, []).extend(range(row, row + n))
            row += n
        if row > self.max_tokens:
            raise RuntimeError(f"a step of {row} tokens exceeds the LoRA buffers' {self.max_tokens} "
                               "(--max-num-batched-tokens)")
        if not self.use_kernels:
            self.groups = [(slot, torch.tensor(rows, dtype=torch.int64, device=self.device))
                           for slot, rows in sorted(rows_of.items())]
            return
        ordered: list[int] = []
        blocks: list[int] = []
        for slot, rows in sorted(rows_of.items()):
            for start in range(0, len(rows), self.block_m):
                blocks += (slot, len(ordered) + start, min(self.block_m, len(rows) - start))
            ordered += rows
        used = len(blocks) // 3
        # The last step's blocks past this one's are cleared: a graph's grid reads them.
        blocks += [0] * 3 * max(self._used_blocks - used, 0)
        self._used_blocks = used
        # Copies into the fixed buffers, queued on the stream before the step's kernels (and after
        # the step before's, which still read the old values), from pinned memory: the host does
        # not wait for the step in flight (async scheduling).
        if ordered:
            self.sorted_rows[:len(ordered)].copy_(host_to_device(torch.tensor(ordered, dtype=torch.int32),
                                                                 self.device))
        if blocks:
            self.blocks.view(-1)[:len(blocks)].copy_(host_to_device(torch.tensor(blocks, dtype=torch.int32),
                                                                    self.device))


class LoRALayer(nn.Module):
    """The LoRA weights of every slot for one projection, and `forward(x, y)`: y plus each row's
    adapter's contribution (in place)."""

    def __init__(self, slices: list[_Slice], in_features: int, in_shard: tuple[int, int] | None,
                 full_in: int, batch: LoRABatch, rank: int, dtype: torch.dtype):
        super().__init__()
        self.slices = slices
        self.full_in = full_in  # the unsharded projection's input width (an adapter's A has it)
        self.modules_served = tuple(s.module for s in slices)
        self.rank = rank
        self.in_shard = in_shard  # (start, count) of the input columns this rank keeps (row-parallel)
        self.batch = batch
        device = batch.device
        # Buffers, not parameters: the weight loader and `named_parameters` leave them alone.
        self.register_buffer("lora_a", torch.zeros(batch.num_slots, len(slices) * rank, in_features,
                                                   dtype=dtype, device=device), persistent=False)
        # Every slice's B in one buffer, rows in the projection's output order: one expand can
        # cover the whole output (`lora_triton.add_lora`).
        self.out_features = sum(s.out_size for s in slices)
        self.register_buffer("lora_b", torch.zeros(batch.num_slots, self.out_features, rank, dtype=dtype,
                                                   device=device), persistent=False)

    def b(self, i: int) -> torch.Tensor:
        """Slice i's B of every slot: [slots, its output columns, R]."""
        s = self.slices[i]
        return self.lora_b[:, s.out_offset:s.out_offset + s.out_size]

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def place(self, slot: int, i: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Slice i's A [r, in] and B [out, r] (this rank's shards) into `slot`."""
        r = a.shape[0]
        # Non-blocking from pinned host copies (`LoRAManager._shard`): queued after the step in flight.
        self.lora_a[slot, i * self.rank:i * self.rank + r].copy_(a, non_blocking=True)
        self.b(i)[slot, :, :r].copy_(b, non_blocking=True)

    def one_row(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What the one-row matrix-vector kernels (`gemv_triton`) take to shrink x's row for its
        adapter in extra programs of their own launch: (A of every slot, the block table); None
        where the kernels do not serve this batch (the caller then adds `forward`'s part)."""
        return (self.lora_a, self.batch.blocks) if self.batch.use_kernels and x.shape[0] == 1 else None

    def expand(self, shrunk: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus the row's adapter part from `shrunk`, the one-row kernels' shrink (in place)."""
        from pagoda_engine.worker.model import lora_triton

        lora_triton.expand_all(shrunk, y, self, self.batch)
        return y

    def expand_act(self, shrunk: torch.Tensor, y: torch.Tensor, act) -> torch.Tensor:
        """The gated MLP's one row: `act` (SiLU-and-mul) of y [1, 2 × I] plus the adapter's gate and
        up parts, in one kernel up to rank ONE_ROW_MAX_RANK."""
        from pagoda_engine.worker.model import lora_triton

        if self.rank <= lora_triton.ONE_ROW_MAX_RANK:
            return lora_triton.expand_act(shrunk, y, self, self.batch)
        return act(self.expand(shrunk, y))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        if batch.use_kernels:  # CUDA (or a test running the kernels under Triton's interpreter)
            from pagoda_engine.worker.model import lora_triton

            return lora_triton.add_lora(x, y, self, batch)
        for slot, rows in batch.groups:
            xs = x.index_select(0, rows)
            shrunk = xs @ self.lora_a[slot].t()  # [rows, slices × R]
            scale = batch.scales[slot].to(x.dtype)
            for i, s in enumerate(self.slices):
                part = shrunk[:, i * self.rank:(i + 1) * self.rank] @ self.b(i)[slot].t()
                y[:, s.out_offset:s.out_offset + s.out_size].index_add_(0, rows, part * scale)
        return y


@dataclass
class HostAdapter:
    """One adapter's weights in host memory, cut for this rank: (layer, module) -> (A, B)."""

    request: LoRARequest
    scaling: float
    rank: int
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    """This rank's adapters: the LoRA layers attached to the model, the device slots, the host LRU."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.batch = LoRABatch(max_loras, max_tokens, device)
        self.layers: dict[tuple[int, str], tuple[LoRALayer, int]] = {}  # (layer, module) -> (its LoRALayer, slice)
        self.num_layers = model.config.num_hidden_layers
        # This rank's layers (under pipeline parallelism its stage's): it keeps their adapter
        # weights and checks them; the other stages' ranks check theirs.
        self.stage_layers = range(model.model.start_layer, model.model.end_layer)
        self.host: OrderedDict[str, HostAdapter] = OrderedDict()
        for idx in self.stage_layers:
            layer = model.model.layers[idx]
            attn = layer.self_attn
            self._wrap(idx, attn.qkv_proj, _qkv_slices(attn.qkv_proj))
            self._wrap(idx, attn.o_proj, [_Slice("o_proj", 0, attn.o_proj.out_features,
                                                 (0, attn.o_proj.out_features, attn.o_proj.out_features))])
            mlp = layer.mlp
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP; an MoE block's experts take no LoRA
                gu = mlp.gate_up_proj
                n = gu.output_sizes[0]
                full = n * gu.tp_size
                self._wrap(idx, gu, [_Slice("gate_proj", 0, n, (gu.tp_rank * n, n, full)),
                                     _Slice("up_proj", n, n, (gu.tp_rank * n, n, full))])
                down = mlp.down_proj
                self._wrap(idx, down, [_Slice("down_proj", 0, down.out_features,
                                              (0, down.out_features, down.out_features))])

    def _wrap(self, idx: int, linear: nn.Module, slices: list[_Slice]) -> None:
        row_parallel = hasattr(linear, "reduce_results")
        in_shard = (linear.tp_rank * linear.in_features, linear.in_features) if row_parallel else None
        full_in = linear.in_features * linear.tp_size if row_parallel else linear.in_features
        lora = LoRALayer(slices, linear.in_features, in_shard, full_in, self.batch, self.max_lora_rank, self.dtype)
        # Outside the model's module tree (its parameters, state dict and FP8 pass stay the base's):
        # the manager owns the LoRA layers, the projection only calls its own.
        object.__setattr__(linear, "lora", lora)
        for i, s in enumerate(slices):
            self.layers[(idx, s.module)] = (lora, i)

    # --- adapters ---------------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> None:
        """Read and check `request`'s adapter into the host LRU (a no-op when it is there).
        Raises LoRAAdapterError naming the adapter and the reason."""
        if request.lora_name in self.host:
            self.host.move_to_end(request.lora_name)
            return
        self.host[request.lora_name] = self._read(request)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    def remove(self, name: str) -> None:
        """Forget the host copy of adapter `name` (a slot that holds it keeps it until reused)."""
        self.host.pop(name, None)

    def load_slot(self, slot: int, request: LoRARequest) -> None:
        """Adapter `request` into device slot `slot` (from the host LRU, or disk first)."""
        self.add(request)
        adapter = self.host[request.lora_name]
        for lora, _ in {id(v[0]): v for v in self.layers.values()}.values():
            lora.clear(slot)
        for (idx, module), (a, b) in adapter.tensors.items():
            lora, i = self.layers[(idx, module)]
            lora.place(slot, i, a, b)
        self.batch.scales[slot] = adapter.scaling

    def set_batch(self, query_lens: list[int], lora_slots: list[int] | None) -> None:
        self.batch.set(query_lens, lora_slots)

    def _read(self, request: LoRARequest) -> HostAdapter:
        from safetensors import safe_open

        name = request.lora_name

        def refuse(reason: str) -> LoRAAdapterError:
            return LoRAAdapterError(f"LoRA adapter {name!r}: {reason}")

        cfg = read_adapter_config(name, request.lora_path, self.max_lora_rank)
        pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        try:
            with safe_open(f"{request.lora_path}/{ADAPTER_WEIGHTS}", framework="pt") as f:
                for key in f.keys():
                    m = _TENSOR_NAME.search(key)
                    if m is None:
                        raise refuse(f"tensor {key!r} is not a LoRA A/B weight of a served projection")
                    idx, module, ab = int(m.group(1)), m.group(2), m.group(3)
                    if module not in TARGET_MODULES:
                        raise refuse(f"tensor {key!r} targets {module}, which is not served")
                    pieces.setdefault((idx, module), {})[ab] = f.get_tensor(key)
        except LoRAAdapterError:
            raise
        except Exception as e:  # a truncated or foreign file
            raise refuse(f"{ADAPTER_WEIGHTS} cannot be read ({e})") from None
        if not pieces:
            raise refuse(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
        tensors = {}
        for (idx, module), ab in pieces.items():
            if set(ab) != {"A", "B"}:
                raise refuse(f"layer {idx} {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
            if idx >= self.num_layers:
                raise refuse(f"layer {idx} does not exist in the base model ({self.num_layers} layers): "
                             "an adapter of another base model")
            if idx not in self.stage_layers:
                continue
            if (idx, module) not in self.layers:
                raise refuse(f"the base model has no {module} in layer {idx} to adapt (a mixture-of-experts block?)")
            a, b = ab["A"], ab["B"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != cfg.rank or b.shape[1] != cfg.rank:
                raise refuse(f"layer {idx} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not have "
                             f"rank {cfg.rank}")
            tensors[(idx, module)] = self._shard(refuse, idx, module, a, b)
        return HostAdapter(request, cfg.scaling, cfg.rank, tensors)

    def _shard(self, refuse, idx: int, module: str, a: torch.Tensor, b: torch.Tensor):
        lora, i = self.layers[(idx, module)]
        s = lora.slices[i]
        start, count, full_rows = s.b_rows
        full_in = lora.full_in
        if a.shape[1] != full_in or b.shape[0] != full_rows:
            raise refuse(f"layer {idx} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                         f"model's {full_rows} x {full_in} projection (an adapter of another base model)")
        if lora.in_shard is not None:
            a = a.narrow(1, lora.in_shard[0], lora.in_shard[1])
        b = b.narrow(0, start, count)
        a, b = a.to(self.dtype).contiguous(), b.to(self.dtype).contiguous()
        if self.batch.device.type == "cuda":  # pinned: a slot loads without waiting for the device
            a, b = a.pin_memory(), b.pin_memory()
        return a, b


def _qkv_slices(qkv: nn.Module) -> list[_Slice]:
    d = qkv.head_dim
    q, kv = qkv.num_heads * d, qkv.num_kv_heads * d
    full_q, full_kv = q * qkv.tp_size, qkv.total_num_kv_heads * d
    return [_Slice("q_proj", 0, q, (qkv.tp_rank * q, q, full_q)),
            _Slice("k_proj", q, kv, (qkv.kv_head_offset * d, kv, full_kv)),
            _Slice("v_proj", q + kv, kv, (qkv.kv_head_offset * d, kv, full_kv))]

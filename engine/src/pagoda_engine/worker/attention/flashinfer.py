"""FlashInfer paged attention on CUDA.

Owns the two FlashInfer wrappers and the per-step plan: prefill chunks (any query length, causal,
starting after cached tokens) go to `BatchPrefillWithPagedKVCacheWrapper` (FA3 on Hopper when
FlashInfer picks it), decodes (one query token each) to `BatchDecodeWithPagedKVCacheWrapper`
(tensor cores for grouped-query attention). Both run in the same step: decodes are the first
`num_decodes` rows of q, prefill chunks the rest. `plan` builds the CSR page tables on the CPU
from the step's page tables once per step; `forward` rotates q and k (when the layer hands its
rotary over) and writes K/V through the slot mapping in one Triton kernel (`rope_kv_triton.py`),
then attends.

CUDA graphs: `plan_graph_decode` plans a decode batch padded to a captured batch size into fixed
buffers (one cuda-graph decode wrapper per size, all sharing those buffers), so a graph captured
after one such plan replays correctly after any later one. Padding rows attend to one slot of the
reserved null page 0 and write their K/V there; nobody reads it. Batches of one or two short
requests, and of `decode_triton.LARGE_BATCH` requests or more whose contexts are at most
`LARGE_CONTEXT` tokens, take the Triton kernels of `decode_triton.py` instead (one or two
requests: one launch a layer where FlashInfer's decode makes two, about 3-5 µs a layer less at
L1's lengths; large batches: K/V read 7-13 % faster on an H200): those sizes get a second graph
each, and `plan_graph_decode` says which of the two a batch replays. Eager steps take the same
kernel a graph of their size would, and a mixed step's decode rows the large-batch kernel where
they are that many.

FP8 pages (`KVCacheSpec.quantized`): the plans name e4m3 pages and bf16 queries (FlashInfer's
"auto" then runs its FA2 kernels), the fused write quantizes, the Triton decode kernels widen the
values as they load them, and the layer's scales are folded into q and the output here (`base`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import flashinfer  # ImportError here makes `get_attention_backend("auto")` fall back to the reference
import numpy as np
import torch

import pagoda_engine.worker.attention.decode_triton as decode_triton
import pagoda_engine.worker.attention.verify_triton as verify_triton
from pagoda_engine.worker.attention.base import AttentionBackend, AttentionBatch, HeadNorm, KVCacheSpec, Rotary
from pagoda_engine.worker.attention.rope_kv_triton import rope_and_write_kv

# FlashInfer's split-KV scratch, shared by every wrapper (they run one after the other on one
# stream); `init_graph_buffers` grows it where the largest graph batch needs more.
WORKSPACE_BYTES = 256 << 20
# Grouped-query attention with this many query heads per KV head runs faster on tensor cores
# (H200, 32/8 heads of 128, 1k-token contexts: batch 64 78 vs 104 us per layer, batch 150 153 vs
# 208 us). Small batches gain nothing from the CUDA-core kernel end to end: L1 measured 5.7-5.8 ms
# per token with tensor cores, 6.0 ms with CUDA cores below 16 sequences.
TENSOR_CORE_MIN_GROUP = 4


def graph_decode_workspace_bytes(num_qo_heads: int, num_kv_heads: int, head_dim: int, batch_size: int) -> int:
    """Float scratch a CUDA-graph decode plan of `batch_size` rows takes in FlashInfer 0.6's
    scheduler: a graph plan always splits KV and sizes its partial outputs (float32 values and
    log-sum-exps) for the worst case of its batch, `ceil(rows * group / tile) + rows - 1` query
    tiles of `tile` rows per query head (PrefillPlan's graph branch), plus 16 MiB for the rest."""
    group = num_qo_heads // num_kv_heads
    tile = 16 if group <= 16 else 64 if group <= 64 else 128  # FA2DetermineCtaTileQ's choice
    tiles = -(-batch_size * group // tile) + batch_size - 1
    return num_qo_heads * tiles * tile * (head_dim + 1) * 4 + (16 << 20)


def page_table_csr(page_tables: list[list[int]], seq_lens: list[int], page_size: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kv_indptr [B+1], kv_indices, kv_last_page_len [B]), int32: FlashInfer's CSR page table of
    the pages that hold each request's first `seq_len` tokens."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    counts = (lens + page_size - 1) // page_size
    for table, n, seq_len in zip(page_tables, counts.tolist(), seq_lens):
        if seq_len < 1 or len(table) < n:
            raise ValueError(f"page table of {len(table)} pages cannot hold {seq_len} tokens")
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    indices = np.fromiter(itertools.chain.from_iterable(t[:n] for t, n in zip(page_tables, counts.tolist())),
                          dtype=np.int32, count=int(indptr[-1]))
    last_page_len = (lens - (counts - 1) * page_size).astype(np.int32)
    return indptr, indices, last_page_len


def _to_device(array: np.ndarray, buffer: torch.Tensor) -> torch.Tensor:
    """`array` into the front of the device `buffer` from pinned memory, without waiting; the
    filled view."""
    view = buffer[:len(array)]
    view.copy_(torch.from_numpy(array).pin_memory(), non_blocking=True)
    return view


class _Recorder:
    """Stands in for a wrapper's compiled module during one `run`: passes every call through and
    keeps it."""

    def __init__(self, module):
        self.module = module
        self.calls: list[tuple] = []

    def __getattr__(self, name: str):
        fn = getattr(self.module, name)
        if not callable(fn):
            return fn

        def record(*args, **kwargs):
            self.calls.append((fn, args, kwargs))
            return fn(*args, **kwargs)
        return record


class _Replay:
    """One wrapper's kernel call for the planned step, taken from FlashInfer's own `run` at the
    step's first layer and made again for each later layer with that layer's q, K/V pages and
    output. `run` checks its inputs and rebuilds some forty arguments on every call, which cost
    more host time than the launch itself, and an eager step makes one or two calls per layer."""

    def __init__(self, fn, args: tuple, kwargs: dict, where: dict[int, int]):
        self.fn, self.args, self.kwargs = fn, list(args), kwargs
        self.where = where  # argument index -> which of (q, k pages, v pages, out) goes there

    @classmethod
    def record(cls, wrapper, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor],
               out: torch.Tensor) -> _Replay | None:
        """Run `wrapper` once, and return the call that replays it, or None where the call does
        not hand these four tensors to the kernel as they are (then every layer calls `run`)."""
        module = getattr(wrapper, "_cached_module", None)
        if module is None:
            wrapper.run(q, pages, out=out)
            return None
        recorder = _Recorder(module)
        wrapper._cached_module = recorder
        try:
            wrapper.run(q, pages, out=out)
        finally:
            wrapper._cached_module = module
        if len(recorder.calls) != 1:
            return None
        fn, args, kwargs = recorder.calls[0]
        ours = (q, pages[0], pages[1], out)
        where = {i: j for i, a in enumerate(args) for j, t in enumerate(ours) if _same_tensor(a, t)}
        if sorted(where.values()) != [0, 1, 2, 3] or any(
                _refers_to(v, t) for v in kwargs.values() for t in ours):
            return None
        return cls(fn, args, kwargs, where)

    def __call__(self, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
        ours = (q, pages[0], pages[1], out)
        args = self.args
        for i, j in self.where.items():
            args[i] = ours[j]
        self.fn(*args, **self.kwargs)


def _same_tensor(a, t: torch.Tensor) -> bool:
    return a is t or (isinstance(a, torch.Tensor) and a.data_ptr() == t.data_ptr() and a.shape == t.shape
                      and a.stride() == t.stride() and a.dtype == t.dtype)


def _refers_to(a, t: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.data_ptr() == t.data_ptr()


@dataclass
class _Step:
    num_decodes: int  # rows [0, num_decodes) of q are decodes
    num_prefill_tokens: int  # rows after them are prefill chunks
    decode: object | None  # the decode wrapper planned for this step
    slots: torch.Tensor  # int64 [T]: page * page_size + offset of each new token's K/V
    replays: dict[int, _Replay | None] = field(default_factory=dict)  # id(wrapper) -> its recorded call
    # The decodes take this `decode_triton` kernel over the CSR page table (on the device) instead
    # of `decode`.
    triton: tuple[object, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def run(self, wrapper, q: torch.Tensor, pages: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
        """`wrapper.run(q, pages, out=out)` as planned: the first layer's call is recorded, later
        layers replay it."""
        key = id(wrapper)
        if key not in self.replays:
            self.replays[key] = _Replay.record(wrapper, q, pages, out)
            return
        replay = self.replays[key]
        if replay is None:
            wrapper.run(q, pages, out=out)
        else:
            replay(q, pages, out)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, spec: KVCacheSpec, num_pages: int, device: torch.device):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, got {device}")
        if spec.query_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"the flashinfer attention backend needs float16 or bfloat16, got {spec.query_dtype} "
                             "(use --dtype bfloat16 or --attention-backend torch)")
        if spec.quantized and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("FP8 KV pages (--kv-cache-dtype fp8) need a GPU of compute capability 8.9 or newer "
                             f"(Ada, Hopper); this one is {torch.cuda.get_device_capability(device)}")
        super().__init__(spec, num_pages, device)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.use_tensor_cores = spec.num_qo_heads // spec.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
        self._step: _Step | None = None
        self._plan_copied: torch.cuda.Event | None = None  # see `_wait_for_last_plan`
        # CUDA-graph decode state, made by `init_graph_buffers`.
        self._graph_wrappers: dict[int, object] = {}
        self._graph_bufs: dict[str, torch.Tensor] = {}
        self._small_decode = self._large_decode = None  # the Triton decode kernels, where they serve these heads
        if decode_triton.applies(spec.num_qo_heads, spec.num_kv_heads, spec.head_dim):
            self._small_decode = decode_triton.SmallBatchDecode(decode_triton.MAX_BATCH, spec.num_qo_heads,
                                                                spec.num_kv_heads, spec.head_dim, spec.page_size,
                                                                device)
            self._large_decode = decode_triton.LargeBatchDecode(spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                                                                spec.page_size)
        # Speculative decoding's verification graphs (`init_verify_buffers`): the kernel and its buffers.
        self._verify: verify_triton.VerifyDecode | None = None
        self._verify_bufs: dict[str, torch.Tensor] = {}
        # Each layer's K and V pages as FlashInfer's run splits them, made once.
        self._kv_views = [tuple(cache.unbind(1)) for cache in self.kv_caches]

    def _share_scheduling_workspace(self, wrapper) -> None:
        # Each wrapper makes its own 8 MiB scheduling workspace (and a pinned host twin): dozens of
        # graph sizes would hold hundreds of MiB outside the KV budget. A step plans exactly one
        # decode wrapper right before running it, so the graph ones share the eager one's.
        wrapper._int_workspace_buffer = self.decode_wrapper._int_workspace_buffer
        wrapper._pin_memory_int_workspace_buffer = self.decode_wrapper._pin_memory_int_workspace_buffer

    def _wait_for_last_plan(self) -> None:
        """FlashInfer plans into pinned host buffers that a non-blocking copy reads once the stream
        gets there. Under async scheduling the last step may still be queued behind the one before
        it: wait for its copy (recorded after its plan) before a new plan overwrites those buffers.
        The step before is resolved by then, so this costs nothing."""
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        self._plan_copied = None

    def _mark_plan_copied(self) -> None:
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()

    def _kv_args(self) -> dict:
        s = self.spec
        # FP8 pages with bfloat16 queries: FlashInfer's "auto" takes its FA2 kernels then (FA3 wants
        # FP8 queries too), which convert the pages as they load them.
        return dict(q_data_type=s.query_dtype, kv_data_type=s.dtype)

    # --- eager plan ------------------------------------------------------------------------------
    def plan(self, batch: AttentionBatch) -> None:
        self._wait_for_last_plan()
        s = self.spec
        nd = batch.num_decodes
        for q_len, seq_len in zip(batch.query_lens, batch.seq_lens):
            if not 0 < q_len <= seq_len:
                raise ValueError(f"query_len {q_len} must be in [1, seq_len {seq_len}]")
        if any(q != 1 for q in batch.query_lens[:nd]):
            raise ValueError("the first num_decodes requests must have query_len 1")
        decode = triton = None
        num_prefill_tokens = sum(batch.query_lens[nd:])
        # As a decode graph of this size would: the same kernel, eager or replayed; a mixed step's
        # decode rows too where they are a large batch.
        kernel = self._triton_kernel(nd, batch.seq_lens[:nd]) if nd else None
        if kernel is not None and (not num_prefill_tokens or kernel is self._large_decode):
            csr = page_table_csr(batch.page_tables[:nd], batch.seq_lens[:nd], s.page_size)
            if kernel is self._large_decode:
                csr = (*csr, decode_triton.longest_first(batch.seq_lens[:nd]))
            triton = (kernel, tuple(torch.from_numpy(a).pin_memory().to(self.device, non_blocking=True) for a in csr))
        elif nd:
            indptr, indices, last = page_table_csr(batch.page_tables[:nd], batch.seq_lens[:nd], s.page_size)
            decode = self.decode_wrapper
            decode.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last),
                        s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size, **self._kv_args())
        if num_prefill_tokens:
            indptr, indices, last = page_table_csr(batch.page_tables[nd:], batch.seq_lens[nd:], s.page_size)
            qo_indptr = np.zeros(batch.num_reqs - nd + 1, dtype=np.int32)
            np.cumsum(batch.query_lens[nd:], out=qo_indptr[1:])
            self.prefill_wrapper.plan(torch.from_numpy(qo_indptr), torch.from_numpy(indptr), torch.from_numpy(indices),
                                      torch.from_numpy(last), s.num_qo_heads, s.num_kv_heads, s.head_dim,
                                      s.page_size, causal=True, **self._kv_args())
        self._mark_plan_copied()
        self._step = _Step(nd, num_prefill_tokens, decode, batch.slot_mapping.to(self.device, torch.int64),
                           triton=triton)

    def _triton_kernel(self, num_rows: int, seq_lens: list[int]):
        """The `decode_triton` kernel that serves decode rows of these lengths best, or None
        (FlashInfer's decode): one or two of up to `SHORT_CONTEXT` tokens, or `LARGE_BATCH` or more
        of up to `LARGE_CONTEXT`."""
        if True not in self.graph_variants(num_rows):
            return None
        if num_rows <= decode_triton.MAX_BATCH:
            return self._small_decode if max(seq_lens) <= decode_triton.SHORT_CONTEXT else None
        return self._large_decode if max(seq_lens) <= decode_triton.LARGE_CONTEXT else None

    # --- CUDA-graph decode ---------------------------------------------------------------------------
    def init_graph_buffers(self, batch_sizes: list[int], max_pages_per_seq: int) -> None:
        """Fixed buffers and one cuda-graph decode wrapper per batch size (all share the buffers)."""
        max_bs = max(batch_sizes)
        dev = self.device
        s = self.spec
        need = graph_decode_workspace_bytes(s.num_qo_heads, s.num_kv_heads, s.head_dim, max_bs)
        if need > self.workspace.numel():  # e.g. 1,024-row graphs of 32 query heads (FlashInfer asked 335 MB)
            self.workspace = torch.zeros(need, dtype=torch.uint8, device=dev)
            for wrapper in (self.prefill_wrapper, self.decode_wrapper):
                wrapper.reset_workspace_buffer(self.workspace, wrapper._int_workspace_buffer)
        self._graph_bufs = dict(
            indptr=torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            indices=torch.zeros(max_bs * max_pages_per_seq, dtype=torch.int32, device=dev),
            last_page_len=torch.ones(max_bs, dtype=torch.int32, device=dev),
            slots=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            order=torch.zeros(max_bs, dtype=torch.int32, device=dev),  # the large-batch kernel's program order
        )
        b = self._graph_bufs
        for bs in batch_sizes:
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=b["indptr"][:bs + 1], paged_kv_indices_buffer=b["indices"],
                paged_kv_last_page_len_buffer=b["last_page_len"][:bs])
            self._share_scheduling_workspace(wrapper)
            self._graph_wrappers[bs] = wrapper

    def graph_variants(self, batch_size: int) -> tuple[bool, ...]:
        """The graphs a decode batch of `batch_size` rows is captured as: False, FlashInfer's
        decode; True, a `decode_triton` kernel (`plan_graph_decode(..., triton=True)`): the
        small-batch one up to `MAX_BATCH` rows, the large-batch one from `LARGE_BATCH`."""
        if self._small_decode is not None and (batch_size <= decode_triton.MAX_BATCH
                                               or batch_size >= decode_triton.LARGE_BATCH):
            return (False, True)
        return (False,)

    def plan_graph_decode(self, batch: AttentionBatch, padded_size: int, triton: bool | None = None) -> bool:
        """Plan an all-decode batch padded to `padded_size` rows into the fixed graph buffers, for
        the graph variant `triton` (see `graph_variants`; None: the one that serves this batch
        best). Returns the variant planned."""
        s = self.spec
        n = batch.num_reqs
        if batch.num_decodes != n or n > padded_size or padded_size not in self._graph_wrappers:
            raise ValueError(f"cannot plan {n} requests ({batch.num_decodes} decodes) as a graph of {padded_size}")
        if triton is None:
            triton = self._triton_kernel(padded_size, batch.seq_lens) is not None
        elif triton not in self.graph_variants(padded_size):
            raise ValueError(f"no Triton decode graph of {padded_size} rows")
        pad = padded_size - n
        # Each padding row: one page, the null page 0, holding one token.
        tables = batch.page_tables + [[0]] * pad
        indptr, indices, last = page_table_csr(tables, batch.seq_lens + [1] * pad, s.page_size)
        if len(indices) > self._graph_bufs["indices"].numel():
            raise ValueError(f"{len(indices)} pages exceed the graph page buffer")
        b = self._graph_bufs
        # The page ids go to the graph's buffer from pinned memory, without waiting; the wrapper is
        # then handed that buffer itself, which it recognises and does not copy. Handed host ids, its
        # cuda-graph plan copies them with a blocking copy: a wait for the whole step in flight.
        device_indices = _to_device(indices, b["indices"])
        self._wait_for_last_plan()
        triton_step = None
        if triton:  # the kernel reads the CSR straight from the graph buffers
            kernel = self._small_decode if padded_size <= decode_triton.MAX_BATCH else self._large_decode
            csr = (_to_device(indptr, b["indptr"]), device_indices, _to_device(last, b["last_page_len"]))
            if kernel is self._large_decode:  # padding rows (one token) go last
                csr = (*csr, _to_device(decode_triton.longest_first(batch.seq_lens + [1] * pad), b["order"]))
            triton_step = (kernel, csr)
        else:
            self._graph_wrappers[padded_size].plan(
                torch.from_numpy(indptr), device_indices, torch.from_numpy(last),
                s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size, **self._kv_args())
        self._mark_plan_copied()
        slots = b["slots"][:padded_size]
        slots[n:].zero_()
        slots[:n].copy_(batch.slot_mapping, non_blocking=True)
        self._step = _Step(padded_size, 0, None if triton else self._graph_wrappers[padded_size], slots,
                           triton=triton_step)
        return triton

    # --- CUDA-graph verification (speculative decoding) --------------------------------------------
    def can_verify(self, query_len: int) -> bool:
        """Whether verification steps of up to `query_len` new tokens a request can run in CUDA
        graphs here (`verify_triton.applies`)."""
        s = self.spec
        return verify_triton.applies(s.num_qo_heads, s.num_kv_heads, s.head_dim, query_len)

    def init_verify_buffers(self, max_batch_size: int, query_len: int, max_pages_per_seq: int) -> None:
        """The verification kernel for up to `max_batch_size` requests of up to `query_len` new
        tokens each, and the fixed buffers its graphs read (`plan_graph_verify`)."""
        s, dev = self.spec, self.device
        self._verify = verify_triton.VerifyDecode(max_batch_size, query_len, s.num_qo_heads, s.num_kv_heads,
                                                  s.head_dim, s.page_size, dev)
        self._verify_bufs = dict(
            indptr=torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev),
            indices=torch.zeros(max_batch_size * max_pages_per_seq, dtype=torch.int32, device=dev),
            last_page_len=torch.ones(max_batch_size, dtype=torch.int32, device=dev),
            qo_len=torch.ones(max_batch_size, dtype=torch.int32, device=dev),
            rows=torch.zeros(max_batch_size * query_len, dtype=torch.int64, device=dev),
            slots=torch.zeros(max_batch_size * query_len, dtype=torch.int64, device=dev),
        )

    def plan_graph_verify(self, batch: AttentionBatch, padded_size: int) -> torch.Tensor:
        """Plan a batch of requests of 1 .. query_len new tokens each (`verify_triton`'s padded
        layout) padded to `padded_size` requests into the fixed verification buffers. Returns the
        padded row of each new token (int64 on the device, `verify_triton.padded_rows`): where the
        graph's inputs go and its outputs come from. Padding rows write their K/V to the null
        page's first slot; padding requests attend to it."""
        s, b = self.spec, self._verify_bufs
        query_len = self._verify.query_len
        n = batch.num_reqs
        pad = padded_size - n
        if n > padded_size or padded_size > self._verify.max_batch:
            raise ValueError(f"cannot plan {n} requests as a verification graph of {padded_size}")
        rows = verify_triton.padded_rows(batch.query_lens, query_len)  # ValueError past query_len
        indptr, indices, last = page_table_csr(batch.page_tables + [[0]] * pad, batch.seq_lens + [1] * pad,
                                               s.page_size)
        if len(indices) > b["indices"].numel():
            raise ValueError(f"{len(indices)} pages exceed the verification graph's page buffer")
        self._wait_for_last_plan()
        csr = (_to_device(indptr, b["indptr"]), _to_device(indices, b["indices"]), _to_device(last, b["last_page_len"]),
               _to_device(np.asarray(batch.query_lens + [1] * pad, dtype=np.int32), b["qo_len"]))
        device_rows = _to_device(rows, b["rows"])
        self._mark_plan_copied()
        slots = b["slots"][:padded_size * query_len]
        slots.zero_()
        slots.index_copy_(0, device_rows, batch.slot_mapping.to(torch.int64))
        # Every row goes to the kernel as a "decode" row of the padded layout.
        self._step = _Step(padded_size * query_len, 0, None, slots, triton=(self._verify, csr))
        return device_rows

    # --- per layer -------------------------------------------------------------------------------
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                rotary: Rotary | None = None, q_norm: HeadNorm | None = None,
                k_norm: HeadNorm | None = None) -> torch.Tensor:
        st = self._step
        if st is None:
            raise RuntimeError("plan(batch) must run before forward")
        if self.layer_hook is not None:
            self.layer_hook(layer_id)
        cache = self.kv_caches[layer_id]
        # q usually stays a strided view of the qkv projection's output: these kernels and
        # FlashInfer's take row and head strides, so no copy is made.
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        # One kernel: q normalised and rotated in place, every new token's K (normalised, rotated)
        # and V into its slot.
        rope = (positions, rotary.cos_cache, rotary.sin_cache) if rotary is not None else ()
        norms = {}
        if q_norm is not None:
            norms = dict(q_norm=(q_norm.weight, q_norm.eps), k_norm=(k_norm.weight, k_norm.eps))
        k_scale, v_scale = self.spec.kv_scales(layer_id)
        rope_and_write_kv(cache, st.slots, q, k, v, *rope, **norms, scales=(k_scale, v_scale))
        if k_scale != 1.0:  # FP8 pages' K scale, folded into the queries (`base`)
            q.mul_(k_scale)
        nd = st.num_decodes
        if out is None:
            out = torch.empty_like(q)
        pages = self._kv_views[layer_id]
        if st.triton is not None:
            kernel, csr = st.triton
            kernel(q[:nd], *pages, *csr, out=out[:nd])
            if st.num_prefill_tokens:
                st.run(self.prefill_wrapper, q[nd:], pages, out[nd:])
        elif not st.num_prefill_tokens:
            st.run(st.decode, q, pages, out)
        elif not nd:
            st.run(self.prefill_wrapper, q, pages, out)
        else:
            st.run(st.decode, q[:nd], pages, out[:nd])
            st.run(self.prefill_wrapper, q[nd:], pages, out[nd:])
        if v_scale != 1.0:  # FP8 pages' V scale, folded into the output
            out.mul_(v_scale)
        return out

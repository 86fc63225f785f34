"""One rank of the model: its device, its shard of the weights, its KV pages and CUDA graphs.

The executor calls a `Worker`'s methods by name on every rank at once (`Executor.collective_rpc`):
rank 0's Worker lives in the engine core's process and is called directly; every other rank's
lives in a process of its own (`main`, started by the executor or, on another host, by hand),
which serves calls until `shutdown`. Under tensor parallelism each rank holds one shard of the
weights (`model/layers.py`) and its own KV pool with the same page count, and every rank runs
the same forward: the all-reduces inside the model keep them in step.

Under pipeline parallelism a rank holds only its stage's layers (`parallel_state.pp_layer_partition`)
and KV pages for those; every rank is called with the step's tensors (broadcast over the world
group), a stage receives (x, residual) from the stage before over its PP group and sends its own
to the next, and only the last stage has the LM head: it computes the logits and samples
(`sample`), and its sampled tokens go back to rank 0 (with the log-probabilities of the rows that
asked for logprobs; prompt logprobs take the logits themselves, `compute_logits`). Each stage
replays CUDA graphs of its own layers (`cuda_graphs.py`); the transfers between stages stay
outside them (`execute_model`). With PAGODA_DIST_BACKEND=gloo the CUDA ranks' groups are gloo
ones that pass tensors through host memory (`TPGroup`), and several ranks may share one GPU: a
slow way to run pipeline parallelism, graphs included, on one GPU.

With expert parallelism across data-parallel engine cores (`data_parallel`), each rank also joins
the pod's store (hosted by core 0's first rank) and its DP group (the ranks of its TP position in
every core): the MoE layers dispatch over it (`moe.DataParallelDispatch`), every forward first
agrees with the other cores on its shape over a gloo group of the same ranks (decode steps padded
to a common size, replayed in the same CUDA graph on every core: `dp_padding.py`), and a core
with nothing to run joins its siblings' forwards with `execute_dummy_batch`. Core processes (local rank 0) also agree
over that gloo group whether any core has work or is stopping (`agree_with_cores`).

A method's result travels back pickled: methods called on every rank return small values (or
None); the big ones (hidden states, logits) are only ever read on rank 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import importlib
import logging
import os
import pickle
import signal
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import zmq

from pagoda_engine import envs
from pagoda_engine.eplb import EPLBConfig
from pagoda_engine.kv_tiers import OffloadEvents, OffloadSetup, OffloadStarted
from pagoda_engine.lora import LoRAAdapterError
from pagoda_engine.processes import (die_with_parent, freeze_gc_heap, pause_collections_for_start_up,
                                     resume_collections, set_torch_threads)
from pagoda_engine.worker import eplb as expert_balance
from pagoda_engine.worker.attention import get_attention_backend
from pagoda_engine.worker.attention.base import AttentionBackend, AttentionBatch, KVCacheSpec
from pagoda_engine.worker.compile_ahead import compile_ahead, compile_workers, start_compile_pool, stop_compile_pool
from pagoda_engine.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs, linear_row_costs, stage_forward
from pagoda_engine.worker.drafter import Drafter, load_drafter
from pagoda_engine.worker.verify_graphs import VerifyGraphs
from pagoda_engine.worker.dp_padding import CoreStepAgreement, is_all_decode, padded_batch
from pagoda_engine.worker.kv_offload import KVOffloader
from pagoda_engine.worker import kv_transfer
from pagoda_engine.worker.model.layers import TPGroup, VocabParallelEmbedding, attach_tp_group
from pagoda_engine.worker.model.loader import load_hf_config, load_model
from pagoda_engine.worker.model.lora import LoRAManager
from pagoda_engine.worker.model.moe import ALLGATHER, DataParallelDispatch, attach_dp_dispatch
from pagoda_engine.worker.parallel_state import DataParallelRank, ParallelLayout, dist_backend, pod_layout
from pagoda_engine.worker.profiler import RankProfiler
from pagoda_engine.worker.rpc import Call, Hello, Reply, read_run, receive_tensors, restore_tensors, store_alive
from pagoda_engine.worker.sampling import (Sampler, SamplingBatch, make_sampler, note_sampler_kernels,
                                          warm_up_sampler)

logger = logging.getLogger(__name__)

# An idle worker checks this often that rank 0 is still there.
_MASTER_CHECK_S = 2


class Arriving:
    """A value other pipeline stages are still sending: `wait()` waits for its receives."""

    def __init__(self, value, works=()):
        self.value = value
        self.works = list(works)

    def wait(self):
        for work in self.works:
            work.wait()
        self.works = []
        return self.value


class Worker:
    """Rank `rank` of `layout`, on `device`; `store` is the run's TCPStore (process groups meet there);
    `data_parallel`: this core's place among the pod's cores when the experts span them."""

    def __init__(self, layout: ParallelLayout, rank: int, device: torch.device, store=None,
                 data_parallel: DataParallelRank | None = None):
        self.layout = layout
        self.data_parallel = data_parallel
        self.dp_dispatch: DataParallelDispatch | None = None
        self.dp_padding: CoreStepAgreement | None = None  # experts across cores: each forward's agreed shape
        self.expert_load: expert_balance.ExpertLoad | None = None  # experts across cores: tokens per expert
        self.balancer: expert_balance.ExpertBalancer | None = None  # --enable-eplb
        self.rank = rank
        self.coordinates = layout.coordinates(rank)
        self.device = torch.device(device)
        self.store = store
        self.model: torch.nn.Module | None = None
        self.dtype: torch.dtype | None = None
        self.tp_group: TPGroup | None = None
        self.whole_embedding: torch.nn.Module | None = None  # rank 0, for an EAGLE-3 head under TP (`gather_embedding`)
        # Every step eagerly (`run_eagerly`): an EAGLE-3 head reads the target's hidden states of
        # every forward, which only the eager forward keeps; every rank alike, so that no rank
        # replays a graph while another runs the same collectives eagerly.
        self.eager_steps = False
        self.pp_group: TPGroup | None = None  # this rank's pipeline: the same TP rank of every stage
        self.world_group: TPGroup | None = None
        self.hidden: torch.Tensor | None = None  # the last forward's hidden states (last stage only)
        self.sampler: Sampler | None = None  # under pipeline parallelism: the last stage's first TP rank
        self.attn: AttentionBackend | None = None
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None  # speculative decoding's verification steps
        self.offload: KVOffloader | None = None
        self.nixl: kv_transfer.NixlPages | None = None  # disaggregated prefill/decode over NIXL
        self.profiler: RankProfiler | None = None
        self.drafter: Drafter | None = None  # speculative decoding's drafting model (rank 0 only)
        self.lora: LoRAManager | None = None  # --enable-lora: this rank's adapter slots
        # This rank compiles its Triton kernels ahead, several at once, before the profile step,
        # the sampler's warm-up and the graphs' capture (`compile_ahead`): the executor decides it
        # for every rank (`start_compile_pool`), until the graphs are captured.
        self.compile_ahead = False
        self.serving = True

    @property
    def rpc_group(self) -> TPGroup | None:
        """The group a call's tensors are broadcast over: all ranks (the TP group without PP)."""
        return self.world_group if self.layout.pp > 1 else self.tp_group

    @property
    def is_first_stage(self) -> bool:
        return self.coordinates.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coordinates.pp_rank == self.layout.pp - 1

    def init_distributed(self) -> None:
        """Join this rank's groups; returns once every member has joined."""
        if self.layout.dp > 1:
            raise NotImplementedError("data parallelism inside one engine does not run (data_parallel_size is 1)")
        if self.layout.tp > 1:
            self.tp_group = make_group(self.store, self.layout, "tp", self.rank, self.device)
        if self.layout.pp > 1:
            self.pp_group = make_group(self.store, self.layout, "pp", self.rank, self.device)
            self.world_group = make_group(self.store, self.layout, "world", self.rank, self.device)
        if self.data_parallel is not None:
            self._join_data_parallel(self.data_parallel)

    def _join_data_parallel(self, dp: DataParallelRank) -> None:
        """Meet the same TP position of every other core in the pod's store: a device group for
        the MoE dispatch and a gloo one for token counts (on CPU the same group)."""
        store = dist.TCPStore(dp.master_addr, dp.master_port, is_master=dp.rank == 0 and self.rank == 0,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=envs.dist_timeout_s()))
        self.dp_store = store  # the master's listens as long as this worker lives
        pod, offset = pod_layout(self.layout, dp)
        counts = make_group(store, pod, "dp", offset + self.rank, torch.device("cpu"), name="dp-gloo")
        tokens = counts if self.device.type == "cpu" else make_group(store, pod, "dp", offset + self.rank, self.device)
        self.dp_dispatch = DataParallelDispatch(tokens, counts, dp.all2all_backend, self.device, dp.microbatches)
        if dp.padded_sizes:
            self.dp_padding = CoreStepAgreement(counts, list(dp.padded_sizes))
    @torch.inference_mode(False)  # ordinary parameters, as on rank 0: workers serve in inference mode
    def load_model(self, model_dir: str, dtype: torch.dtype, load_format: str, seed: int,
                   pp_partition: list[tuple[int, int]] | None = None, quantization: str | None = None) -> None:
        """This rank's shard of the weights (after `init_distributed`): with `pp_partition` (each
        stage's [start, end) layers) only its stage's layers."""
        torch.manual_seed(seed)
        layers = tuple(pp_partition[self.coordinates.pp_rank]) if pp_partition else None
        self.model = load_model(model_dir, load_hf_config(model_dir), dtype, self.device, load_format, seed,
                                self.layout.tp, self.coordinates.tp_rank,
                                enable_expert_parallel=self.layout.enable_expert_parallel, layers=layers,
                                data_parallel=(self.data_parallel.size, self.data_parallel.rank)
                                if self.data_parallel else (1, 0), quantization=quantization)
        self.dtype = dtype
        if self.is_last_stage and self.coordinates.tp_rank == 0:  # rank 0 without pipeline parallelism
            self.sampler = make_sampler(seed, self.device)
        if self.tp_group is not None:
            attach_tp_group(self.model, self.tp_group)
        if self.dp_dispatch is not None:
            attach_dp_dispatch(self.model, self.dp_dispatch)
            eplb = self.data_parallel.eplb
            self.expert_load, self.balancer = expert_balance.start(
                self.model, self.dp_dispatch.group, EPLBConfig(**eplb) if eplb is not None else None, self.layout.tp)

    def read_expert_load(self) -> list[list[int]]:
        """Experts across cores: [MoE layer][logical expert] tokens this rank's experts took since
        start-up (a device sync); empty otherwise."""
        return self.expert_load.read() if self.expert_load is not None else []

    def run_eagerly(self) -> None:
        """From now on this rank runs every step eagerly (see `eager_steps`)."""
        self.eager_steps = True

    def gather_embedding(self) -> None:
        """Every rank of the tensor-parallel group, at once: rank 0 keeps the target's whole token
        embedding (`whole_embedding`), which an EAGLE-3 head without one of its own embeds its
        tokens with, on rank 0 alone (the target's own embedding is sharded across the group)."""
        embed = self.model.model.embed_tokens
        shards = self.tp_group.all_gather(embed.weight.data)
        if self.rank == 0:
            whole = VocabParallelEmbedding(embed.vocab_size, embed.weight.shape[1]).to(embed.weight)
            whole.weight.data.copy_(torch.cat(shards)[:embed.vocab_size])
            self.whole_embedding = whole.requires_grad_(False)
        del shards

    def load_drafter(self, method: str, model_dir: str, load_format: str, seed: int) -> None:
        """Speculative decoding's drafting model (`drafter.py`), after the target's, on rank 0 (whole
        beside its shard under tensor parallelism; an EAGLE-3 head then embeds with the whole
        embedding `gather_embedding` left here)."""
        if self.layout.pp > 1 and method == "eagle3":
            raise RuntimeError("an EAGLE-3 head reads the target's hidden states of layers on several pipeline "
                               "stages (not under pipeline parallelism yet)")
        self.drafter = load_drafter(method, model_dir, self.model, self.model.config, self.dtype, self.device,
                                    load_format, seed, target_embed=self.whole_embedding)
        self.model.model.aux_hidden_layers = self.drafter.aux_layers

    def propose_drafts(self, plan) -> list[list[int]]:
        """The drafter's tokens for one engine step's `DraftPlan`."""
        return self.drafter.propose(plan)

    def warm_up_sampler(self) -> None:
        """The sampling rank (rank 0, or the last pipeline stage's first) draws once along each of
        its sampler's paths, so that the first requests do not wait for a kernel's JIT compile
        (`sampling.warm_up_sampler`; compiled ahead with this rank's `compile_ahead`)."""
        if self.sampler is not None:
            warm_up_sampler(self.sampler, self.model.vocab_size, self.dtype, self.device, self.compile_ahead)

    def freeze_gc_heap(self) -> None:
        """Start-up is over on this rank: its objects leave the collector's reach (`processes.freeze_gc_heap`)."""
        freeze_gc_heap()

    def resume_collections(self) -> None:
        """The engine has started: automatic collections again on a rank whose process paused
        them for its start-up (a worker rank's, an engine core's; `processes.resume_collections`)."""
        resume_collections()

    def collector_enabled(self) -> bool:
        """Whether Python's collector runs automatically on this rank."""
        return gc.isenabled()

    def parameter_names(self) -> list[str]:
        """The names of this rank's weights (which layers its stage holds)."""
        return [name for name, _ in self.model.named_parameters()]

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (pipeline stages hold different layers)."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def kv_cache_spec(self, page_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """This rank's KV page layout in pages of `dtype`: its stage's layers, its share of the heads."""
        return self.model.kv_cache_spec(page_size, dtype, self.dtype)

    def init_kv_cache(self, backend: str, spec: KVCacheSpec, num_pages: int) -> None:
        """Create the attention backend that owns this rank's KV pages: `num_pages` (the same on
        every rank) of `spec`'s page size and dtype, for this rank's own layers and heads."""
        self.attn = get_attention_backend(backend, self.kv_cache_spec(spec.page_size, spec.dtype), num_pages,
                                          self.device)
        if self.drafter is not None:
            # The drafter's pages stay in the model dtype (FP8 pages are the target's alone).
            self.drafter.init_kv_cache(backend, spec.page_size, self.dtype, num_pages)

    def init_lora(self, max_loras: int, max_lora_rank: int, max_cpu_loras: int, max_tokens: int) -> None:
        """--enable-lora: LoRA layers on every served projection, `max_loras` device slots
        (before the KV pool is sized, so the profile step counts them)."""
        self.lora = LoRAManager(self.model, max_loras, max_lora_rank, max_cpu_loras, max_tokens, self.dtype,
                                self.device)

    def add_lora(self, request) -> str | None:
        """Read and check an adapter into this rank's host memory: why it does not fit, or None.
        Returned, not raised: a worker rank's raised error would end the engine (`Executor`)."""
        try:
            self.lora.add(request)
        except LoRAAdapterError as e:
            return str(e)
        return None

    def remove_lora(self, name: str) -> None:
        self.lora.remove(name)

    def load_lora_slot(self, slot: int, request) -> None:
        """An adapter into a device slot, from host memory (or disk)."""
        self.lora.load_slot(slot, request)

    def init_kv_offload(self, setup: OffloadSetup) -> OffloadStarted:
        """This rank's side of the KV offload tiers (after `init_kv_cache`), under its own
        fingerprint: the core's and this rank's coordinates. Reports what its disk tier holds."""
        c = self.coordinates
        fingerprint = hashlib.blake2b(setup.fingerprint + f"tp {c.tp_rank}/{self.layout.tp} pp {c.pp_rank}/"
                                      f"{self.layout.pp}".encode(), digest_size=16).digest()
        self.offload = KVOffloader(self.attn.kv_caches, setup, fingerprint)
        disk = self.offload.disk
        return OffloadStarted(fingerprint, self.offload.payload_bytes,
                              disk.scan(self.offload.payload_bytes) if disk is not None else [])

    def kv_offload_store(self, *args) -> None:
        """`KVOffloader.store` (the core's decision, the same on every rank)."""
        self.offload.store(*args)

    def kv_offload_load(self, *args) -> None:
        """`KVOffloader.load`."""
        self.offload.load(*args)

    def kv_offload_poll(self) -> OffloadEvents:
        return self.offload.poll()

    def kv_transfer_send(self, *args) -> int:
        """`kv_transfer.send_pages` from this rank's pool (disaggregated prefill's producer)."""
        return kv_transfer.send_pages(self.attn.kv_caches, *args)

    def kv_transfer_recv(self, *args) -> int:
        """`kv_transfer.recv_pages` into this rank's pool (a consumer)."""
        return kv_transfer.recv_pages(self.attn.kv_caches, *args)

    def kv_transfer_nixl_start(self, name: str) -> tuple[bytes, str]:
        """Register this rank's pool with a NIXL agent; its metadata and memory type."""
        self.nixl = kv_transfer.NixlPages(self.attn.kv_caches, name)
        return self.nixl.metadata(), self.nixl.mem_type

    def kv_transfer_nixl_descs(self, page_ids: list[int]) -> list[list[int]]:
        return self.nixl.descs(page_ids)

    def kv_transfer_nixl_read(self, *args) -> int:
        """`kv_transfer.NixlPages.read` into this rank's pool (a consumer)."""
        return self.nixl.read(*args)

    def capture_graphs(self, batch_sizes: list[int], max_pages_per_seq: int, piecewise_sizes: list[int],
                       verify_sizes: list[int] = (), verify_query_len: int = 0) -> None:
        """Capture the decode forward at these batch sizes and, when `piecewise_sizes` is not
        empty, the piecewise forward at those token counts (after `init_kv_cache`); with
        `verify_sizes`, speculative decoding's verification forward of `verify_query_len` rows a
        request at those batch sizes (`verify_graphs.py`), where this rank can run it. Every rank
        captures the same sizes in the same order: the all-reduces inside pair up across ranks,
        and every pipeline stage picks the same graph and padded size for a step (its own layers'
        forward; the transfers between stages stay outside: `execute_model`). With this rank's
        `compile_ahead` the graphs' Triton kernels compile ahead, several at once; the pool goes
        afterwards."""
        if self.tp_group is not None and self.tp_group.stages_on_host:
            raise RuntimeError("tensor parallelism over gloo (PAGODA_DIST_BACKEND=gloo) cannot run in CUDA graphs: "
                               "its all-reduces pass through host memory")
        if self.dp_dispatch is not None:
            if self.dp_padding is None or self.dp_padding.sizes != sorted(batch_sizes) or piecewise_sizes:
                raise RuntimeError("experts across data-parallel cores: only decode graphs of the cores' padded sizes "
                                   "can be captured")
            self.dp_dispatch.begin_uniform()  # every core captures each size at once: equal pieces
            # The graphs' warm-up forwards take the exchange the graphs capture (the all-gather):
            # its lazy set-up stays out of the capture.
            backend, self.dp_dispatch.backend = self.dp_dispatch.backend, ALLGATHER
        pool = torch.cuda.graph_pool_handle()
        try:
            self.graphs = DecodeGraphs(self.model, self.attn, self.device, batch_sizes, max_pages_per_seq, pool,
                                       self.compile_ahead)
            if piecewise_sizes:
                self.piecewise = PiecewiseGraphs(self.model, self.attn, self.device, piecewise_sizes, pool,
                                                 self.compile_ahead)
            if verify_sizes and self.can_capture_verify(verify_query_len):
                self.verify_graphs = VerifyGraphs(self.model, self.attn, self.device, list(verify_sizes),
                                                  verify_query_len, max_pages_per_seq, pool, self.compile_ahead)
        finally:
            self.stop_compile_pool()
            if self.dp_dispatch is not None:
                self.dp_dispatch.backend = backend

    def can_capture_verify(self, query_len: int) -> bool:
        """Whether verification graphs of `query_len` rows a request can run on this rank: the
        attention backend has their kernel for these heads, the whole model is here, steps are not
        all eager (`eager_steps`), no LoRA adapters (their slots follow the step's own rows, not the
        graphs' padded blocks: such steps run as prefill steps do), and no experts across cores
        (the cores pad decode steps only: a verification step runs eagerly on every core)."""
        can = getattr(self.attn, "can_verify", None)
        return (can is not None and can(query_len) and self.layout.pp == 1 and self.lora is None
                and self.dp_dispatch is None and not self.eager_steps)

    def piecewise_row_costs(self, sizes: list[int]) -> dict[int, float]:
        """Device µs of one of this rank's layers' dense projections at each of `sizes` rows
        (`linear_row_costs`): the executor leaves out the piecewise sizes cuBLAS runs slowly."""
        return linear_row_costs(self.model, sizes, self.device, self.dtype)

    def start_compile_pool(self, ranks_on_node: int) -> None:
        """Start this rank's compile processes now, before the weights load (`create_executor`),
        so that they have imported torch and Triton by the profile step (`compile_ahead` keeps
        them to the graphs' capture): its share of this node's CPUs among `ranks_on_node` ranks.
        From here on this rank compiles ahead (`compile_ahead`)."""
        start_compile_pool(compile_workers(ranks_on_node))
        self.compile_ahead = True

    def stop_compile_pool(self) -> None:
        """No more compiling ahead (the graphs are captured, or none will be): the pool goes."""
        stop_compile_pool()
        self.compile_ahead = False

    def graph_replays(self) -> dict[str, int]:
        """How many steps this rank ran as decode, piecewise and verification graphs."""
        return {"decode": self.graphs.replays if self.graphs else 0,
                "piecewise": self.piecewise.replays if self.piecewise else 0,
                "verify": self.verify_graphs.replays if self.verify_graphs else 0}

    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      batch: AttentionBatch) -> torch.Tensor | None:
        """Plan attention for `batch`, run the forward; hidden states [num_tokens, hidden_size]
        (kept for `compute_logits`; None on a pipeline stage other than the last): a
        whole-forward graph replay for all-decode steps that fit one, piecewise replays for
        other short steps, else eagerly. A later pipeline stage receives the stage before's
        (x, residual) into the graph's fixed input first; a stage before the last sends the
        graph's fixed output on after the replay."""
        if self.offload is not None:
            self.offload.wait_for_loads()  # pages the step reads may still be arriving from host memory
        if self.lora is not None:
            self.lora.set_batch(batch.query_lens, batch.lora_slots)
        if self.dp_padding is not None:
            self.hidden = self._execute_across_cores(input_ids, positions, batch)
            if self.balancer is not None:
                self.balancer.after_forward()
            return self.hidden
        graphs = self._graphs_for(batch)
        if graphs is None:
            self.attn.plan(batch)
            self.hidden = self._forward(input_ids, positions, self.attn)
            self._keep_target_hidden(batch.slot_mapping)
            return self.hidden
        if not self.is_first_stage:
            self.pp_group.recv(graphs.input_buffer(batch), self.coordinates.pp_rank - 1)
        out = graphs.run(input_ids, positions, batch)
        if not self.is_last_stage:
            self.pp_group.send(out, self.coordinates.pp_rank + 1)
            out = None
        self.hidden = out
        return out

    def _execute_across_cores(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                              idle: bool = False) -> torch.Tensor:
        """A forward (this core's step, or with `idle` its dummy batch) in the shape the cores
        agree on (`dp_padding.py`): a decode step padded to the common size, replayed as a graph
        where they were captured, else eagerly; any other at every core's own count."""
        size = self.dp_padding.agree(0 if idle else batch.num_tokens, is_all_decode(batch))
        if size is None:
            self.dp_dispatch.set_counts(self.dp_padding.counts, self.dp_padding.real)
            self.attn.plan(batch)
            out = self._forward(input_ids, positions, self.attn, counted=True)
        else:
            self.dp_dispatch.begin_uniform(self.dp_padding.real)
            if self.graphs is not None and not self.eager_steps:
                return self.graphs.run(input_ids, positions, batch, size)
            ids, pos, padded = padded_batch(input_ids, positions, batch, size)
            self.attn.plan(padded)
            out = self._forward(ids, pos, self.attn, counted=True)[:batch.num_reqs]
        if not idle:
            self._keep_target_hidden(batch.slot_mapping)
        return out

    def _keep_target_hidden(self, slot_mapping: torch.Tensor) -> None:
        """An EAGLE-3 drafter's inputs from the eager forward just run: the target's hidden states
        at its layers, for the step's own tokens (the first rows: padding rows come after)."""
        if self.drafter is not None and self.drafter.reads_target_hidden:
            n = slot_mapping.shape[0]
            self.drafter.store_target_hidden([h[:n] for h in self.model.model.aux_hidden], slot_mapping)

    def _graphs_for(self, batch: AttentionBatch) -> DecodeGraphs | VerifyGraphs | PiecewiseGraphs | None:
        """The graphs that run `batch` (the same kind and size on every rank), or None: eagerly
        (always with `eager_steps`)."""
        if self.eager_steps:
            return None
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs
        if self.verify_graphs is not None and self.verify_graphs.fits(batch):
            return self.verify_graphs
        if self.piecewise is not None and self.piecewise.fits(batch):
            return self.piecewise
        return None

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor | None:
        """float32 logits over the whole vocabulary for these rows of the last forward's hidden
        states; under pipeline parallelism computed on the last stage and returned on rank 0
        (None on the other ranks)."""
        if self.layout.pp == 1:
            return self.model.compute_logits(self.hidden[rows])
        if self.is_last_stage:
            logits = self.model.compute_logits(self.hidden[rows])
            if self.coordinates.tp_rank == 0:
                self.pp_group.send(logits, 0)
        elif self.rank == 0:
            logits = torch.empty(rows.shape[0], self.model.vocab_size, dtype=torch.float32, device=self.device)
            return self.pp_group.recv(logits, self.layout.pp - 1)
        return None

    def sample(self, rows: torch.Tensor, batch: SamplingBatch) -> Arriving | None:
        """Pipeline parallelism: the last stage draws a token for each of these rows of its hidden
        states and sends them to rank 0, with the log-probabilities [R, vocab] of the R rows that
        want logprobs. On rank 0 (None elsewhere): those, still arriving, as (token ids, (rows,
        log-probabilities) or None), so that the core can launch the next batch meanwhile."""
        last = self.layout.pp - 1
        if self.is_last_stage:
            logits = self.model.compute_logits(self.hidden[rows])  # every TP rank: the LM head gathers
            if self.sampler is not None:
                drawn = self.sampler.sample_on_device(logits, dataclasses.replace(batch, device=self.device))
                self.pp_group.send(drawn.token_ids, 0)
                if drawn.raw_logprobs is not None:
                    self.pp_group.send(drawn.raw_logprobs[1], 0)
            return None
        if self.rank != 0:
            return None
        token_ids = torch.empty(batch.num_rows, dtype=torch.int64, device=self.device)
        works = [self.pp_group.recv_async(token_ids, last)]
        raw_logprobs = None
        if batch.needs_logprobs:
            lp_rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
            lp = torch.empty(len(lp_rows), self.model.vocab_size, dtype=torch.float32, device=self.device)
            works.append(self.pp_group.recv_async(lp, last))
            raw_logprobs = (lp_rows, lp)
        return Arriving((token_ids, raw_logprobs), works)

    def execute_dummy_batch(self) -> None:
        """Experts across cores: this core has nothing to run while another does, so it runs one
        dummy token through the model for the MoE collectives to meet (vLLM's dummy batch). Its
        KV goes to the null page; nothing is sampled. Where the cores pad decode steps, padded
        to the others' size (`dp_padding.py`)."""
        batch = AttentionBatch(query_lens=[1], seq_lens=[1], page_tables=[[0]],
                               slot_mapping=torch.zeros(1, dtype=torch.int64, device=self.device), num_decodes=1)
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        if self.dp_padding is not None:
            self._execute_across_cores(zero, zero, batch, idle=True)
        else:
            self.attn.plan(batch)
            self.dp_dispatch.begin_forward(1, real_tokens=0)
            self._forward(zero, zero, self.attn, counted=True)
        if self.balancer is not None:
            self.balancer.after_forward()

    def agree_with_cores(self, has_work: bool, stopping: bool) -> tuple[int, int]:
        """Experts across cores, on a core's first rank: how many of the pod's cores have
        unfinished requests, and how many are stopping (one all-reduce over the cores' gloo group)."""
        flags = torch.tensor([int(has_work), int(stopping)], dtype=torch.int64)
        busy, stopping_cores = self.dp_dispatch.count_group.all_reduce(flags).tolist()
        return busy, stopping_cores

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                 counted: bool = False) -> torch.Tensor | None:
        """The eager forward of this rank's stage: (x, residual) in from the stage before, out to
        the one after; the hidden states on the last stage, None on the others. `counted`: the
        MoE dispatch knows every core's count already."""
        if self.dp_dispatch is not None and not counted:
            self.dp_dispatch.begin_forward(input_ids.shape[0])
        if self.layout.pp == 1:
            return self.model(input_ids, positions, attn)
        received = None
        if not self.is_first_stage:
            shape = (2, input_ids.shape[0], self.model.config.hidden_size)
            received = self.pp_group.recv(torch.empty(shape, dtype=self.dtype, device=self.device),
                                          self.coordinates.pp_rank - 1)
        out = stage_forward(self.model, input_ids, positions, attn, received)
        if self.is_last_stage:
            return out
        self.pp_group.send(out, self.coordinates.pp_rank + 1)
        return None

    def profile_run(self, backend: str, spec: KVCacheSpec, num_tokens: int, num_rows: int) -> torch.Tensor:
        """The largest step the scheduler can form, for measuring peak memory: `num_tokens` new
        tokens of one sequence through the attention backend (over a scratch pool of just enough
        pages), then the logits of the last `num_rows` of them, which it returns. With this rank's
        `compile_ahead` the step's Triton kernels, and the sampler's where this rank samples,
        compile ahead, several at once; the pool stays for the graphs' capture."""
        if self.compile_ahead:
            with torch.inference_mode(), compile_ahead(self.device, "the profile step and the sampler") as ahead:
                if ahead:
                    logits = self._profile_forward(backend, spec, num_tokens, num_rows)
                    if self.sampler is not None:  # where `warm_up_sampler` runs
                        note_sampler_kernels(self.model.vocab_size, self.dtype, self.device)
                    del logits
                    self.hidden = None  # not counted in the real step's peak
        return self._profile_forward(backend, spec, num_tokens, num_rows)

    def _profile_forward(self, backend: str, spec: KVCacheSpec, num_tokens: int, num_rows: int) -> torch.Tensor:
        page_size = spec.page_size
        scratch_pages = -(-num_tokens // page_size) + 1  # + the null page
        scratch = get_attention_backend(backend, self.kv_cache_spec(page_size, spec.dtype), scratch_pages, self.device)
        batch = AttentionBatch(query_lens=[num_tokens], seq_lens=[num_tokens],
                               page_tables=[list(range(1, scratch_pages))],
                               slot_mapping=torch.arange(page_size, page_size + num_tokens, device=self.device))
        scratch.plan(batch)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        self.hidden = self._forward(ids, torch.arange(num_tokens, device=self.device), scratch)
        return self.compute_logits(torch.arange(num_tokens - num_rows, num_tokens, device=self.device))

    def start_profile(self, config, tag: str, dp_rank: int) -> None:
        """Start torch.profiler on this rank; its files are named `dp<d>_pp<p>_tp<t>_rank<r>.<tag>`."""
        if self.profiler is not None:
            raise RuntimeError(f"rank {self.rank} is already profiling")
        c = self.coordinates
        name = f"dp{dp_rank}_pp{c.pp_rank}_tp{c.tp_rank}_rank{self.rank}.{tag}"
        self.profiler = RankProfiler(config, self.device, name)
        self.profiler.start()

    def stop_profile(self) -> list[str]:
        """Stop this rank's profiler; the trace and summary paths it wrote."""
        profiler, self.profiler = self.profiler, None
        return profiler.stop() if profiler is not None else []

    def ping(self) -> None:
        """Nothing: the executor's liveness check while the engine is idle (a send to a rank that
        is gone fails)."""

    def shutdown(self) -> None:
        """Stop serving calls (a worker process then exits)."""
        self.serving = False


def make_group(store, layout: ParallelLayout, axis: str, rank: int, device: torch.device,
               name: str | None = None) -> TPGroup:
    """This rank's member of its group on `axis` (gloo on CPU, NCCL on CUDA unless
    PAGODA_DIST_BACKEND=gloo: `parallel_state.dist_backend`), meeting in `store` under the group's
    own prefix (`name`, default the axis: two groups of the same ranks need two names); returns
    once every member has joined."""
    members = layout.group(axis, rank)
    timeout = datetime.timedelta(seconds=envs.tp_collective_timeout_s())
    store = dist.PrefixStore(f"pagoda/{name or axis}/{layout.group_index(axis, rank)}", store)
    group_rank = members.index(rank)
    nccl = dist_backend(device.type) == "nccl"
    if nccl:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, group_rank, len(members), options)
    else:
        backend = dist.ProcessGroupGloo(store, group_rank, len(members), timeout)
    group = TPGroup(backend, group_rank, len(members), members,
                    stages_on_host=device.type == "cuda" and not nccl)
    # A first collective: every rank is connected (NCCL makes its communicator lazily) before
    # anyone reports ready.
    group.all_reduce(torch.zeros(1, device=device))
    return group


# --- a worker process ------------------------------------------------------------------------------


def serve(worker: Worker, sock: zmq.Socket) -> int:
    """Run rank 0's calls until `shutdown` (0) or rank 0 is gone (1). A failed call is reported;
    after one whose caller does not wait for replies (a step, run in lockstep with the other
    ranks) this rank is out of step with them, so it stops (1)."""
    while worker.serving:
        if not sock.poll(_MASTER_CHECK_S * 1000):
            if not store_alive(worker.store):
                logger.error("rank 0 is gone; worker rank %d exiting", worker.rank)
                return 1
            continue
        call: Call = pickle.loads(sock.recv())
        try:
            tensors = receive_tensors(worker.rpc_group, call.tensors, worker.device) if call.tensors else []
            args, kwargs = restore_tensors(call.args, call.kwargs, tensors)
            result = worker_method(worker, call.method)(*args, **kwargs)
        except Exception as e:
            trace = traceback.format_exc()
            logger.error("rank %d failed in %s:\n%s", worker.rank, call.method, trace)
            sock.send(pickle.dumps(Reply(call.seq, worker.rank, call.method, error=(type(e).__name__, str(e), trace))))
            if not call.reply:
                return 1
            continue
        if call.reply:
            reply = Reply(call.seq, worker.rank, call.method, value=result)
            sock.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    return 0



def worker_method(worker: Worker, name: str):
    """The public method `name` of `worker`; AttributeError for anything else."""
    method = getattr(worker, name, None) if not name.startswith("_") else None
    if not callable(method):
        raise AttributeError(f"{type(worker).__name__} has no method {name!r}")
    return method


def load_worker_class(path: str) -> type[Worker]:
    """"package.module:Class" → the class (the executor may run a Worker subclass)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> None:
    """A worker process: `python -m pagoda_engine.worker.worker --master-addr A --master-port P
    --rank R`. Joins the run rank 0 published in its store, then serves calls."""
    parser = argparse.ArgumentParser(description="One worker rank of a Pagoda engine.")
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, default=None, help="CUDA device index (default: the rank)")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process exits")
    parser.add_argument("--log-level", type=int, default=logging.INFO)
    args = parser.parse_args(argv)
    pause_collections_for_start_up()  # until the engine core's `resume_collections`
    if args.parent_pid is not None:
        die_with_parent(args.parent_pid)
    # The core owns shutdown; a Ctrl-C reaching the whole process group must not kill us mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s worker-{args.rank} %(name)s: %(message)s")
    code = 0
    ctx = zmq.Context()
    try:
        store = dist.TCPStore(args.master_addr, args.master_port, is_master=False,
                              timeout=datetime.timedelta(seconds=envs.dist_timeout_s()))
        run = read_run(store)
        layout = ParallelLayout(**run["layout"])
        if run["device_type"] == "cuda":
            device = torch.device("cuda", args.rank if args.local_rank is None else args.local_rank)
            torch.cuda.set_device(device)
            set_torch_threads("cuda")
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)  # ranks share the machine's cores; one thread each
        dp = DataParallelRank(**run["data_parallel"]) if run.get("data_parallel") else None
        worker = load_worker_class(run["worker_cls"])(layout, args.rank, device, store, data_parallel=dp)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, str(args.rank).encode())
        sock.connect(run["endpoint"])
        sock.send(pickle.dumps(Hello(rank=args.rank, pid=os.getpid(), host=socket.gethostname())))
        with torch.inference_mode():
            code = serve(worker, sock)
    except Exception:
        logger.error("worker rank %d failed:\n%s", args.rank, traceback.format_exc())
        code = 1
    finally:
        ctx.destroy(linger=2000)  # the last reply (or error) still goes out
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown (process groups, CUDA context): nothing waits on it.
        os._exit(code)


if __name__ == "__main__":
    main()

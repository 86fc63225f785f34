"""Runs the model for the engine core on every rank: `collective_rpc(method, *args)` calls a method
of every rank's `Worker` (`worker.py`) and returns their results; `call` runs one in lockstep on
every rank and returns rank 0's (a step's hot path: the workers do not reply).

This module is the engine core's one way into `worker/` (with `compile_ahead`'s early pool
start): the core sees plain data (`executor_types`) and these calls, never the device itself.
Start-up, as vLLM V1's: `probe_device` (the facts the config's defaults are resolved from),
`create_executor` (ranks, weights, and the one decision whether to compile Triton kernels
ahead), `determine_num_kv_pages` (a profile step on a GPU), `init_kv_cache`, then
`compile_or_warm_up` (the sampler's warm-up and the CUDA graphs' capture). A step:
`execute_model`, then `prompt_logprobs` and `sample` for its rows, and `mark_step_end` where the
core times steps.

Rank 0's Worker lives here, in the engine core's process, and is called directly; with one rank
that is all there is. Under tensor parallelism the other ranks are worker processes: started
here (fresh interpreters, `python -c`, so a script that makes an `LLM` at top level needs no
`if __name__ == "__main__"`), or on another host with `python -m pagoda_engine.worker.worker`
pointed at this rank's master address and port. They meet over TCP (`rpc.py`): calls over ZMQ,
tensors broadcast over the process group, which the ranks form through the same TCPStore.
Start-up waits a bounded time (PAGODA_DIST_TIMEOUT_S) for every rank and names the ones that did
not join. Over several nodes (`--nnodes`) this process is the leader's and starts only its node's
ranks; every other node runs `serve_headless`, which starts that node's ranks against the
leader's store; a missing or dead rank is named with its node (`node-rank 1`). While the core is
idle `check_alive` pings every rank, so a node that dies fails the engine within seconds.

One scheduler, on rank 0, decides for all, so a page id means the same page on every rank.
Logits are gathered on every rank; only rank 0 samples. Under pipeline parallelism
(`--pipeline-parallel-size`) the ranks are tp × pp (stage-major: rank 0 is the first stage's first
TP rank): a step's tensors go to every rank, the stages pass hidden states on among themselves,
and the last stage's first rank samples and sends rank 0 the tokens. A worker process exits when told
(`close`), or when the core's process dies (`processes.die_with_parent`; a rank started on
another host sees rank 0's store go); a worker that dies or fails makes the next call raise
EngineDeadError (or WorkerError, with its error) naming its rank.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict
from typing import Protocol

import torch
import torch.distributed as dist
import zmq
from transformers import PretrainedConfig

import pagoda_engine
from pagoda_engine import envs
from pagoda_engine.config import EngineConfig, resolve_cudagraph_capture_size
from pagoda_engine.errors import EngineDeadError, ModelLoadError, PagodaError
from pagoda_engine.executor_types import AttentionBatch, DeviceFacts, DraftPlan, KVCacheSpec, SamplingBatch, kv_page_dtype
from pagoda_engine.model_path import resolve_model_path
from pagoda_engine.processes import set_torch_threads
from pagoda_engine.speculative import MODEL_METHODS
from pagoda_engine.worker.attention import flashinfer_available
from pagoda_engine.worker.attention.base import AttentionBackend
# The remote KV tier's store, which the core's offload manager also opens (to look pages up): the
# core reaches worker code only through this module.
from pagoda_engine.worker.kv_stores import remote_store  # noqa: F401
from pagoda_engine.worker.compile_ahead import (engine_compile_workers, ranks_on_node, settings_allow_compile_ahead,
                                                 start_compile_pool, stop_compile_pool, triton_cache_is_empty)
from pagoda_engine.worker.cuda_graphs import (MAX_PIECEWISE_TOKENS, drop_slow_sizes, graph_batch_sizes,
                                              piecewise_token_sizes, sizes_to_measure)
from pagoda_engine.worker.verify_graphs import verify_batch_sizes
from pagoda_engine.worker.model.fp8 import fp8_scheme
from pagoda_engine.worker.model.loader import load_hf_config, resolve_dtype
from pagoda_engine.worker.parallel_state import DataParallelRank, ParallelLayout, dist_backend, pp_layer_partition
from pagoda_engine.worker.rpc import Call, Hello, Reply, bind_address, broadcast_tensors, publish_run, split_tensors
from pagoda_engine.worker.sampling import PendingSample, SamplerOutput, compute_prompt_logprobs
from pagoda_engine.worker.worker import Arriving, load_worker_class, worker_method

# What the engine core may name of its executor's side, beside `Executor` and `create_executor`:
# the sampled tokens of a launched step, still on the device or on their way (both `resolve()`), and
# the marker of a step's end (`query()`: whether the device has finished it).
__all__ = ["ArrivingSample", "DeviceFacts", "Executor", "PendingSample", "StepEnd", "create_executor",
           "probe_device"]

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_LOG_MISSING_EVERY_S = 30
DEFAULT_WORKER_CLS = "pagoda_engine.worker.worker:Worker"


class WorkerError(PagodaError):
    """A method raised on a worker rank; the message carries the rank, the method and its error."""

    def __init__(self, rank: int, method: str, error: tuple[str, str, str]):
        self.rank, self.method = rank, method
        self.error_type, self.error_message, self.traceback = error
        super().__init__(f"tensor-parallel worker {rank} failed in {method}: {self.error_type}: {self.error_message}")


class Executor:
    """The ranks of one engine: `layout.world_size` Workers, rank 0 in this process.

    `master_addr`/`master_port` is where the others find rank 0 (port 0: a free one);
    `spawn_ranks` are the worker ranks started here as child processes (default: all of them;
    the rest join from elsewhere within `join_timeout_s`). On CUDA rank r runs on device
    `device_offset + r` (data-parallel engine core i of a pod: offset i × tensor × pipeline parallel size),
    modulo the visible devices over gloo (PAGODA_DIST_BACKEND=gloo), whose ranks may share a GPU.
    Over `nnodes` hosts this is node 0's: rank r belongs to node r // (world size / nnodes), and
    errors about a rank name its node."""

    def __init__(self, layout: ParallelLayout, device: torch.device, *, master_addr: str = "127.0.0.1",
                 master_port: int = 0, spawn_ranks: list[int] | None = None,
                 worker_cls: str = DEFAULT_WORKER_CLS, join_timeout_s: float | None = None,
                 device_offset: int = 0, nnodes: int = 1, data_parallel: DataParallelRank | None = None):
        self.layout = layout
        self.device_offset = device_offset
        self.nnodes = nnodes
        spawn_ranks = list(range(1, layout.world_size)) if spawn_ranks is None else spawn_ranks
        device = torch.device(device)
        # Whether this host's ranks outnumber its GPUs, so that some share one (gloo only).
        self.shares_devices = False
        if (layout.world_size > 1 or device_offset > 0) and device.type == "cuda":
            needed = device_offset + max(spawn_ranks, default=0) + 1
            self.shares_devices = torch.cuda.device_count() < needed
            # NCCL needs a GPU per rank; over gloo (PAGODA_DIST_BACKEND) ranks may share them.
            if self.shares_devices and dist_backend("cuda") != "gloo":
                raise ModelLoadError(f"{layout.world_size} ranks (tensor × pipeline parallel size) on devices from "
                                     f"cuda:{device_offset} (data-parallel engine cores before it use the lower ones) "
                                     f"need {needed} GPUs here, {torch.cuda.device_count()} are visible")
            device = torch.device("cuda", self._device_index(0))
            torch.cuda.set_device(device)
        elif layout.world_size > 1 and device.type != "cpu":
            raise ModelLoadError(f"tensor parallelism runs on cuda or cpu, not {device}")
        self.device = device
        # Set by `create_executor`: the model's config, compute dtype and KV pages' dtype
        # (--kv-cache-dtype), and whether every rank compiles its Triton kernels ahead (until the
        # graphs are captured).
        self.hf_config: PretrainedConfig | None = None
        self.dtype: torch.dtype | None = None
        self.kv_dtype: torch.dtype | None = None
        self.compile_ahead = False
        self.cuda_graph_bytes = 0  # device memory the CUDA graphs took, beyond the KV budget
        self.closed = False
        self.hellos: dict[int, Hello] = {}
        self._processes: dict[int, subprocess.Popen] = {}
        self._seq = 0
        if layout.world_size == 1:
            self.worker = load_worker_class(worker_cls)(layout, 0, device, data_parallel=data_parallel)
            return
        # How long ranks may take to start, and to answer a call (read once: every step calls them).
        self._start_timeout_s = envs.tp_start_timeout_s()
        store = dist.TCPStore(master_addr, master_port, layout.world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self._start_timeout_s))
        self.worker = load_worker_class(worker_cls)(layout, 0, device, store, data_parallel=data_parallel)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a rank that is gone raises
        self._sock.setsockopt(zmq.LINGER, 0)
        # A host that vanishes without closing its connections drops out of the routing table too.
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        self._sock.bind(f"tcp://{bind_address(master_addr)}:*")
        port = self._sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        # Interpreter exit without close() (a script that never closes its LLM) still stops them.
        self._finalizer = weakref.finalize(self, _stop_ranks, self._sock, self._ctx, self._processes,
                                           range(1, layout.world_size))
        publish_run(store, {"layout": asdict(layout), "device_type": device.type, "worker_cls": worker_cls,
                            "endpoint": f"tcp://{master_addr}:{port}",
                            "data_parallel": asdict(data_parallel) if data_parallel else None})
        try:
            for rank in spawn_ranks:
                self._processes[rank] = _spawn(rank, master_addr, store.port, self._device_index(rank))
            self._join(envs.dist_timeout_s() if join_timeout_s is None else join_timeout_s, f"{master_addr}:{store.port}")
        except BaseException:
            self.close()
            raise

    def _device_index(self, rank: int) -> int:
        """Rank `rank`'s CUDA device: cuda:device_offset + rank, wrapping around past the last
        visible one (only gloo ranks share devices: checked above)."""
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return (self.device_offset + rank) % count if count else self.device_offset + rank

    # --- the calls ------------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        """Run `method(*args, **kwargs)` on every rank's Worker; every rank's result, in rank order.
        Rank 0's error is raised as is; a worker's as WorkerError, a dead worker's as EngineDeadError."""
        local_method = worker_method(self.worker, method)
        if self.layout.world_size == 1:
            return [local_method(*args, **kwargs)]
        with self._on_all_ranks(method):
            seq = self._send(method, args, kwargs, reply=True)
            local = local_method(*args, **kwargs)
        return [local] + self._gather(seq, method)

    def call(self, method: str, *args, **kwargs):
        """Run `method` on every rank in lockstep (the collectives inside keep them together);
        rank 0's result. Workers do not reply: one that fails reports it and exits, and this call
        or the next raises."""
        local_method = worker_method(self.worker, method)
        if self.layout.world_size == 1:
            return local_method(*args, **kwargs)
        with self._on_all_ranks(method):
            self._send(method, args, kwargs, reply=False)
            return local_method(*args, **kwargs)

    def check_alive(self) -> None:
        """Between steps, while idle: EngineDeadError naming a worker rank (and its node) that
        died or whose connection closed since the last call."""
        if self.layout.world_size == 1:
            return
        for rank, process in self._processes.items():
            if process.poll() is not None:
                raise EngineDeadError(f"tensor-parallel worker {rank} died (exit code {process.returncode})")
        self._send("ping", (), {}, reply=False)

    def _send(self, method: str, args: tuple, kwargs: dict, reply: bool) -> int:
        if self.closed:
            raise EngineDeadError("the tensor-parallel executor is closed")
        self._raise_reported_errors(wait_s=0)
        args, kwargs, tensors = split_tensors(args, kwargs)
        self._seq += 1
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        payload = pickle.dumps(Call(self._seq, method, args, kwargs, specs, reply), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(1, self.layout.world_size):
            try:
                self._sock.send_multipart([str(rank).encode(), payload])
            except zmq.ZMQError as e:
                raise EngineDeadError(f"tensor-parallel worker {rank}{self._on_node(rank)} is gone "
                                      f"({self._exit_status(rank)})") from e
        if tensors:
            broadcast_tensors(self.worker.rpc_group, tensors, self.device)
        return self._seq

    def _gather(self, seq: int, method: str) -> list:
        """Every worker's reply to call `seq`, watching for ranks that die meanwhile."""
        results: dict[int, object] = {}
        deadline = time.monotonic() + self._start_timeout_s
        while len(results) < self.layout.world_size - 1:
            if self._sock.poll(200):
                reply = self._recv_reply()
                if reply.error is not None:
                    raise WorkerError(reply.rank, reply.method, reply.error)
                if reply.seq == seq:
                    results[reply.rank] = reply.value
                continue  # an older call's late reply (that call raised early): dropped
            for rank, process in self._processes.items():
                if rank not in results and process.poll() is not None:
                    raise EngineDeadError(f"tensor-parallel worker {rank} died (exit code {process.returncode}) "
                                          f"during {method}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.layout.world_size)) - set(results))
                raise EngineDeadError(f"tensor-parallel worker(s) {missing} did not answer {method} "
                                      f"within {self._start_timeout_s:.0f}s")
        return [results[rank] for rank in range(1, self.layout.world_size)]

    def _recv_reply(self) -> Reply:
        _, payload = self._sock.recv_multipart()
        return pickle.loads(payload)

    def _raise_reported_errors(self, wait_s: float) -> None:
        """A worker that failed a call nobody waited on said so before exiting: raise its error."""
        while self._sock.poll(int(wait_s * 1000)):
            reply = self._recv_reply()
            if reply.error is not None:
                raise EngineDeadError(str(WorkerError(reply.rank, reply.method, reply.error)))

    @contextlib.contextmanager
    def _on_all_ranks(self, method: str):
        """A collective fails (gloo) when a rank has died or failed: name the rank instead of the
        socket error."""
        try:
            yield
        except RuntimeError as e:
            self._raise_reported_errors(wait_s=1.0)
            for rank, process in self._processes.items():
                try:
                    code = process.wait(1.0)  # the sockets close a moment before the exit is reported
                except subprocess.TimeoutExpired:
                    continue
                raise EngineDeadError(f"tensor-parallel worker {rank} died (exit code {code}) during {method}") from e
            if self.nnodes > 1:  # the ranks of other nodes were not started here: their link broke
                others = ", ".join(f"node-rank {n}" for n in range(1, self.nnodes))
                raise EngineDeadError(f"a collective with the other nodes ({others}) failed during {method}: "
                                      f"a node is gone or failed ({e})") from e
            raise

    def _node_of(self, rank: int) -> int:
        return rank // (self.layout.world_size // self.nnodes)

    def _on_node(self, rank: int) -> str:
        return f" (node-rank {self._node_of(rank)})" if self.nnodes > 1 else ""

    def _exit_status(self, rank: int) -> str:
        process = self._processes.get(rank)
        return f"exit code {process.poll()}" if process is not None else "not started here"

    # --- start and stop ---------------------------------------------------------------------------

    def _join(self, timeout_s: float, master: str) -> None:
        """Wait until every worker rank has said Hello; a rank that exits or stays away fails the start."""
        started = time.monotonic()
        deadline, next_log = started + timeout_s, started + _LOG_MISSING_EVERY_S
        expected = set(range(1, self.layout.world_size))
        while expected - set(self.hellos):
            if time.monotonic() > next_log:
                next_log += _LOG_MISSING_EVERY_S
                logger.info("waiting for %s (%.0fs of %.0fs)", self._describe_missing(expected - set(self.hellos)),
                            time.monotonic() - started, timeout_s)
            if self._sock.poll(200):
                _, payload = self._sock.recv_multipart()
                hello: Hello = pickle.loads(payload)
                self.hellos[hello.rank] = hello
                continue
            for rank, process in self._processes.items():
                if rank not in self.hellos and process.poll() is not None:
                    raise ModelLoadError(f"tensor-parallel worker {rank} exited (code {process.returncode}) while "
                                         "trying to start (its log is above)")
            if time.monotonic() > deadline and self.nnodes > 1:
                raise ModelLoadError(
                    f"{self._describe_missing(expected - set(self.hellos))} did not join within {timeout_s:.0f}s "
                    f"(PAGODA_DIST_TIMEOUT_S); every other node runs `pagoda serve --headless --nnodes {self.nnodes} "
                    f"--node-rank R --master-addr/--master-port {master}` with the leader's other flags")
            if time.monotonic() > deadline:
                missing = sorted(expected - set(self.hellos))
                joined = ", ".join(str(r) for r in [0, *sorted(self.hellos)])
                raise ModelLoadError(
                    f"tensor-parallel rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                    f"{self.layout.world_size} did not join within {timeout_s:.0f}s (joined: {joined}); a rank "
                    f"started elsewhere joins with --master-addr/--master-port {master}")

    def _describe_missing(self, missing: set[int]) -> str:
        """The ranks not joined yet, by node when there are several."""
        if self.nnodes == 1:
            return f"tensor-parallel rank(s) {', '.join(map(str, sorted(missing)))}"
        by_node: dict[int, list[int]] = {}
        for rank in sorted(missing):
            by_node.setdefault(self._node_of(rank), []).append(rank)
        return "; ".join(f"node-rank {node} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                         f"of {self.layout.world_size})" for node, ranks in by_node.items())

    def close(self) -> None:
        """Stop the worker ranks (and rank 0's compile pool, after a failed start); idempotent."""
        if self.closed:
            return
        self.closed = True
        stop_compile_pool()
        if self.layout.world_size > 1:
            self._finalizer()

    # --- what the engine core calls -------------------------------------------------------------

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def worker_pids(self) -> list[int]:
        return [self.hellos[rank].pid for rank in sorted(self.hellos)]

    @property
    def model(self) -> torch.nn.Module:
        return self.worker.model

    @property
    def attn(self) -> AttentionBackend | None:
        return self.worker.attn

    @property
    def graphs(self):
        return self.worker.graphs

    @property
    def piecewise(self):
        return self.worker.piecewise

    @property
    def vocab_size(self) -> int:
        return self.worker.model.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        """The model's own context limit (it already accounts for a sliding window shorter than it)."""
        return self.worker.model.max_position_embeddings

    def kv_cache_spec(self, page_size: int) -> KVCacheSpec:
        """Rank 0's KV page layout (its stage's layers, its share of the heads)."""
        return self.worker.kv_cache_spec(page_size, self.kv_dtype)

    def determine_num_kv_pages(self, config: EngineConfig, max_model_len: int) -> int:
        """How many KV pages every rank can hold (the same on every rank, so the tightest rank
        sets it): on a GPU what `gpu_memory_utilization` leaves after the peak of a profile step
        (`_free_gpu_bytes`); on CPU `cpu_kv_cache_gb`. Under pipeline parallelism the stages'
        pages differ (their layer counts do), and on a GPU so do their weights: rank 0's profile
        stands for every rank's activations, each rank's own weights are counted."""
        cc = config.cache
        specs = self.kv_cache_specs(cc.block_size, self.kv_dtype)
        per_page = [s.bytes_per_page() for s in specs]
        drafter = self.worker.drafter
        if drafter is not None:  # its KV (in the model dtype, and EAGLE-3's features) in the same page ids, on rank 0
            per_page[0] += drafter.bytes_per_page(cc.block_size, self.dtype)
        if self.device.type != "cuda":
            return min(int(cc.cpu_kv_cache_gb * _GiB) // b for b in per_page)
        budget = self._free_gpu_bytes(config, max_model_len)
        if self.shares_devices:
            # Ranks on one GPU (gloo): all their pages come out of its one budget, in which the
            # other ranks' weights and activations are already counted (outside this process).
            return budget // sum(per_page)
        weights = self.collective_rpc("weight_bytes")
        return min(max(budget - (w - weights[0]), 0) // b for w, b in zip(weights, per_page))

    def _free_gpu_bytes(self, config: EngineConfig, max_model_len: int) -> int:
        """Bytes the KV pages may take: gpu_memory_utilization × total − the peak of one profile step.

        The profile step is the largest the scheduler can form: max_num_batched_tokens new tokens
        through the configured attention backend (over a scratch pool of just enough pages),
        then logits and sampling scratch for max_num_seqs rows. Its peak covers weights,
        activations, attention workspace and sampler temporaries; CUDA graphs, captured later, reuse
        one pool sized by the largest decode batch (far smaller than this step)."""
        cc, sc = config.cache, config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, max_model_len)
        spec = self.kv_cache_spec(cc.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            rows = min(sc.max_num_seqs, num_tokens)
            # On every rank at once (its collectives need them all); rank 0's peak stands for all.
            logits = self.call("profile_run", config.model.attention_backend, spec, num_tokens, rows)
            # The sampler holds about three logits-sized float32 tensors at once (logits, probs, noise).
            probs = torch.softmax(logits, dim=-1)
            noise = torch.empty_like(probs).exponential_()
            del probs, noise, logits
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        # Memory that is not torch's (CUDA context, cuBLAS and NCCL workspaces, other processes).
        free, total = torch.cuda.mem_get_info()
        non_torch = max(0, total - free - torch.cuda.memory_reserved())
        budget = int(cc.gpu_memory_utilization * total) - peak - non_torch
        logger.info("KV sizing: %.2f GiB total × %.2f − %.2f GiB peak (profile step of %d tokens) − %.2f GiB "
                    "outside torch = %.2f GiB for pages", total / _GiB, cc.gpu_memory_utilization, peak / _GiB,
                    num_tokens, non_torch / _GiB, budget / _GiB)
        return max(0, budget)

    def init_kv_cache(self, backend: str, spec: KVCacheSpec, num_pages: int) -> str:
        """Create every rank's attention backend (`spec` is per rank) over `num_pages` pages; the
        backend's name ("auto" picks one)."""
        with _starting():
            self.collective_rpc("init_kv_cache", backend, spec, num_pages)
        return self.worker.attn.name

    def compile_or_warm_up(self, config: EngineConfig, max_model_len: int) -> str:
        """After `init_kv_cache`, before the first step: the sampling rank draws along each of its
        sampler's paths, and every rank captures its CUDA graphs where the config's
        cudagraph_mode asks for them; the compile pools go afterwards. Returns the cudagraph mode
        the ranks run: NONE where the attention backend cannot replay graphs (FlashInfer
        installed but failing to import, so that "auto" took the reference backend)."""
        t0 = time.monotonic()
        with _starting():
            if self.layout.pp > 1:
                self.collective_rpc("warm_up_sampler")
            else:
                self.worker.warm_up_sampler()
        logger.info("sampler warm-up (kernel compiles) took %.1fs", time.monotonic() - t0)
        mode = config.model.cudagraph_mode
        if mode != "NONE" and not hasattr(self.worker.attn, "plan_graph_decode"):
            logger.warning("attention backend %s cannot run in CUDA graphs: they are off", self.worker.attn.name)
            mode = "NONE"
        if mode == "NONE":
            if self.compile_ahead:
                with _starting():
                    self.collective_rpc("stop_compile_pool")
            return mode
        t0 = time.monotonic()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        piecewise = (min(MAX_PIECEWISE_TOKENS, config.scheduler.max_num_batched_tokens)
                     if mode == "FULL_AND_PIECEWISE" else 0)
        spec = config.speculative_config
        self._capture_graphs(resolve_cudagraph_capture_size(config.scheduler.max_num_seqs,
                                                            config.model.max_cudagraph_capture_size),
                             -(-max_model_len // config.cache.block_size), piecewise,
                             verify_query_len=spec.num_speculative_tokens + 1 if spec.enabled else 0,
                             disable_by_batch_size=spec.disable_by_batch_size)
        self.cuda_graph_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        pw, dg, vg = self.piecewise, self.graphs, self.worker.verify_graphs

        def took(graphs) -> str:  # (compiling ahead +) capturing
            ahead, capture = graphs.seconds
            return f"{ahead:.1f}s compiling ahead + {capture:.1f}s" if self.compile_ahead else f"{capture:.1f}s"

        split = (f"decode {took(dg)}" + (f", piecewise {took(pw)}" if pw is not None else "")
                 + (f", verification {took(vg)}" if vg is not None else ""))
        logger.info("captured CUDA graphs in %.1fs (%s%s), taking %.0f MiB: decode batch sizes %s; piecewise token "
                    "counts %s; verification batch sizes %s", time.monotonic() - t0, split,
                    "; Triton's cache was empty: their kernels compiled ahead" if self.compile_ahead else "",
                    self.cuda_graph_bytes / 2**20, dg.batch_sizes, pw.token_sizes if pw else "none",
                    f"{vg.batch_sizes} of {vg.query_len} rows each" if vg is not None else "none")
        return mode

    def _capture_graphs(self, max_batch_size: int, max_pages_per_seq: int, max_piecewise_tokens: int,
                        verify_query_len: int = 0, disable_by_batch_size: int | None = None) -> None:
        """Capture, on every rank, the decode forward at the batch sizes of
        `graph_batch_sizes(max_batch_size)` and, unless `max_piecewise_tokens` is 0, the piecewise
        forward at the token counts of `piecewise_token_sizes(max_piecewise_tokens)`, less those
        whose GEMMs some larger one runs as fast on every rank (`drop_slow_sizes`); with
        speculative decoding (`verify_query_len`: k + 1) the verification forward at the decode
        sizes `verify_batch_sizes` keeps, where every rank can run it. Other steps run eagerly."""
        piecewise = piecewise_token_sizes(max_piecewise_tokens) if max_piecewise_tokens else []
        measured = sizes_to_measure(piecewise)
        with _starting():
            if len(measured) > 1:
                per_rank = self.collective_rpc("piecewise_row_costs", measured)
                cost = {size: max(costs[size] for costs in per_rank) for size in measured
                        if all(size in costs for costs in per_rank)}  # a rank without dense projections has none
                kept = drop_slow_sizes(piecewise, cost)
                dropped = sorted(set(piecewise) - set(kept))
                if dropped:
                    logger.info("piecewise graphs: left out %s tokens (a layer's GEMMs: %s µs; a larger size is as "
                                "fast)", dropped, ", ".join(f"{s}: {cost[s]:.0f}" for s in measured if s in cost))
                piecewise = kept
            sizes = graph_batch_sizes(max_batch_size)
            verify = []
            if verify_query_len:
                verify = verify_batch_sizes(sizes, disable_by_batch_size)
                if not all(self.collective_rpc("can_capture_verify", verify_query_len)):
                    logger.info("speculative decoding's verification steps run as prefill steps (piecewise graphs): "
                                "the attention backend has no verification kernel for %d rows a request of these "
                                "heads", verify_query_len)
                    verify = []
            self.collective_rpc("capture_graphs", sizes, max_pages_per_seq, piecewise, verify, verify_query_len)

    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                      layer_hook: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """The step's forward on every rank; rank 0's hidden states (None under pipeline
        parallelism). `layer_hook`: rank 0's attention backend calls it with each layer's index
        before that layer's attention, while the forward is launched."""
        attn = self.worker.attn
        attn.layer_hook = layer_hook
        try:
            return self.call("execute_model", input_ids, positions, batch)
        finally:
            attn.layer_hook = None

    @property
    def draft_model_dir(self) -> str:
        return self.worker.drafter.model_dir

    @property
    def draft_max_position(self) -> int:
        """The most positions the drafting model serves."""
        return self.worker.drafter.max_position

    def propose_drafts(self, plan: DraftPlan) -> list[list[int]]:
        """Speculative decoding's drafting model on rank 0 (`worker.drafter`): each request's drafted
        tokens for `plan` (read back: a sync)."""
        return self.worker.propose_drafts(plan)

    def execute_dummy_batch(self) -> None:
        """Experts across cores: one dummy token through every rank's model (`Worker.execute_dummy_batch`)."""
        self.call("execute_dummy_batch")

    def expert_load(self) -> list[list[int]]:
        """Experts across cores: [MoE layer][expert] tokens this core's ranks' experts took since
        start-up (each rank holds its own experts: the sum over ranks); a device sync on every rank."""
        total: list[list[int]] = []
        for counts in self.collective_rpc("read_expert_load"):
            total = counts if not total else [[a + b for a, b in zip(x, y)] for x, y in zip(total, counts)]
        return total

    def agree_with_cores(self, has_work: bool, stopping: bool) -> tuple[int, int]:
        """Experts across cores: how many of the pod's engine cores have unfinished requests and
        how many are stopping (this core's answers: `has_work`, `stopping`); every core must ask,
        once per turn of its loop."""
        return self.worker.agree_with_cores(has_work, stopping)

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits for these rows (token indices) of the last step's hidden states, on rank 0."""
        return self.call("compute_logits", rows)

    def prompt_logprobs(self, rows: torch.Tensor, target_ids: torch.Tensor, num_top: int) -> list:
        """The logprobs (`TokenLogprobs`) of `target_ids`, the prompt tokens that follow these rows
        of the last step, with `num_top` top tokens each (read back: a sync)."""
        return compute_prompt_logprobs(self.compute_logits(rows), target_ids, num_top)

    def sample(self, rows: torch.Tensor, batch: SamplingBatch) -> PendingSample | ArrivingSample:
        """A token for each of these rows of the last step's hidden states, drawn on the device
        (nothing is read back: `resolve()` does). Under pipeline parallelism the last stage draws
        them (`Worker.sample`) and sends them to rank 0, so that the core can launch the next
        batch while they are on their way."""
        if self.layout.pp > 1:
            return ArrivingSample(self, self.call("sample", rows, batch), batch.num_logprobs)
        return self.worker.sampler.sample_on_device(self.compute_logits(rows), batch)

    def mark_step_end(self) -> StepEnd:
        """A marker behind everything rank 0 has launched so far: `query()` says whether the device
        has got past it (step launch pacing and early publishing time the steps by it)."""
        ended = torch.cuda.Event()
        ended.record()
        return ended

    def wait(self, arriving: Arriving):
        """What another stage is sending rank 0; a stage that died meanwhile raises EngineDeadError."""
        with self._on_all_ranks("sample"):
            return arriving.wait()

    def kv_cache_specs(self, page_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """Every rank's KV page layout (under pipeline parallelism the stages' layer counts differ)."""
        return self.collective_rpc("kv_cache_spec", page_size, dtype)


class StepEnd(Protocol):
    """An event recorded behind a step's work on the device (`Executor.mark_step_end`)."""

    def query(self) -> bool: ...


class ArrivingSample:
    """Pipeline parallelism: a step's tokens (and logprobs) that the last stage is sending rank 0;
    `resolve` waits for them, as `PendingSample.resolve` does for tokens still on the device."""

    def __init__(self, executor: Executor, arriving: Arriving, num_logprobs: list[int | None]):
        self.executor, self.arriving, self.num_logprobs = executor, arriving, num_logprobs

    def resolve(self) -> SamplerOutput:
        token_ids, raw_logprobs = self.executor.wait(self.arriving)
        return PendingSample(token_ids=token_ids, num_logprobs=self.num_logprobs, raw_logprobs=raw_logprobs).resolve()


@contextlib.contextmanager
def _starting():
    """A worker that fails or dies while the engine starts fails the start: ModelLoadError."""
    try:
        yield
    except (WorkerError, EngineDeadError) as e:
        raise ModelLoadError(str(e)) from e


def _spawn(rank: int, master_addr: str, master_port: int, local_rank: int) -> subprocess.Popen:
    """A fresh interpreter running `worker.worker.main` for `rank` (on CUDA device `local_rank`),
    dying with this process."""
    env = dict(os.environ)
    # The worker must import this very pagoda_engine (a source checkout, not only an installed one).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(pagoda_engine.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-c", "from pagoda_engine.worker.worker import main; main()",
         "--master-addr", master_addr, "--master-port", str(master_port), "--rank", str(rank),
         "--local-rank", str(local_rank), "--parent-pid", str(os.getpid()),
         "--log-level", str(logging.getLogger().getEffectiveLevel())],
        env=env, stdin=subprocess.DEVNULL)


def _stop_ranks(sock: zmq.Socket, ctx: zmq.Context, processes: dict[int, subprocess.Popen], ranks,
                timeout_s: float = 10.0) -> None:
    """Tell every worker rank to shut down, then make sure of the ones started here: terminate,
    then kill, whatever is left."""
    payload = pickle.dumps(Call(0, "shutdown", (), {}, [], reply=False))
    for rank in ranks:
        try:
            sock.send_multipart([str(rank).encode(), payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # already gone
    deadline = time.monotonic() + timeout_s
    for process in processes.values():
        for stop in (None, process.terminate, process.kill):
            if stop is not None:
                stop()
            try:
                process.wait(max(0.1, deadline - time.monotonic()) if stop is None else 2.0)
                break
            except subprocess.TimeoutExpired:
                continue
    sock.close(linger=1000)  # the shutdown still reaches a rank started elsewhere
    ctx.term()


# --- starting the engine's ranks ------------------------------------------------------------------


def check_tensor_parallel(hf_config: PretrainedConfig, tp_size: int) -> None:
    """Refuse, before any process starts, a TP size the model's shapes cannot be split by."""
    if tp_size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp_size:
        raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the model's num_attention_heads "
                             f"({heads}); valid sizes: {_divisors(heads)}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide num_key_value_heads ({kv_heads}) "
                             f"or be a multiple of it (KV heads are then replicated)")
    inter = getattr(hf_config, "intermediate_size", None)
    if inter and inter % tp_size:
        raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the model's intermediate_size ({inter})")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def probe_device(name: str) -> DeviceFacts:
    """Rank 0's device for `--device` ("auto": CUDA where there is one, else CPU), and what the
    engine core needs to know about it. ModelLoadError for cuda without a CUDA device."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type != "cuda":
        return DeviceFacts(device=str(device), kind=device.type, steps_run_ahead=False, first_steps_pay_once=False,
                           collectives=dist_backend(device.type))
    props = torch.cuda.get_device_properties(device)
    return DeviceFacts(device=str(device), kind="cuda", steps_run_ahead=True, first_steps_pay_once=True,
                       total_memory=props.total_memory, name=props.name, collectives=dist_backend("cuda"),
                       graph_attention=flashinfer_available())


def create_executor(config: EngineConfig, model_dir: str) -> Executor:
    """Start the engine's ranks on the config's device, join their groups and load every rank's
    shard (rank 0's here, while the workers load theirs). `config` is resolved for the device
    (`config.resolve_for_device`).

    Here the engine decides, once for every rank, whether to compile its Triton kernels ahead
    (`compile_ahead`): on a fresh node (an empty Triton cache, asked before anything compiled)
    whose ranks will capture CUDA graphs through Triton kernels. Then every rank first starts its
    compile processes (its share of its node's CPUs), which import torch and Triton while the
    weights load; on a warm cache that would cost a forward per graph size for nothing."""
    mc, pc = config.model, config.parallel
    hf_config = load_hf_config(model_dir)
    device = torch.device(mc.device)
    if device.type == "cuda":
        set_torch_threads("cuda")
    dtype = resolve_dtype(mc.dtype, hf_config, device)
    fp8_scheme(mc.quantization, hf_config)  # an unsupported form is refused before any rank starts
    ranks = pc.ranks_per_node  # the leader's share; every other node checks its own
    # Over gloo (PAGODA_DIST_BACKEND=gloo) the ranks may share GPUs; NCCL needs one each.
    if device.type == "cuda" and ranks > torch.cuda.device_count() and dist_backend("cuda") == "nccl":
        raise ModelLoadError(f"--tensor-parallel-size × --pipeline-parallel-size / --nnodes = {ranks} needs "
                             f"{ranks} GPUs, but this machine shows {torch.cuda.device_count()}")
    compile_ahead = (device.type == "cuda" and mc.cudagraph_mode != "NONE" and settings_allow_compile_ahead(config)
                     and triton_cache_is_empty())
    # Rank 0's pool, before the other ranks start; its processes import torch and Triton while the
    # model loads. Without it, one the engine core process may have started before it knew goes
    # (`start_compile_pool_early`).
    if compile_ahead:
        start_compile_pool(engine_compile_workers(config))
    else:
        stop_compile_pool()
    torch.manual_seed(mc.seed)
    t0 = time.monotonic()
    try:
        executor = _start_ranks(config, model_dir, hf_config, dtype, device, compile_ahead)
    except BaseException:
        stop_compile_pool()
        raise
    executor.hf_config, executor.dtype, executor.compile_ahead = hf_config, dtype, compile_ahead
    executor.kv_dtype = kv_page_dtype(config.cache.kv_cache_dtype, dtype)
    spec = config.speculative_config
    if spec.method in MODEL_METHODS:
        try:
            if spec.method == "eagle3" and config.parallel.tensor_parallel_size > 1:
                executor.collective_rpc("gather_embedding")
            executor.worker.load_drafter(spec.method, resolve_model_path(spec.model), mc.load_format, mc.seed)
            if executor.worker.drafter.reads_target_hidden:
                executor.collective_rpc("run_eagerly")
        except BaseException:
            executor.close()
            stop_compile_pool()
            raise
    logger.info("loaded %s in %.1fs (%s, %s)", model_dir, time.monotonic() - t0, dtype, executor.device)
    if executor.device.type == "cpu":
        set_torch_threads("cpu", sum(p.numel() for p in executor.model.parameters()))
    return executor


def dp_padded_sizes(config: EngineConfig) -> tuple[int, ...]:
    """The sizes data-parallel cores whose experts span each other pad their decode steps to: the
    decode graphs' (`worker/dp_padding.py`); none under --enforce-eager (every step then runs
    eagerly at its own size, the escape from the graphs) or pipeline parallelism."""
    if config.model.enforce_eager or config.parallel.pipeline_parallel_size > 1:
        return ()
    return tuple(graph_batch_sizes(resolve_cudagraph_capture_size(config.scheduler.max_num_seqs,
                                                                  config.model.max_cudagraph_capture_size)))


def _start_ranks(config: EngineConfig, model_dir: str, hf_config: PretrainedConfig, dtype: torch.dtype,
                 device: torch.device, compile_ahead: bool) -> Executor:
    """The executor of the engine's ranks, each with its shard loaded (and its compile pool
    started first with `compile_ahead`)."""
    mc = config.model
    tp_size, pp_size = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    check_tensor_parallel(hf_config, tp_size)
    # Checked here, before any process starts: each stage's [start, end) layers.
    partition = pp_layer_partition(hf_config.num_hidden_layers, pp_size) if pp_size > 1 else None
    pc = config.parallel
    layout = ParallelLayout(tp=tp_size, pp=pp_size, enable_expert_parallel=pc.enable_expert_parallel)
    # Data-parallel engine core k uses the k-th block of tensor × pipeline parallel devices. Over
    # several nodes this leader starts its own node's ranks; the headless nodes start theirs.
    data_parallel = None
    if pc.expert_parallel_across_cores:
        if pc.data_parallel_master_port is None:
            raise ModelLoadError("expert parallelism across data-parallel engine cores needs the pod's "
                                 "data_parallel_master_port (the API server sets it)")
        data_parallel = DataParallelRank(pc.data_parallel_size, pc.data_parallel_rank, pc.dp_address,
                                         pc.data_parallel_master_port, pc.all2all_backend, dp_padded_sizes(config),
                                         asdict(config.eplb_config) if pc.enable_eplb else None,
                                         2 if pc.enable_dbo else 1)
    # The core's devices on its node: cores on several nodes count from the node's first core.
    executor = Executor(layout, device, device_offset=(pc.data_parallel_rank - pc.data_parallel_local_start)
                        * layout.world_size,
                        master_addr=pc.master_addr, master_port=pc.store_port(),
                        spawn_ranks=list(range(1, pc.ranks_per_node)), nnodes=pc.nnodes, data_parallel=data_parallel)
    try:
        with _starting():
            if compile_ahead:
                executor.collective_rpc("start_compile_pool", ranks_on_node(config))
            executor.collective_rpc("init_distributed")
            executor.collective_rpc("load_model", model_dir, dtype, mc.load_format, mc.seed, partition,
                                   mc.quantization)
    except BaseException:
        executor.close()
        raise
    if layout.world_size > 1:
        logger.info("%d ranks (tensor parallel %d × pipeline parallel %d%s; %s), workers %s", layout.world_size,
                    tp_size, pp_size, f", layers per stage {[end - start for start, end in partition]}" if partition else "",
                    dist_backend(executor.device.type), executor.worker_pids)
    return executor


def serve_headless(config: EngineConfig) -> int:
    """A node other than the leader (`pagoda serve --headless --node-rank R`): start this node's
    ranks (R × ranks per node onwards, on its devices from 0) as worker processes that join the
    leader's store, and live as long as they do. 0 when the leader shut them down; 1 when one
    failed, or the leader went away or never came (they wait PAGODA_DIST_TIMEOUT_S for it)."""
    pc = config.parallel
    first = pc.node_rank * pc.ranks_per_node
    ranks = range(first, first + pc.ranks_per_node)
    master = f"{pc.master_addr}:{pc.store_port()}"
    logger.info("node-rank %d of %d: starting ranks %s, joining the leader at %s", pc.node_rank, pc.nnodes,
                list(ranks), master)
    processes = {rank: _spawn(rank, pc.master_addr, pc.store_port(), rank - first) for rank in ranks}
    try:
        while processes:
            for rank, process in list(processes.items()):
                code = process.poll()
                if code is None:
                    continue
                del processes[rank]
                if code != 0:
                    logger.error("node-rank %d: rank %d exited with code %d (the leader at %s is gone, never came, "
                                 "or the rank failed: its log is above); stopping this node", pc.node_rank, rank,
                                 code, master)
                    return 1
            time.sleep(0.2)
        logger.info("node-rank %d: the leader shut this node's ranks down", pc.node_rank)
        return 0
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()

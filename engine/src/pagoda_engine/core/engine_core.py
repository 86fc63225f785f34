"""The engine core: owns the model, the KV pool, the scheduler and the runner; one `step()` is
schedule → execute → update. The same class runs inside the server's core process and
in-process under the offline `LLM`.

With `async_scheduling` the core owns the one step in flight (`_in_flight`): `step()` schedules
and launches the next step first, then resolves the one in flight and returns its outputs, so the
host's scheduling and input building overlap the device's work (vLLM's async scheduling, SGLang's
overlap scheduler). Outputs thus come one call late; a request that finished in the resolved step
has one surplus token in the launched one, which is dropped.

Under pipeline parallelism the core keeps a batch queue instead (vLLM V1's `step_with_batch_queue`):
up to `pipeline_parallel_size` batches in flight, so that the first stage works on one while the
later stages work on the ones before; `step()` launches a batch while the queue has room (and
returns nothing yet), and otherwise resolves the oldest. A request waits for its batch before it
is scheduled again.

Structured outputs: a constrained request's next token mask needs the token it sampled last, so
under async scheduling a step after one that sampled for a constrained request waits for that
step's tokens first (`_must_resolve_first`, as for penalties): steps with constrained rows run
synchronously. Grammars compile in `GrammarCompiler`'s threads; a request waits, unscheduled,
until its grammar is ready, and one whose compile failed is dropped with an `EngineCoreError`
(`take_refused`)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

import torch

from pagoda_engine.config import (EngineConfig, default_max_num_seqs, resolve_cudagraph_capture_size,
                                  resolve_cudagraph_mode)
from pagoda_engine.core.request import Request
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.kv.offload.manager import OffloadManager, kv_fingerprint
from pagoda_engine.core.pacing import LaunchPacer
from pagoda_engine.core.scheduler import Scheduler, SchedulerOutput
from pagoda_engine.errors import InvalidRequestError, ModelLoadError
from pagoda_engine.messages import (
    EngineCoreError,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    TokenLogprobs,
    token_id_array,
)
from pagoda_engine.model_path import resolve_model_path, served_model_name
from pagoda_engine.processes import set_torch_threads
from pagoda_engine.profiler import ProfilerAlreadyError, ProfilerStateError, ProfileSession
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.worker.attention.base import KVCacheSpec
from pagoda_engine.worker.compile_ahead import (engine_compile_workers, settings_allow_compile_ahead,
                                                 start_compile_pool, stop_compile_pool, triton_cache_is_empty)
from pagoda_engine.worker.cuda_graphs import MAX_PIECEWISE_TOKENS
from pagoda_engine.worker.executor import create_executor
from pagoda_engine.kv_tiers import HEADER_BYTES, OffloadSetup
from pagoda_engine.worker.kv_stores import remote_store
from pagoda_engine.worker.model.loader import load_hf_config, resolve_dtype
from pagoda_engine.worker.parallel_state import dist_backend
from pagoda_engine.worker.runner import LaunchedStep, ModelRunner, RunnerOutput
from pagoda_engine.worker.sampling import make_sampler
from pagoda_engine.structured_outputs import GrammarCompiler

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_OFFLOAD_IDLE_WAIT_S = 0.001
_WARM_UP_MAX_STEPS = 64  # each warm-up phase needs at most 8 steps; what is left after this many is aborted
# Prompts the warm-up runs one at a time (up to its long prompt's length): one past each power of
# two, so that a step of every size class any kernel picks its configuration by (the experts'
# tiles, `fused_moe_triton._configs`: up to 4, 32, 128, 384, 768, 4,096 tokens) and of odd token
# counts has run before the first request.
_WARM_UP_PROMPT_LENS = (5, 9, 17, 33, 65, 129, 257, 513)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def _default_max_num_seqs(device: torch.device) -> int:
    if device.type != "cuda":
        return default_max_num_seqs(device.type)
    props = torch.cuda.get_device_properties(device)
    return default_max_num_seqs(device.type, props.total_memory, props.name)


def read_eos_token_ids(model_dir: str, hf_config) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []

    def add(value) -> None:
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(getattr(hf_config, "eos_token_id", None))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        try:
            add(json.loads(gen_path.read_text()).get("eos_token_id"))
        except (OSError, ValueError) as e:
            logger.warning("ignoring unreadable %s: %s", gen_path, e)
    return tuple(ids)


def graphs_unavailable(config: EngineConfig, backend: str) -> str | None:
    """Why an engine on CUDA whose attention backend can run in CUDA graphs must still run
    eagerly, or None (then every rank, every pipeline stage included, captures them); `backend`:
    its process groups' (`parallel_state.dist_backend`)."""
    pc = config.parallel
    if pc.expert_parallel_across_cores:
        # Every core would have to replay the same graph size and kind at each step (vLLM pads
        # to the largest core's batch and agrees on the mode first): not built yet.
        return "expert parallelism across data-parallel engine cores runs eagerly"
    if pc.tensor_parallel_size > 1 and backend == "gloo":
        # The pipeline's send/recv stay outside the graphs; the all-reduces are inside them.
        return ("tensor parallelism over gloo (PAGODA_DIST_BACKEND=gloo) runs eagerly: its all-reduces pass "
                "through host memory, which a CUDA graph cannot capture")
    return None


def _refuse_unimplemented(config: EngineConfig) -> None:
    """Options the command line accepts (the operator renders them) but this engine cannot honour
    yet, as the capability table says: refuse to start with a clear message rather than run
    without them. The operator refuses the same specs first (Validated=False)."""
    from pagoda_engine.capabilities import refusal

    reason = refusal(config, os.environ)
    if reason is not None:
        raise ModelLoadError(reason)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model
        _refuse_unimplemented(config)
        self.model_dir = resolve_model_path(mc.model)
        self.served_model_name = mc.served_model_name or served_model_name(mc.model)
        self.hf_config = load_hf_config(self.model_dir)
        self.device = resolve_device(mc.device)
        if self.device.type == "cuda":
            set_torch_threads("cuda")
        if config.scheduler.async_scheduling is None:  # the command line's default: on with CUDA
            config.scheduler.async_scheduling = self.device.type == "cuda"
        if config.scheduler.step_launch_pacing is None:  # the command line's default: wherever it applies
            config.scheduler.step_launch_pacing = bool(
                self.device.type == "cuda" and config.scheduler.async_scheduling
                and config.parallel.pipeline_parallel_size == 1 and not config.parallel.expert_parallel_across_cores)
        if config.scheduler.step_launch_pacing and self.device.type != "cuda":
            raise ModelLoadError(f"--step-launch-pacing times steps running on a GPU; on {self.device.type} a step "
                                 f"has ended by the time it is launched")
        if config.scheduler.max_num_seqs is None:
            config.scheduler.max_num_seqs = _default_max_num_seqs(self.device)
            logger.info("max_num_seqs %d (the default on %s)", config.scheduler.max_num_seqs, self.device)
        self.dtype = resolve_dtype(mc.dtype, self.hf_config, self.device)
        ranks = config.parallel.ranks_per_node  # the leader's share; every other node checks its own
        self.dist_backend = dist_backend(self.device.type)  # the ranks' process groups'
        # Over gloo (PAGODA_DIST_BACKEND=gloo) the ranks may share GPUs; NCCL needs one each.
        if self.device.type == "cuda" and ranks > torch.cuda.device_count() and self.dist_backend == "nccl":
            raise ModelLoadError(f"--tensor-parallel-size × --pipeline-parallel-size / --nnodes = {ranks} needs "
                                 f"{ranks} GPUs, but this machine shows {torch.cuda.device_count()}")
        self._profile: ProfileSession | None = None
        # Asked before anything compiled: a fresh node's kernels compile ahead of the profile step,
        # the sampler's warm-up and the graph capture, several at once; on a warm cache that
        # would cost a forward per graph size for nothing.
        self.compile_ahead = (self.device.type == "cuda" and settings_allow_compile_ahead(config)
                              and graphs_unavailable(config, self.dist_backend) is None and triton_cache_is_empty())
        # Rank 0's pool, before the other ranks start (theirs: `create_executor`); its processes
        # import torch and Triton while the model loads.
        if self.compile_ahead:
            start_compile_pool(engine_compile_workers(config))
        else:
            stop_compile_pool()  # one the engine core process may have started before it knew (`core.process`)
        torch.manual_seed(mc.seed)
        t0 = time.monotonic()
        try:
            # Under TP this starts the worker ranks; self.model is rank 0's shard.
            self.executor = create_executor(config, self.model_dir, self.hf_config, self.dtype, self.device,
                                            compile_ahead=self.compile_ahead)
            try:
                self._init_with_model(t0)
                # Started: ranks that paused their collector for start-up turn it back on.
                self.executor.collective_rpc("resume_collections")
            except BaseException:
                self.executor.close()  # TP workers must not outlive a failed start
                raise
        finally:
            stop_compile_pool()  # the graphs are captured (or will not be)

    def _init_with_model(self, t0: float) -> None:
        """Everything that needs the loaded model: limits, the KV pool, scheduler, runner, CUDA graphs."""
        config = self.config
        mc, cc = config.model, config.cache
        self.model = self.executor.model
        self.device = self.executor.device
        logger.info("loaded %s in %.1fs (%s, %s)", self.model_dir, time.monotonic() - t0, self.dtype, self.device)
        self.vocab_size = self.model.vocab_size
        self.max_model_len = self._resolve_max_model_len()
        if self.device.type == "cpu":
            set_torch_threads("cpu", sum(p.numel() for p in self.model.parameters()))
        self.eos_token_ids = read_eos_token_ids(self.model_dir, self.hf_config)

        spec: KVCacheSpec = self.model.kv_cache_spec(cc.block_size, self.dtype)
        self.num_kv_pages = cc.num_gpu_blocks_override or cc.num_kv_pages or self._measure_num_pages(spec)
        pages_per_seq = -(-self.max_model_len // cc.block_size)
        if cc.num_gpu_blocks_override is not None and cc.num_gpu_blocks_override < pages_per_seq + 1:
            raise ModelLoadError(f"--num-gpu-blocks-override {cc.num_gpu_blocks_override} holds fewer pages than one "
                                 f"sequence of max_model_len {self.max_model_len} needs ({pages_per_seq} + the null "
                                 "page); raise it or lower --max-model-len")
        self.attn = self.executor.init_kv_cache(mc.attention_backend, spec, self.num_kv_pages)
        self.kv = KVCacheManager(self.num_kv_pages, cc.block_size, cc.enable_prefix_caching)
        if config.kv_offload_enabled:
            self.kv.offload = self._start_offload(spec)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.runner = ModelRunner(self.model, self.attn, self.kv, make_sampler(mc.seed, self.device), self.device,
                                  self.executor, record_ends=config.scheduler.step_launch_pacing)
        self.kv_capacity_tokens = (self.num_kv_pages - 1) * cc.block_size
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        # Structured outputs: grammars compile in the compiler's threads; a request waits for its.
        self.grammars = GrammarCompiler(self._grammar_tokenizer)
        self._compiling: dict[str, Request] = {}
        self._refused: list[EngineCoreError] = []  # requests whose grammar failed to compile
        self._in_flight: LaunchedStep | None = None  # async scheduling: launched, not yet resolved
        self._launched_at = self._resolved_at = 0.0  # when it was launched; when the step before it was resolved
        # Step launch pacing (`launch_delay`, core.pacing); EngineConfig.validate and __init__ refused
        # it wherever no step is in flight on a device to time.
        self.pacer = LaunchPacer() if config.scheduler.step_launch_pacing else None
        self._paced = False  # the core's loop waited for `launch_delay` before this step
        # Where outputs go as soon as a step has ended, before the step after it is launched in
        # full (`publish_early`); None: with the step after it.
        self._early_sink: Callable[[EngineCoreOutputs], None] | None = None
        self.early_publishes = 0  # steps whose outputs left between two layers of the next one's launch
        # Pipeline parallelism: launched batches, oldest first, at most one per stage.
        self.max_concurrent_batches = config.parallel.pipeline_parallel_size
        self._batch_queue: deque[LaunchedStep] = deque()
        if self.max_concurrent_batches > 1 and config.scheduler.async_scheduling:
            logger.info("pipeline parallelism keeps %d batches in flight (the batch queue) instead of async "
                        "scheduling", self.max_concurrent_batches)
        logger.info("KV cache: %d pages of %d tokens = %d tokens (%s attention)", self.num_kv_pages - 1,
                    cc.block_size, self.kv_capacity_tokens, self.attn.name)
        t1 = time.monotonic()
        self.runner.warm_up_sampler(compile_first=self.compile_ahead)
        logger.info("sampler warm-up (kernel compiles) took %.1fs", time.monotonic() - t1)
        self.cuda_graph_bytes = 0  # device memory the graphs took, beyond the KV budget
        graphs_possible = (self.device.type == "cuda" and not mc.enforce_eager
                           and hasattr(self.attn, "plan_graph_decode"))
        eager_reason = graphs_unavailable(config, self.dist_backend) if graphs_possible else None
        if eager_reason is not None:
            logger.warning("%s: CUDA graphs are off", eager_reason)
            graphs_possible = False
        self.cudagraph_mode = (resolve_cudagraph_mode(mc.cudagraph_mode)
                               if graphs_possible else "NONE")
        if self.compile_ahead and not self.cuda_graphs:  # e.g. the torch attention backend
            self.executor.collective_rpc("stop_compile_pool")
            self.compile_ahead = False
        if self.cuda_graphs:
            t1 = time.monotonic()
            free_before, _ = torch.cuda.mem_get_info(self.device)
            piecewise = (min(MAX_PIECEWISE_TOKENS, config.scheduler.max_num_batched_tokens)
                         if self.cudagraph_mode == "FULL_AND_PIECEWISE" else 0)
            self.runner.capture_cuda_graphs(
                resolve_cudagraph_capture_size(config.scheduler.max_num_seqs, mc.max_cudagraph_capture_size),
                self.max_model_len, piecewise, compile_first=self.compile_ahead)
            self.cuda_graph_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
            pw, dg = self.runner.piecewise_graphs, self.runner.graphs

            def took(graphs) -> str:  # (compiling ahead +) capturing
                ahead, capture = graphs.seconds
                return f"{ahead:.1f}s compiling ahead + {capture:.1f}s" if self.compile_ahead else f"{capture:.1f}s"

            split = f"decode {took(dg)}" + (f", piecewise {took(pw)}" if pw is not None else "")
            logger.info("captured CUDA graphs in %.1fs (%s%s), taking %.0f MiB: decode batch sizes %s; piecewise token "
                        "counts %s", time.monotonic() - t1, split,
                        "; Triton's cache was empty: their kernels compiled ahead" if self.compile_ahead else "",
                        self.cuda_graph_bytes / 2**20, dg.batch_sizes, pw.token_sizes if pw else "none")
        # Pipeline stages warm up too (through the batch queue), and cores whose experts span the
        # pod's other cores in lockstep with them (each runs the same warm-up).
        if self.device.type == "cuda":
            t1 = time.monotonic()
            self._warm_up_steps()
            logger.info("warm-up steps took %.1fs", time.monotonic() - t1)
        self.startup_seconds = time.monotonic() - t0

    def _warm_up_steps(self) -> None:
        """Run steps like a server's first ones (two prompts, then a prompt among decodes; then
        prompts of `_WARM_UP_PROMPT_LENS` tokens one at a time) so that its first requests do not
        pay one-time costs: the eager decode plan, GEMMs at sizes the profile step did not run,
        first-use buffers, Triton kernel variants (a compile holds a live step 100-300 ms; a
        Qwen3-MoE server's first requests waited 2.5 s). On an H100 a fresh server's first step
        took 311 ms and its second 100 ms, against 25 ms and 7 ms later; with the warm-up a fresh
        server's first run at 16 req/s had a TTFT p99 of 200 ms instead of 330 (a second run: 104;
        the rest was a Triton kernel variant for misaligned inputs, which the runner no longer
        makes: `ModelRunner.prepare`). The warm-up requests leave nothing behind: the KV offload
        tiers are detached meanwhile (nothing is stored), the prefix-cache counters are put back,
        and they sample with seeds of their own (the engine's generator, which unseeded requests
        draw from, is untouched). Cores whose experts span the pod's other cores all run this at
        start-up, each turn agreed with the others (`_warm_up_turn`), so their forwards pair up
        even where their steps differ."""
        sc = self.config.scheduler
        # All three at once take at most half the pool, so none waits on pages (a pool fixed with
        # --num-kv-pages may be smaller than one max_model_len sequence).
        long_len = max(1, min(1024, self.max_model_len - 8, sc.max_num_batched_tokens - 40,
                              self.kv_capacity_tokens // 4 - 16))
        gen = torch.Generator().manual_seed(0)

        def add(i: int, prompt_len: int) -> None:
            ids = torch.randint(0, self.vocab_size, (prompt_len,), generator=gen).tolist()
            params = SamplingParams(max_tokens=4, ignore_eos=True, seed=i)
            self.scheduler.add_request(Request(request_id=f"pagoda-warm-up-{i}", prompt_token_ids=ids,
                                               sampling_params=params, eos_token_ids=self.eos_token_ids,
                                               arrival_time=time.time()))

        def run_out() -> None:
            for _ in range(_WARM_UP_MAX_STEPS):
                if not self._warm_up_turn():
                    break

        offload, self.kv.offload = self.kv.offload, None
        counters = self.kv.prefix_queries, self.kv.prefix_hits
        try:
            add(0, long_len)
            add(1, 16)
            self._warm_up_turn()
            add(2, long_len)  # joins the decodes of the first two
            run_out()
            for i, n in enumerate(n for n in _WARM_UP_PROMPT_LENS if n <= long_len):
                add(3 + i, n)  # its prompt alone, then its decodes alone
                run_out()
        finally:
            self.abort_requests([r for r in list(self.scheduler.requests) if r.startswith("pagoda-warm-up-")])
            self.kv.offload = offload
            self.kv.prefix_queries, self.kv.prefix_hits = counters

    def _warm_up_turn(self) -> bool:
        """One step of the warm-up; False when there was nothing left to run. A core in lockstep
        takes it as its loop takes every turn (`core.process.CoreLoop.run_lockstep`): it agrees
        with the other cores whether any has work, then makes its forward of the turn
        (`lockstep_forward`); False once no core has work."""
        if not self.in_lockstep:
            if not self.has_unfinished_requests():
                return False
            self.step()
            return True
        busy, _ = self.agree_with_cores()
        if not busy:
            return False
        self.lockstep_forward(lambda outputs: None)
        return True

    @property
    def cuda_graphs(self) -> bool:
        """Whether this engine replays CUDA graphs (decode ones at least; see `cudagraph_mode`)."""
        return self.cudagraph_mode != "NONE"

    def check_alive(self) -> None:
        """While idle: EngineDeadError when a worker rank (on this host or another node) is gone."""
        self.executor.check_alive()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; the core cannot step afterwards. Idempotent."""
        if hasattr(self, "grammars"):
            self.grammars.close()
        pacer = getattr(self, "pacer", None)
        if pacer is not None and pacer.paced_launches:
            logger.info("step launch pacing: %d paced launches, %d found the device idle (slack %.2f ms)",
                        pacer.paced_launches, pacer.late_launches, pacer.slack * 1e3)
        if getattr(self, "early_publishes", 0):
            logger.info("early publishing: %d steps' outputs left during the next step's launch", self.early_publishes)
        self.executor.close()

    def _grammar_tokenizer(self):
        """llguidance's view of the model's tokenizer, over the model's (maybe padded) vocabulary;
        the engine's EOS ids are the grammar's end. Built once, in a compile thread, on the
        first constrained request."""
        import llguidance.hf

        from pagoda_engine.api.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.model_dir)
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(self.vocab_size, len(tokenizer)),
                                            eos_token=list(self.eos_token_ids) or None)

    def _resolve_max_model_len(self) -> int:
        # The model's own limit: it already accounts for a sliding window shorter than the context.
        limit = self.model.max_position_embeddings
        wanted = self.config.model.max_model_len
        if wanted is None:
            return limit
        if wanted < 2:
            raise ModelLoadError(f"max_model_len must be >= 2, got {wanted}")
        if wanted > limit:
            raise ModelLoadError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

    def _start_offload(self, spec: KVCacheSpec) -> OffloadManager:
        """The KV tiers below the device pool, on every rank. The sizes are the pod's: with
        data-parallel engine cores each core of the pod (of its node, with cores on several
        nodes) takes its share, and its own disk directory."""
        cc, mc, pc = self.config.cache, self.config.model, self.config.parallel
        specs = self.executor.kv_cache_specs(spec.page_size, spec.dtype)
        page_bytes = sum(s.bytes_per_page() for s in specs)
        share = 1 / (pc.data_parallel_size_local or pc.data_parallel_size)
        disk_path = cc.kv_offload_disk_path
        if disk_path is not None and pc.data_parallel_size > 1:
            disk_path = str(Path(disk_path) / f"core-{pc.data_parallel_rank}")
        layout = (f"{self.hf_config.num_hidden_layers} layers, {spec.num_kv_heads * pc.tensor_parallel_size} "
                  f"kv heads x {spec.head_dim}, [page, 2, token, head, dim]")
        setup = OffloadSetup(kv_fingerprint(self.model_dir, mc.load_format, mc.seed, str(self.dtype), cc.block_size, layout),
                             num_cpu_slots=int(cc.kv_offload_cpu_gb * share * _GiB) // page_bytes,
                             disk_path=disk_path, remote_url=cc.kv_offload_remote_url)
        if cc.kv_offload_cpu_gb > 0 and setup.num_cpu_slots == 0:
            raise ModelLoadError(f"--kv-offload-cpu-gb {cc.kv_offload_cpu_gb} holds no page ({page_bytes} bytes each)")
        disk_pages = int(cc.kv_offload_disk_gb * share * _GiB) // (page_bytes + HEADER_BYTES * len(specs))
        if cc.kv_offload_disk_path is not None and disk_pages == 0:
            raise ModelLoadError(f"--kv-offload-disk-gb {cc.kv_offload_disk_gb} holds no page ({page_bytes} bytes each)")
        return OffloadManager(self.kv.pool, cc.block_size, self.executor, setup, disk_pages, page_bytes,
                              split_loads=cc.kv_offload_split_loads, open_remote=remote_store)

    def _measure_num_pages(self, spec: KVCacheSpec) -> int:
        cc, sc = self.config.cache, self.config.scheduler
        pages_per_seq = -(-self.max_model_len // cc.block_size)
        useful = sc.max_num_seqs * pages_per_seq + 1  # more than this can never be used
        # Every rank holds the same number of pages. Under pipeline parallelism the stages' pages
        # differ (their layer counts do), and on CUDA so do their weights: rank 0's profile stands
        # for every rank's activations, each rank's own weights are counted; the tightest rank sets the count.
        specs = self.executor.kv_cache_specs(spec.page_size, spec.dtype)
        if self.device.type == "cuda" and self.executor.shares_devices:
            # Ranks on one GPU (gloo): all their pages come out of its one budget, in which the
            # other ranks' weights and activations are already counted (outside this process).
            num_pages = self._profile_free_gpu_bytes() // sum(s.bytes_per_page() for s in specs)
        else:
            if self.device.type == "cuda":
                budget = self._profile_free_gpu_bytes()
                weights = self.executor.collective_rpc("weight_bytes")
                budgets = [budget - (w - weights[0]) for w in weights]
            else:
                budgets = [int(cc.cpu_kv_cache_gb * _GiB)] * len(specs)
            num_pages = min(max(b, 0) // s.bytes_per_page() for b, s in zip(budgets, specs))
        num_pages = min(num_pages, useful)
        if num_pages < pages_per_seq + 1:
            raise ModelLoadError(
                f"the KV pool fits {max(num_pages - 1, 0)} pages ({max(num_pages - 1, 0) * cc.block_size} tokens), "
                f"fewer than one sequence of max_model_len {self.max_model_len} needs ({pages_per_seq} pages); "
                "lower --max-model-len or raise --gpu-memory-utilization")
        return int(num_pages)

    def _profile_free_gpu_bytes(self) -> int:
        """Bytes the KV pages may take: gpu_memory_utilization × total − the peak of one profile step.

        The profile step is the largest the scheduler can form: max_num_batched_tokens new tokens
        through the configured attention backend (over a scratch pool of just enough pages),
        then logits and sampling scratch for max_num_seqs rows. Its peak covers weights,
        activations, attention workspace and sampler temporaries; CUDA graphs, captured later, reuse
        one pool sized by the largest decode batch (far smaller than this step)."""
        cc, sc = self.config.cache, self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, self.max_model_len)
        spec = self.model.kv_cache_spec(cc.block_size, self.dtype)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            rows = min(sc.max_num_seqs, num_tokens)
            # On every TP rank at once (its collectives need them all); rank 0's peak stands for all.
            logits = self.executor.profile_run(self.config.model.attention_backend, spec, num_tokens, rows,
                                               compile_first=self.compile_ahead)
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

    # --- requests -----------------------------------------------------------------------------
    def validate(self, req: EngineCoreRequest) -> None:
        """What only the core knows about a request (its prompt was checked where it entered,
        `api.inputs.check_prompt`). Raises InvalidRequestError."""
        if req.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use", param="request_id")
        bias = req.sampling_params.logit_bias
        if bias and max(bias) >= self.vocab_size:
            raise InvalidRequestError(f"logit_bias: token id {max(bias)} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", param="logit_bias")

    def add_request(self, req: EngineCoreRequest) -> None:
        self.validate(req)
        structured = req.sampling_params.structured_outputs
        request = Request(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids.tolist(),
            sampling_params=req.sampling_params, eos_token_ids=self.eos_token_ids,
            arrival_time=req.arrival_time or time.time(), priority=req.priority,
            grammar=self.grammars.submit(structured) if structured is not None else None)
        if request.waits_for_grammar:
            self._compiling[request.request_id] = request
        self.scheduler.add_request(request)

    def take_refused(self) -> list[EngineCoreError]:
        """Requests accepted earlier whose grammar then failed to compile (they are gone)."""
        refused, self._refused = self._refused, []
        return refused

    def _check_compiled(self, idle: bool) -> None:
        """Drop requests whose grammar failed to compile; when `idle` (nothing else could run),
        wait briefly for a compile instead of spinning."""
        if not self._compiling:
            return
        if idle:
            wait([r.grammar.future for r in self._compiling.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        for rid, request in list(self._compiling.items()):
            if not request.grammar.future.done():
                continue
            del self._compiling[rid]
            error = request.grammar.error()
            if error is not None and not request.is_finished:
                self.scheduler.abort([rid])
                self._refused.append(EngineCoreError(request_id=rid, message=error.message, param=error.param))

    def abort_requests(self, request_ids: list[str]) -> None:
        for req in self.scheduler.abort(request_ids):
            self._prompt_logprobs.pop(req.request_id, None)
            self._compiling.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, batches in flight, or KV offload copies still holding pages."""
        return (self.scheduler.has_unfinished_requests() or bool(self._batch_queue)
                or (self.kv.offload is not None and self.kv.offload.busy))

    # --- lockstep with the other cores (experts across data-parallel cores) -------------------
    @property
    def in_lockstep(self) -> bool:
        """Whether this core's MoE layers span the pod's other cores, so that it must take part in
        every forward any of them runs (`core.process.CoreLoop.run_lockstep`)."""
        return self.config.parallel.expert_parallel_across_cores

    def agree_with_cores(self, stopping: bool = False) -> tuple[int, int]:
        """How many of the pod's cores (this one included) have unfinished requests, and how many
        are stopping: one gloo all-reduce that every core makes once per turn of its loop."""
        return self.executor.agree_with_cores(self.has_unfinished_requests(), stopping)

    def lockstep_forward(self, publish: Callable[[EngineCoreOutputs], None]) -> None:
        """This core's forward in a turn the cores agreed some core has work for: its own step,
        whose outputs go to `publish` at once, or, where that scheduled nothing (or it has no work),
        a dummy batch, so that every core makes one forward (one set of collectives) a turn."""
        ran = 0
        if self.has_unfinished_requests():
            outputs = self.step()
            publish(outputs)
            ran = outputs.stats.num_scheduled_tokens if outputs.stats is not None else 0
        if not ran:
            self.execute_dummy_batch()

    def execute_dummy_batch(self) -> None:
        """One dummy token through the model: this core's part of a step it has nothing for."""
        self.executor.execute_dummy_batch()

    # --- profiling (`pagoda_engine.profiler`) --------------------------------------------------
    def start_profile(self, tag: str) -> None:
        """Start torch.profiler on every rank (after the config's delay_iterations steps); each
        rank's files carry `tag`. ProfilerStateError without a config or while profiling."""
        config = self.config.profiler_config
        if not config.enabled:
            raise ProfilerStateError("profiling is not configured: start the engine with a profiler config")
        if self._profile is not None:
            raise ProfilerAlreadyError("the profiler is already running: stop it first")
        try:  # a directory no rank can write to is refused here, not when the traces are due
            os.makedirs(config.torch_profiler_dir, exist_ok=True)
        except OSError as e:
            raise ProfilerStateError(f"cannot write traces to {config.torch_profiler_dir}: {e}") from None
        self._profile = ProfileSession(self.executor, config, tag, self.config.parallel.data_parallel_rank)

    def stop_profile(self) -> list[str]:
        """Stop every rank's profiler (unless max_iterations stopped it already); the trace and
        summary paths the ranks wrote."""
        if self._profile is None:
            raise ProfilerAlreadyError("the profiler is not running")
        session, self._profile = self._profile, None
        return session.stop()

    # --- the step -----------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        if self._profile is None:
            return self._step()
        self._profile.before_step()
        outputs = self._step()
        self._profile.after_step()
        return outputs

    def _step(self) -> EngineCoreOutputs:
        if self.max_concurrent_batches > 1:
            self._check_compiled(idle=not self._batch_queue and not self.scheduler.running)
            return self._step_with_batch_queue()
        self._check_compiled(idle=False)
        if self.config.scheduler.async_scheduling:
            return self._step_overlapped()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self._check_compiled(idle=True)
            self._wait_for_offload()
            return EngineCoreOutputs(outputs=[], stats=self.get_stats())
        started = time.monotonic()
        result = self.runner.execute(sched)
        self.kv.observe_step(sched.num_tokens, time.monotonic() - started)
        self.kv.launch_stores()
        return EngineCoreOutputs(outputs=self._update(sched, result), stats=self.get_stats(sched.num_tokens))

    def publish_early(self, sink: Callable[[EngineCoreOutputs], None]) -> None:
        """Under async scheduling on a GPU, hand a step's outputs to `sink` as soon as the device
        has finished it, from between two layers of the next step's launch, instead of returning
        them from `step()` after that launch (`_EarlyPublish`). The core's loop gives its publisher;
        the offline `LLM` reads its outputs per step and gives none."""
        self._early_sink = sink
        if self.device.type == "cuda":
            self.runner.record_ends = True  # `LaunchedStep.has_ended` answers only from its end event

    def _step_overlapped(self) -> EngineCoreOutputs:
        """Launch the next step, then resolve the one in flight (async scheduling)."""
        prev, self._in_flight = self._in_flight, None
        outputs: list[EngineCoreOutput] = []
        if prev is not None and _must_resolve_first(prev):
            outputs = self._update(prev.sched, prev.resolve(), advanced=True)
            prev = None
        started = time.monotonic()
        sched = self.scheduler.schedule()
        prev_launched = self._launched_at
        paced, self._paced = self._paced, False
        pacer = self.pacer
        if not sched.is_empty:
            decode = pacer is not None and _decode_only(sched)
            if paced and decode and prev is not None:
                pacer.launched(late=bool(prev.has_ended()))
            early = None
            if prev is not None and self._early_sink is not None and prev.ended is not None:
                early = _EarlyPublish(self, prev, sched, prev_launched)
            self._in_flight = self.runner.launch(sched, prev, layer_hook=early)
            self._launched_at = time.monotonic()
            if decode:
                pacer.observe_host(self._launched_at - started - (early.spent_s if early is not None else 0.0))
            if early is not None and early.published:
                prev = None  # resolved, applied and published between two of this step's layers
            else:
                self.scheduler.advance(sched)
            self.kv.launch_stores()
        elif prev is None:
            self._check_compiled(idle=True)
            self._wait_for_offload()
        if prev is not None:
            outputs = self._resolve_in_flight(prev, prev_launched)
        return EngineCoreOutputs(outputs=outputs, stats=self.get_stats(sched.num_tokens))

    def _resolve_in_flight(self, prev: LaunchedStep, prev_launched: float) -> list[EngineCoreOutput]:
        """Wait for the step in flight (launched at `prev_launched`), time it and apply its tokens;
        the scheduler has advanced the step launched after it."""
        pacer = self.pacer
        waited = pacer is not None and prev.has_ended() is False  # else its device time is a bound only
        result = prev.resolve()
        # Its device time is at most from its launch, or from the end of the step before it.
        now = time.monotonic()
        device_s = now - max(prev_launched, self._resolved_at)
        self.kv.observe_step(prev.sched.num_tokens, device_s)
        if waited and _decode_only(prev.sched):
            pacer.observe_decode(len(prev.sched.scheduled), device_s)
        self._resolved_at = now
        return self._update(prev.sched, result, advanced=True)

    def launch_delay(self) -> float:
        """Seconds the core's loop may go on reading its input before the next `step()` (step
        launch pacing, `core.pacing`): until the decode step in flight is about to end, so that a
        request arriving meanwhile joins the next step. 0: step now (pacing off, no decode step
        in flight, requests waiting, or no prediction yet)."""
        step = self._in_flight
        if (self.pacer is None or step is None or self.scheduler.waiting or not _decode_only(step.sched)
                or step.has_ended() is not False):
            return 0.0
        lead = self.pacer.lead(len(step.sched.scheduled))
        if lead is None:
            return 0.0
        delay = max(self._launched_at, self._resolved_at) + lead - time.monotonic()
        if delay <= 0.0:
            return 0.0
        self._paced = True
        return delay

    def _step_with_batch_queue(self) -> EngineCoreOutputs:
        """Launch a batch while the queue has room; else (or with nothing to launch) resolve the oldest."""
        launched = 0
        if len(self._batch_queue) < self.max_concurrent_batches:
            sched = self.scheduler.schedule(skip_in_flight=True)
            if not sched.is_empty:
                self._batch_queue.append(self.runner.launch(sched))
                self.scheduler.advance(sched)
                self.kv.launch_stores()
                launched = sched.num_tokens
                if len(self._batch_queue) < self.max_concurrent_batches:
                    return EngineCoreOutputs(outputs=[], stats=self.get_stats(launched))
            elif not self._batch_queue:
                self._wait_for_offload()
        outputs: list[EngineCoreOutput] = []
        if self._batch_queue:
            oldest = self._batch_queue.popleft()
            outputs = self._update(oldest.sched, oldest.resolve(), advanced=True)
        return EngineCoreOutputs(outputs=outputs, stats=self.get_stats(launched))

    def _update(self, sched: SchedulerOutput, result: RunnerOutput, advanced: bool = False) -> list[EngineCoreOutput]:
        """Apply a resolved step to its requests; one output per request that got a token."""
        for s in sched.scheduled:
            chunk = result.prompt_logprobs.get(s.request.request_id)
            if chunk is not None and not s.request.is_finished:  # not aborted while in flight
                self._prompt_logprobs.setdefault(s.request.request_id, []).extend(chunk)
        outputs = []
        for req in self.scheduler.update_from_output(sched, result.sampled, advanced):
            prompt_lps = None
            if req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == 1:
                prompt_lps = [None] + self._prompt_logprobs.pop(req.request_id, [])
            lp = result.logprobs.get(req.request_id)
            outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=token_id_array((req.output_token_ids[-1],)),
                new_logprobs=[lp] if lp is not None else None, prompt_logprobs=prompt_lps,
                finish_reason=req.finish_reason.value if req.finish_reason else None,
                stop_reason=req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0),
                events=req.take_events()))
        return outputs

    def wait_for_offload(self) -> None:
        """Until the KV offload tiers have finished every copy and load in flight."""
        while self.kv.offload is not None and self.kv.offload.busy:
            self.kv.poll_offload()
            self._wait_for_offload()

    def _wait_for_offload(self) -> None:
        """Nothing to run but KV offload copies or loads in flight: let them progress a moment
        instead of spinning on empty steps."""
        if self.kv.offload is not None and self.kv.offload.busy:
            time.sleep(_OFFLOAD_IDLE_WAIT_S)

    def get_stats(self, num_scheduled_tokens: int = 0) -> SchedulerStats:
        """The scheduler's state now; `num_scheduled_tokens`: what the step sending it scheduled."""
        return SchedulerStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(), prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            num_kv_pages=self.num_kv_pages, block_size=self.kv.page_size, num_scheduled_tokens=num_scheduled_tokens,
            kv_offload=self.kv.offload.stats() if self.kv.offload is not None else [],
            kv_offload_copy=self.kv.offload.copy_stats() if self.kv.offload is not None else [])


class _EarlyPublish:
    """The attention backend's layer hook while a step is launched under async scheduling. An
    eager step of a thousand prompt tokens takes 10-25 ms of host time to launch, and the step in
    flight (a decode, say) often ends well before that: its tokens would wait for the whole launch.
    At the first layer where the step in flight has ended, the hook advances the scheduler past the
    step being launched (as the core does after a launch), resolves and applies the step in flight
    and hands its outputs to the core's sink; the launch then goes on. Not in the last two layers,
    where the launch is about to end anyway. It costs the device nothing while the host launches
    ahead of it; a host slower than the device leaves it idle for the publish (about a millisecond)."""

    def __init__(self, core: EngineCore, prev: LaunchedStep, sched: SchedulerOutput, prev_launched: float):
        self.core, self.prev, self.sched, self.prev_launched = core, prev, sched, prev_launched
        self.last_layer = len(core.attn.kv_caches) - 3
        self.published = False
        self.spent_s = 0.0  # host time the publish took out of the launch

    def __call__(self, layer_id: int) -> None:
        if self.published or layer_id > self.last_layer or not self.prev.has_ended():
            return
        started = time.monotonic()
        self.published = True
        core = self.core
        core.scheduler.advance(self.sched)
        core._early_sink(EngineCoreOutputs(outputs=core._resolve_in_flight(self.prev, self.prev_launched)))
        core.early_publishes += 1
        self.spent_s = time.monotonic() - started


def _decode_only(sched: SchedulerOutput) -> bool:
    """One token a row: a decode step (or, rarely, a prompt's one-token last chunk, which costs the
    same), the steps pacing predicts."""
    return all(s.num_new_tokens == 1 for s in sched.scheduled)


def _must_resolve_first(step: LaunchedStep) -> bool:
    """Penalties count a request's output tokens on the host, and a grammar's next mask needs the
    token it sampled last: a step after one that sampled for such a request must wait for its
    tokens (it runs synchronously)."""
    return any(r.grammar is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
               or p.presence_penalty != 0.0 for r, p in ((r, r.sampling_params) for r in step.sample_reqs))

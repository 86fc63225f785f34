"""The engine core: owns the scheduler, the KV pool's pages and the step runner, and asks its
executor's ranks (`worker.executor`) for everything on the device; one `step()` is schedule →
execute → update. The same class runs inside the server's core process and in-process under the
offline `LLM`. It starts as vLLM V1's does: the config's device defaults resolved from what the
executor reports (`config.resolve_for_device`), the ranks started, the KV pages sized and
allocated on every rank, then the ranks' own warm-up (sampler, CUDA graphs) and, where the
device's first steps pay one-time costs, warm-up steps through the scheduler (`core.warm_up`).

With async scheduling, or under pipeline parallelism, `step()` launches steps before it resolves
earlier ones (`core.in_flight`): outputs then come one call (or a stage) late.

Structured outputs: a constrained request's next token mask needs the token it sampled last, so
under async scheduling a step after one that sampled for a constrained request waits for that
step's tokens first (`in_flight._must_resolve_first`, as for penalties): steps with constrained
rows run synchronously. Grammars compile in `GrammarCompiler`'s threads; a request waits, unscheduled,
until its grammar is ready, and one whose compile failed is dropped with an `EngineCoreError`
(`take_refused`)."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path

from pagoda_engine.config import EngineConfig, resolve_for_device
from pagoda_engine.core.draft_proposer import model_proposer
from pagoda_engine.lora import LoRARequest, parse_lora_modules
from pagoda_engine.core.in_flight import StepsInFlight
from pagoda_engine.core.kv.events import KVEventPublisher
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.kv.offload.setup import page_identity, start_offload
from pagoda_engine.core.kv.sizing import num_kv_pages
from pagoda_engine.core.kv_transfer import KVTransfer
from pagoda_engine.core.lora import LoRASlots
from pagoda_engine.core.request import Request
from pagoda_engine.core.scheduler import Scheduler, SchedulerOutput
from pagoda_engine.core.spec_decode import SpecDecoder
from pagoda_engine.core.step_runner import RunnerOutput, StepRunner
from pagoda_engine.core.warm_up import warm_up_steps
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
from pagoda_engine.profiler import ProfilerAlreadyError, ProfilerStateError, ProfileSession
from pagoda_engine.structured_outputs import GrammarCompiler
from pagoda_engine.tokenizer_files import has_tokenizer, load_tokenizer
from pagoda_engine.worker.executor import create_executor, probe_device

logger = logging.getLogger(__name__)

_OFFLOAD_IDLE_WAIT_S = 0.001
# How often the MoE experts' load is read from the ranks (experts across data-parallel cores):
# below Prometheus' usual scrape interval, above a step's time many times over.
EXPERT_LOAD_PERIOD_S = 5.0


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
        _refuse_unimplemented(config)
        self.model_dir = resolve_model_path(config.model.model)
        self.served_model_name = config.model.served_model_name or served_model_name(config.model.model)
        self.device_facts = probe_device(config.model.device)
        self.config = config = resolve_for_device(config, self.device_facts)
        self._profile: ProfileSession | None = None
        self.kv_events: KVEventPublisher | None = None
        t0 = time.monotonic()
        # Under TP this starts the worker ranks; rank 0's is in this process.
        self.executor = create_executor(config, self.model_dir)
        try:
            self._init_with_model()
            # Started: ranks that paused their collector for start-up turn it back on.
            self.executor.collective_rpc("resume_collections")
            # After warm-up: its prompts' pages are no one's prefix, and subscribers need not hear of them.
            if config.kv_events_config.enabled:
                self.kv_events = KVEventPublisher(config.kv_events_config, config.parallel.data_parallel_rank)
                self.kv.pool.record_events()
        except BaseException:
            if hasattr(self, "grammars"):
                self.grammars.close()
            self.executor.close()  # TP workers (and compile pools) must not outlive a failed start
            raise
        self.startup_seconds = time.monotonic() - t0

    def _init_with_model(self) -> None:
        """Everything that needs the loaded model: limits, the KV pool, scheduler, runner, warm-up."""
        config, executor = self.config, self.executor
        cc = config.cache
        self.device, self.dtype = executor.device, executor.dtype
        self.vocab_size = executor.vocab_size
        self.max_model_len = self._resolve_max_model_len()
        self.eos_token_ids = read_eos_token_ids(self.model_dir, executor.hf_config)
        # Structured outputs: grammars compile in the compiler's threads; a request waits for its.
        # Their tokenizer is built beside the rest of the start-up and is ready before the core is.
        self.grammars = GrammarCompiler(self._grammar_tokenizer)
        grammars_prepared = self.grammars.prepare() if has_tokenizer(self.model_dir) else None
        spec = executor.kv_cache_spec(cc.block_size)
        # LoRA slots before the pool is sized: the ranks' profile step counts them.
        self.lora = LoRASlots(config, executor) if config.model.enable_lora else None
        for i, m in enumerate(parse_lora_modules(config.model.lora_modules)):
            self.lora.add(LoRARequest(m.name, i + 1, m.path, m.base_model_name))  # LoRAAdapterError naming it
        self.num_kv_pages = num_kv_pages(config, executor, self.max_model_len)
        attention = executor.init_kv_cache(config.model.attention_backend, spec, self.num_kv_pages)
        self.num_layers = spec.num_layers  # rank 0's (its pipeline stage's)
        self.kv = KVCacheManager(self.num_kv_pages, cc.block_size, cc.enable_prefix_caching)
        if config.kv_offload_enabled:
            self.kv.offload = start_offload(config, executor, self.kv.pool, self.model_dir)
        self.kv_transfer = self._start_kv_transfer() if config.kv_transfer_config.enabled else None
        spec = None
        if config.speculative_config.enabled:
            spec = SpecDecoder(config.speculative_config, model_proposer(
                config.speculative_config, executor, self.kv, self.model_dir, self.max_model_len,
                config.scheduler.max_num_batched_tokens))
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len, spec,
                                   max_loras=config.model.max_loras if self.lora is not None else None)
        self.runner = StepRunner(executor, self.kv, self.vocab_size, record_ends=config.scheduler.step_launch_pacing,
                                 lora=self.lora)
        self.kv_capacity_tokens = (self.num_kv_pages - 1) * cc.block_size
        self._prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        self._compiling: dict[str, Request] = {}
        self._refused: list[EngineCoreError] = []  # requests whose grammar failed to compile
        self._expert_load_read_at = 0.0  # experts across cores: when `get_stats` last read their load
        # Async scheduling's step in flight, or pipeline parallelism's batch queue (a batch per stage).
        self.in_flight = StepsInFlight(self, config.scheduler.step_launch_pacing,
                                       config.parallel.pipeline_parallel_size)
        if self.in_flight.max_batches > 1 and config.scheduler.async_scheduling:
            logger.info("pipeline parallelism keeps %d batches in flight (the batch queue) instead of async "
                        "scheduling", self.in_flight.max_batches)
        logger.info("KV cache: %d pages of %d tokens = %d tokens (%s attention)", self.num_kv_pages - 1,
                    cc.block_size, self.kv_capacity_tokens, attention)
        if grammars_prepared is not None:
            # Done before the graphs are captured: the tokenizer's thread stays out of the capture.
            grammars_prepared.result()
        # What the ranks replay: `config.resolve_for_device`'s mode, NONE where they run eagerly.
        self.cudagraph_mode = executor.compile_or_warm_up(config, self.max_model_len)
        # Pipeline stages warm up too (through the batch queue), and cores whose experts span the
        # pod's other cores in lockstep with them (each runs the same warm-up).
        if self.device_facts.first_steps_pay_once:
            t1 = time.monotonic()
            warm_up_steps(self)
            logger.info("warm-up steps took %.1fs", time.monotonic() - t1)

    def _start_kv_transfer(self) -> KVTransfer:
        """Disaggregated prefill/decode's control plane, under the fingerprint of what makes two
        engines' pages interchangeable (the KV tiers' own)."""
        fingerprint, layout = page_identity(self.config, self.executor, self.model_dir)
        description = f"model {self.served_model_name}, {layout}"
        return KVTransfer(self.config.kv_transfer_config, self.executor, self.kv.pool, self.config.cache.block_size,
                          fingerprint.hex(), description, self.config.parallel.data_parallel_rank)

    @property
    def cuda_graphs(self) -> bool:
        """Whether this engine replays CUDA graphs (decode ones at least; see `cudagraph_mode`)."""
        return self.cudagraph_mode != "NONE"

    def check_alive(self) -> None:
        """While idle: EngineDeadError when a worker rank (on this host or another node) is gone."""
        self.executor.check_alive()

    def release_expired(self) -> bool:
        """While idle: pages held for remote decode that were pulled or outlived their bound go
        back to the pool (`KVTransfer.poll`). Whether any did (the core then publishes its stats)."""
        return self.kv_transfer is not None and self.kv_transfer.poll()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; the core cannot step afterwards. Idempotent."""
        if hasattr(self, "grammars"):
            self.grammars.close()
        in_flight = getattr(self, "in_flight", None)
        if in_flight is not None:
            in_flight.log_totals()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None and scheduler.spec is not None:
            scheduler.spec.log()
        if getattr(self, "kv_transfer", None) is not None:
            self.kv_transfer.close()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
            self.kv_events = None
        self.executor.close()

    def _grammar_tokenizer(self):
        """llguidance's view of the model's tokenizer, over the model's (maybe padded) vocabulary;
        the engine's EOS ids are the grammar's end. Built once, in a compile thread, at start-up
        (`GrammarCompiler.prepare`)."""
        import llguidance.hf

        tokenizer = load_tokenizer(self.model_dir)
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(self.vocab_size, len(tokenizer)),
                                            eos_token=list(self.eos_token_ids) or None)

    def _resolve_max_model_len(self) -> int:
        # The model's own limit: it already accounts for a sliding window shorter than the context.
        limit = self.executor.max_position_embeddings
        wanted = self.config.model.max_model_len
        if wanted is None:
            return limit
        if wanted < 2:
            raise ModelLoadError(f"max_model_len must be >= 2, got {wanted}")
        if wanted > limit:
            raise ModelLoadError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
        return wanted

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
        if req.lora_request is not None:
            self.check_lora(req.lora_request)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.validate(req)
        structured = req.sampling_params.structured_outputs
        request = Request(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids.tolist(),
            sampling_params=req.sampling_params, eos_token_ids=self.eos_token_ids,
            arrival_time=req.arrival_time or time.time(), priority=req.priority,
            output_token_ids=req.resume_token_ids.tolist() if req.resume_token_ids is not None else [],
            num_resumed_tokens=len(req.resume_token_ids) if req.resume_token_ids is not None else 0,
            grammar=self.grammars.submit(structured) if structured is not None else None,
            kv_transfer_params=req.sampling_params.kv_transfer_params,
            lora_request=req.lora_request)
        if request.grammar is not None and request.num_resumed_tokens:
            request.grammar.resume_after(request.output_token_ids)  # replayed once compiled (check_compiled)
        if request.waits_for_grammar:
            self._compiling[request.request_id] = request
        self.scheduler.add_request(request)
        if self.kv_transfer is not None and request.kv_transfer_params is not None:
            self.kv_transfer.start_pull(request)

    def check_lora(self, request: LoRARequest) -> None:
        """A request's adapter, added if new (the offline `LLM` names adapters by path). Raises
        InvalidRequestError."""
        if self.lora is None:
            raise InvalidRequestError(f"LoRA adapter {request.lora_name!r} asked for, but this engine serves no "
                                      "adapters (start it with --enable-lora)", param="model")
        self.lora.check(request)

    def add_lora(self, request: LoRARequest) -> None:
        """Serve a LoRA adapter from now on (`POST /v1/load_lora_adapter`); LoRAAdapterError if it does not fit."""
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self.lora.add(request)

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter `name` to new requests; False when it was not loaded."""
        return self.lora is not None and self.lora.remove(name)

    def take_refused(self) -> list[EngineCoreError]:
        """Requests accepted earlier whose grammar then failed to compile (they are gone)."""
        refused, self._refused = self._refused, []
        return refused

    def check_compiled(self, idle: bool) -> None:
        """Drop requests whose grammar failed to compile (or refuses a continuation's earlier
        tokens); when `idle` (nothing else could run), wait briefly for a compile instead of spinning."""
        if not self._compiling:
            return
        if idle:
            wait([r.grammar.future for r in self._compiling.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        for rid, request in list(self._compiling.items()):
            if not request.grammar.future.done():
                continue
            del self._compiling[rid]
            error = request.grammar.error()
            if error is None and not request.grammar.ready:  # a continuation: its tokens first
                error = request.grammar.replay()
            if error is not None and not request.is_finished:
                self.scheduler.abort([rid])
                self._refused.append(EngineCoreError(request_id=rid, message=error.message, param=error.param))

    def abort_requests(self, request_ids: list[str]) -> None:
        for req in self.scheduler.abort(request_ids):
            self._prompt_logprobs.pop(req.request_id, None)
            self._compiling.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, batches in flight, or KV offload copies still holding pages."""
        return (self.scheduler.has_unfinished_requests() or bool(self.in_flight.batch_queue)
                or (self.kv.offload is not None and self.kv.offload.busy)
                or (self.kv_transfer is not None and self.kv_transfer.busy))

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
        if self.kv_transfer is not None:
            self.kv_transfer.poll()
        if self.in_flight.max_batches > 1:
            self.check_compiled(idle=not self.in_flight.batch_queue and not self.scheduler.running)
            return self.in_flight.step_with_batch_queue()
        self.check_compiled(idle=False)
        if self.config.scheduler.async_scheduling:
            return self.in_flight.step_async()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.check_compiled(idle=True)
            self.idle_for_offload()
            return EngineCoreOutputs(outputs=[], stats=self.get_stats())
        started = time.monotonic()
        result = self.runner.execute(sched)
        self.kv.observe_step(sched.num_tokens, time.monotonic() - started)
        self.kv.launch_stores()
        return EngineCoreOutputs(outputs=self.apply(sched, result), stats=self.get_stats(sched.num_tokens))

    def publish_early(self, sink: Callable[[EngineCoreOutputs], None]) -> None:
        """Hand a step's outputs to `sink` as soon as the device has finished it
        (`StepsInFlight.publish_early`). The core's loop gives its publisher; the offline `LLM`
        reads its outputs per step and gives none."""
        self.in_flight.publish_early(sink)

    def launch_delay(self) -> float:
        """Seconds the core's loop may go on reading its input before the next `step()`
        (`StepsInFlight.launch_delay`)."""
        return self.in_flight.launch_delay()

    def apply(self, sched: SchedulerOutput, result: RunnerOutput, advanced: bool = False) -> list[EngineCoreOutput]:
        """Apply a resolved step to its requests; one output per request that got a token."""
        for s in sched.scheduled:
            chunk = result.prompt_logprobs.get(s.request.request_id)
            if chunk is not None and not s.request.is_finished:  # not aborted while in flight
                self._prompt_logprobs.setdefault(s.request.request_id, []).extend(chunk)
        outputs = []
        for req, num_new in self.scheduler.update_from_output(sched, result.sampled, advanced, result.verified):
            prompt_lps = None
            if req.sampling_params.prompt_logprobs is not None and req.num_output_tokens == num_new:
                prompt_lps = [None] + self._prompt_logprobs.pop(req.request_id, [])
            lps = result.verified_logprobs.get(req.request_id)
            if lps is None:
                lp = result.logprobs.get(req.request_id)
                lps = [lp] if lp is not None else None
            else:
                lps = lps[:num_new] if lps[0] is not None else None
            transfer = None
            if (req.is_finished and req.kv_transfer_params is not None and self.kv_transfer is not None
                    and req.kv_transfer_params.get("do_remote_decode") and req.finish_reason.value != "abort"):
                transfer = self.kv_transfer.hold(req)
            outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=token_id_array(req.output_token_ids[-num_new:]),
                new_logprobs=lps, prompt_logprobs=prompt_lps,
                finish_reason=req.finish_reason.value if req.finish_reason else None,
                stop_reason=req.stop_reason, num_cached_tokens=max(req.num_cached_tokens, 0),
                events=req.take_events(), kv_transfer_params=transfer))
        return outputs

    def wait_for_offload(self) -> None:
        """Until the KV offload tiers have finished every copy and load in flight."""
        while self.kv.offload is not None and self.kv.offload.busy:
            self.kv.poll_offload()
            self.idle_for_offload()

    def idle_for_offload(self) -> None:
        """Nothing to run but KV offload copies or loads in flight: let them progress a moment
        instead of spinning on empty steps."""
        if self.kv.offload is not None and self.kv.offload.busy:
            time.sleep(_OFFLOAD_IDLE_WAIT_S)
        elif self.kv_transfer is not None:
            self.kv_transfer.idle()

    def get_stats(self, num_scheduled_tokens: int = 0) -> SchedulerStats:
        """The scheduler's state now; `num_scheduled_tokens`: what the step sending it scheduled.
        Every step ends here, so the step's KV events go out with it."""
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.pool.take_events())
        spec = self.scheduler.spec.stats if self.scheduler.spec is not None else None
        return SchedulerStats(
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(), prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_preemptions=self.scheduler.num_preemptions,
            num_kv_pages=self.num_kv_pages, block_size=self.kv.page_size, num_scheduled_tokens=num_scheduled_tokens,
            kv_offload=self.kv.offload.stats() if self.kv.offload is not None else [],
            kv_offload_copy=self.kv.offload.copy_stats() if self.kv.offload is not None else [],
            spec_decode=[spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                         *spec.accepted_per_pos] if spec is not None else [],
            kv_transfer=self.kv_transfer.stats() if self.kv_transfer is not None else [],
            running_lora_adapters=sorted(self.scheduler.running_adapters()) if self.lora is not None else [],
            waiting_lora_adapters=sorted(self.scheduler.waiting_adapters()) if self.lora is not None else [],
            expert_load=self._expert_load_if_due())

    def _expert_load_if_due(self) -> list[list[int]]:
        """Experts across cores: their load every `EXPERT_LOAD_PERIOD_S` while busy (a device sync
        on every rank, so not every step) and whenever the core has nothing left to run (its last
        step's stats, the idle state's: the figures are exact at rest); empty in between."""
        now = time.monotonic()
        if not self.in_lockstep or (self.has_unfinished_requests()
                                    and now - self._expert_load_read_at < EXPERT_LOAD_PERIOD_S):
            return []
        self._expert_load_read_at = now
        return self.executor.expert_load()

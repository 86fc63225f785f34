"""The engine as the API process sees it: `await`able generation over the core processes.

`AsyncEngine` owns the client of the pod's engine cores (one per data-parallel rank: ZMQ,
processes, which core gets a request), the tokenizer, the shared `OutputProcessor`
(n > 1 fan-out, detokenization, stop strings, logprobs) and the server metrics. Each user request
is an async generator of `RequestOutput`s fed from the core's output stream; closing the
generator early (client went away, stream failed, server draining) aborts the request's
sequences in the core so their KV pages are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from pagoda_engine.api.chat_output import ChatOutputSpec
from pagoda_engine.api.output_processor import OutputProcessor
from pagoda_engine.api.outputs import RequestOutput, RequestOutputKind
from pagoda_engine.api.server.core_client import CoreAddresses
from pagoda_engine.api.server.dp_client import DPEngineCoreClient
from pagoda_engine.api.server.errors import APIError, BadRequestError, ServiceUnavailableError, TooManyRequestsError
from pagoda_engine.api.server.metrics import SequenceTimes, ServerMetrics, cache_config_info
from pagoda_engine.config import EngineConfig, ModelConfig
from pagoda_engine.errors import EngineDeadError, InvalidRequestError, ModelLoadError
from pagoda_engine.generation_config import default_sampling_params
from pagoda_engine.lora import LoRARequest, parse_lora_modules
from pagoda_engine.messages import CoreReady, EngineCoreError, EngineCoreOutputs, LoRAUpdate
from pagoda_engine.profiler import profile_tag
from pagoda_engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Stream:
    """A user request in flight: its queue of outputs and, per sequence, the timings /metrics needs."""

    request_id: str
    child_ids: list[str]
    queue: asyncio.Queue
    times: list[SequenceTimes] = field(default_factory=list)
    finished: bool = False


class AsyncEngine:
    def __init__(self, config: EngineConfig, attach: list[CoreAddresses] | None = None, api_server_index: int = 0):
        """`attach`: the cores a launcher spawned, which this process (API server
        `api_server_index` of several) joins; None: start the cores."""
        self.config = config
        self.api_server_index = api_server_index
        self.client = DPEngineCoreClient(config, on_outputs=self._on_outputs, on_refused=self._on_refused,
                                         on_dead=self._on_dead, attach=attach, client_index=api_server_index)
        self.ready: CoreReady | None = None
        self.tokenizer = None
        # SamplingParams keywords a request leaves unset take from here (`generation_config.py`).
        self.default_sampling: dict = {}
        self.processor: OutputProcessor | None = None
        self.metrics: ServerMetrics | None = None
        self.served_model_name = ""
        self.accepting = True
        self._streams: dict[str, _Stream] = {}
        self._parent_of: dict[str, str] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        # --enable-lora: the adapters a request's `model` may name, from --lora-modules and the
        # runtime loads of this process (numbered as the cores number --lora-modules).
        self.loras: dict[str, LoRARequest] = {
            m.name: LoRARequest(m.name, i + 1, m.path, m.base_model_name)
            for i, m in enumerate(parse_lora_modules(config.model.lora_modules))}
        self._next_lora_id = len(self.loras) + 1
        self._lora_lock = asyncio.Lock()

    async def start(self) -> CoreReady:
        """Start the core processes and load the tokenizer (in parallel: both take seconds).
        Raises ModelLoadError when either fails."""
        loop = asyncio.get_running_loop()
        tokenizer_future = loop.run_in_executor(None, _load_tokenizer_and_defaults, self.config.model)
        try:
            self.ready = await self.client.start()
        except BaseException:
            await asyncio.wait([tokenizer_future])  # a thread cannot be cancelled; let it end quietly
            if not tokenizer_future.cancelled():
                tokenizer_future.exception()  # the core's error is the one to report; this one is retrieved, not logged
            raise
        try:
            self.tokenizer, self.default_sampling = await tokenizer_future
        except BaseException:
            await self.client.shutdown()
            raise
        self.processor = OutputProcessor(self.tokenizer)
        self.served_model_name = self.config.model.served_model_name or self.ready.served_model_name
        self.metrics = ServerMetrics(self.served_model_name, num_engines=self.client.size,
                                     max_model_len=self.ready.max_model_len,
                                     cache_info=cache_config_info(self.config.cache, self.ready.num_kv_pages),
                                     multiprocess=self.client.attached, records_steps=self.api_server_index == 0,
                                     vllm_metric_names=self.config.server.vllm_metric_names,
                                     max_lora=self.config.model.max_loras if self.config.model.enable_lora else None)
        return self.ready

    async def shutdown(self, timeout: float = 10.0) -> None:
        await self.client.shutdown(timeout)

    # --- state --------------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def check_accepting(self) -> None:
        if self.client.dead_reason is not None:
            raise EngineDeadError(f"The engine is dead: {self.client.dead_reason}")
        if not self.accepting:
            raise ServiceUnavailableError("The server is shutting down and accepts no new requests.",
                                          code="shutting_down")
        limit = self.config.server.max_waiting_requests
        if limit is not None and self.num_waiting >= limit:
            self.metrics.queue_rejected()
            raise TooManyRequestsError(f"The server's waiting queue is full ({limit} sequences, "
                                       f"--max-waiting-requests); retry shortly or on another replica.")

    @property
    def num_waiting(self) -> int:
        """Sequences of this API process that no engine core has scheduled yet (finished or
        aborted ones aside): the waiting queue as this process sees it, a step behind at most."""
        return sum(1 for stream in self._streams.values() for t in stream.times
                   if t.scheduled_at is None and not t.done)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False when the timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_all(self, error: BaseException) -> None:
        """End every in-flight request with `error` (their generators abort them in the core)."""
        for stream in list(self._streams.values()):
            stream.queue.put_nowait(error)

    async def profile(self, start: bool) -> list[str]:
        """/start_profile (every rank's files share one tag, the time in ms) or /stop_profile:
        the trace and summary paths written. ProfilerStateError when a core refused."""
        return await self.client.profile(start, profile_tag() if start else "")

    # --- LoRA adapters --------------------------------------------------------------------------
    async def load_lora(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter: every core reads and checks the adapter, then requests may
        name it. BadRequestError naming the reason (on a core's refusal, the cores that took it
        drop it again)."""
        if not self.config.model.enable_lora:
            raise BadRequestError("This server serves no LoRA adapters (start it with --enable-lora).")
        if not name or not path:
            raise BadRequestError("Both 'lora_name' and 'lora_path' must be provided.")
        async with self._lora_lock:
            if name in self.loras or name == self.served_model_name:
                raise BadRequestError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            lora = LoRARequest(name, self._next_lora_id, path)
            replies = await self.client.update_lora(LoRAUpdate(lora=lora))
            refused = [r.error for r in replies if r.error is not None]
            if refused:
                if len(refused) < len(replies):
                    await self.client.update_lora(LoRAUpdate(unload=name))
                raise BadRequestError(refused[0], param="lora_path")
            self._next_lora_id += 1
            self.loras[name] = lora

    async def unload_lora(self, name: str) -> None:
        """POST /v1/unload_lora_adapter: new requests may no longer name it; the running ones
        finish under it. NotFoundError when it is not loaded."""
        async with self._lora_lock:
            if name not in self.loras:
                raise APIError(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                               status_code=404, code="lora_adapter_not_found")
            del self.loras[name]
            await self.client.update_lora(LoRAUpdate(unload=name))

    # --- generation ---------------------------------------------------------------------------
    def group(self, output_kind: RequestOutputKind, data_parallel_rank: int | None = None,
              lora_request: LoRARequest | None = None) -> "RequestGroup":
        """A set of requests (one HTTP request's prompts) whose outputs share one queue: DELTA
        for a stream, FINAL_ONLY for one response. `data_parallel_rank` pins them to that engine
        core (vLLM's `X-data-parallel-rank`); None: each goes to the least-loaded one.
        `lora_request`: the adapter they all run under (None: the base model)."""
        return RequestGroup(self, output_kind, data_parallel_rank, lora_request)

    def _add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
             priority: int, queue: asyncio.Queue, output_kind: RequestOutputKind,
             chat_output: ChatOutputSpec | None = None, data_parallel_rank: int | None = None,
             resume_token_ids: list[int] | None = None, lora_request: LoRARequest | None = None) -> _Stream:
        self.check_accepting()
        arrival = time.time()  # the wire's clock: the core's event stamps are compared with it
        core_requests = self.processor.add_request(request_id, prompt, prompt_token_ids, params, arrival, priority,
                                                   output_kind, chat_output, resume_token_ids, lora_request)
        engine = self.client.least_loaded() if data_parallel_rank is None else data_parallel_rank
        stream = _Stream(request_id, [r.request_id for r in core_requests], queue,
                         [SequenceTimes(arrival, len(prompt_token_ids), engine, params.max_tokens)
                          for _ in core_requests])
        self._streams[request_id] = stream
        self._idle.clear()
        for child_id in stream.child_ids:
            self._parent_of[child_id] = request_id
        try:
            self.client.add_requests(core_requests, engine)
        except BaseException:
            self._release(stream)
            raise
        self.metrics.request_added(engine, params.n, lora_request.lora_name if lora_request is not None else None)
        return stream

    def _release(self, stream: _Stream) -> None:
        if self._streams.get(stream.request_id) is not stream:
            return  # released already
        self._streams.pop(stream.request_id, None)
        for child_id in stream.child_ids:
            self._parent_of.pop(child_id, None)
        if not stream.finished:
            still_running = self.processor.abort_request(stream.request_id)
            self.client.abort_requests(still_running)
            for times in stream.times:
                if not times.done:
                    self.metrics.request_finished(times.engine, "abort")
        if not self._streams:
            self._idle.set()

    # --- callbacks from the core client (event loop) ------------------------------------------
    def _on_outputs(self, engine: int, outputs: EngineCoreOutputs) -> None:
        if self.metrics is None:
            return  # the core is up but this side is still starting (tokenizer): nothing is in flight yet
        if outputs.stats is not None:
            self.metrics.update_stats(engine, outputs.stats)
        if not outputs.outputs:
            return
        processed = self.processor.process_outputs(outputs.outputs)
        if processed.abort_child_ids:
            self.client.abort_requests(processed.abort_child_ids)
        for update in processed.sequence_updates:
            stream = self._streams.get(update.request_id)
            if stream is not None:
                self.metrics.observe(stream.times[update.index], update)
        for out in processed.request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                stream.finished = True
            stream.queue.put_nowait(out)

    def _on_refused(self, err: EngineCoreError) -> None:
        parent = self._parent_of.get(err.request_id)
        stream = self._streams.get(parent) if parent is not None else None
        if stream is not None:
            stream.queue.put_nowait(InvalidRequestError(err.message, param=err.param))

    def _on_dead(self, reason: str) -> None:
        self.abort_all(EngineDeadError(f"The engine core died: {reason}"))


def _load_tokenizer_and_defaults(config: ModelConfig):
    """The tokenizer and the request defaults of the model (`generation_config.py`). The path is
    the one the core resolves: the given one, the default model, or the built-in tiny model (built
    once under a file lock, so the two processes never build it twice)."""
    from pagoda_engine.api.tokenizer import load_tokenizer
    from pagoda_engine.model_path import resolve_model_path

    path = resolve_model_path(config.model)
    try:
        defaults = default_sampling_params(path, config.generation_config, config.override_generation_config)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return load_tokenizer(path), defaults


class RequestGroup:
    """The requests of one HTTP request (one per prompt; each may fan out to n sequences).

    Iterate it for their RequestOutputs in arrival order; it ends when all have finished and
    raises the first error any of them got (engine died, core refused, server draining).
    `close()` (always call it: `with engine.group(kind) as group:`) aborts whatever is unfinished.
    """

    def __init__(self, engine: AsyncEngine, output_kind: RequestOutputKind, data_parallel_rank: int | None = None,
                 lora_request: LoRARequest | None = None):
        self.engine = engine
        self.output_kind = output_kind
        self.data_parallel_rank = data_parallel_rank
        self.lora_request = lora_request
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams: list[_Stream] = []

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            priority: int = 0, chat_output: ChatOutputSpec | None = None,
            resume_token_ids: list[int] | None = None) -> None:
        self.streams.append(self.engine._add(request_id, prompt, prompt_token_ids, params, priority, self.queue,
                                             self.output_kind, chat_output, self.data_parallel_rank,
                                             resume_token_ids, self.lora_request))

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for batch in self.batches():
            for item in batch:
                yield item

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """The same outputs, in the same order, as lists: each holds whatever had arrived by the
        time the consumer came back (one step's, or several when the event loop was busy), so a
        stream writes them in one go. An error is raised after the outputs that came before it."""
        unfinished = {s.request_id for s in self.streams}
        queue = self.queue
        while unfinished:
            batch = []
            item = await queue.get()
            while True:
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                batch.append(item)
                if not unfinished or queue.empty():
                    break
                item = queue.get_nowait()
            yield batch

    def close(self) -> None:
        for stream in self.streams:
            self.engine._release(stream)

    def __enter__(self) -> "RequestGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

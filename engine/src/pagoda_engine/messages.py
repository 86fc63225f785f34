"""The typed boundary between the API process and the engine core: every message that crosses ZMQ,
as msgspec structs encoded with msgpack. No torch here: the API process imports this without the
model stack.

Messages are one tagged family (`_Message`, tagged with the class name), in two unions by
direction, `ToCore` and `FromCore`; each end decodes its union and dispatches on the type:

  API -> core   EngineCoreRequest   one sequence to generate
                AbortRequest        stop sequences and free their pages
                ShutdownRequest     finish the loop and exit 0
                StartDPWave         expert parallelism across cores: wake up, another core has work
                ProfileRequest      start or stop torch.profiler on every rank (answered by ProfileReply)
  core -> API   CoreReady           once, after the model and KV pool are up (to every API process)
                CoreFailed          start-up failed (instead of CoreReady), or a step raised: the core exits 1
                EngineCoreOutputs   after every step, and once more when it goes idle (fresh stats)
                EngineCoreError     a request the core would not take (the core keeps serving)
                ProfileReply        a ProfileRequest done, to the API process that sent it

Token ids travel packed (`array('i')`, int32, raw bytes on the wire), never as lists of ints.

Clocks: `EngineCoreRequest.arrival_time` and every `EngineCoreEvent.timestamp` are wall-clock
seconds (`time.time()`), the one clock both processes can compare; intervals measured inside one
process use `time.monotonic()`.
"""

from __future__ import annotations

import enum
from array import array
from typing import Any, Iterable, Union

import msgspec

from pagoda_engine.lora import LoRARequest
from pagoda_engine.sampling_params import SamplingParams

TOKEN_ID_TYPECODE = "i"  # int32 on every platform Pagoda runs on (checked below)
assert array(TOKEN_ID_TYPECODE).itemsize == 4


def token_id_array(ids: Iterable[int] = ()) -> array:
    """Token ids packed as int32, the form they cross the wire in."""
    if isinstance(ids, array) and ids.typecode == TOKEN_ID_TYPECODE:
        return ids
    return array(TOKEN_ID_TYPECODE, ids)


def _enc_hook(obj):
    if isinstance(obj, array):
        return memoryview(token_id_array(obj)).cast("B")  # raw bytes, no per-element work
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(type_, obj):
    if type_ is array and type(obj) is bytes:
        return array(TOKEN_ID_TYPECODE, obj)  # from the raw bytes, no per-element work
    raise NotImplementedError(f"cannot decode {type_!r}")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def make_decoder(type_) -> msgspec.msgpack.Decoder:
    """A decoder for `ToCore` (the core's end) or `FromCore` (the API's end)."""
    return msgspec.msgpack.Decoder(type_, dec_hook=_dec_hook)


class _Message(msgspec.Struct, tag=True, kw_only=True, array_like=True, omit_defaults=True):
    """Base of everything that crosses ZMQ: tagged with its class name."""


# --- API -> core ------------------------------------------------------------------------------

class EngineCoreRequest(_Message):
    """One sequence to generate. The API process fans `n > 1` out into n requests
    (ids `<id>-<index>`), each with its own seed derived from the user's. Its prompt was
    checked where it entered (`api.inputs.check_prompt`)."""

    request_id: str
    prompt_token_ids: array  # int32
    sampling_params: SamplingParams
    arrival_time: float = 0.0  # time.time() when the API process got it
    priority: int = 0
    # Which API server process sent it (`--api-server-count`): its outputs go back there alone.
    client_index: int = 0
    # A continuation (`resume_token_ids`): the tokens this sequence already generated elsewhere.
    # They start its output, so max_tokens, min_tokens, penalties and a seeded row's draws (keyed
    # by the output position) go on exactly as if it had never moved.
    resume_token_ids: array | None = None
    # The LoRA adapter it runs under (`--enable-lora`); None: the base model.
    lora_request: LoRARequest | None = None

    def __post_init__(self) -> None:
        if type(self.prompt_token_ids) is not array:
            self.prompt_token_ids = token_id_array(self.prompt_token_ids)
        if self.resume_token_ids is not None and type(self.resume_token_ids) is not array:
            self.resume_token_ids = token_id_array(self.resume_token_ids)


class AbortRequest(_Message):
    request_ids: list[str]
    client_index: int = 0  # the API server process asking: it may only stop its own requests


class ShutdownRequest(_Message):
    """Finish the loop and exit 0."""


class StartDPWave(_Message):
    """Expert parallelism across data-parallel engine cores (vLLM's START_DP_WAVE): another core
    was just sent a request, so this one stops waiting for input and steps with it (a dummy
    batch when it has nothing of its own)."""


class ProfileRequest(_Message):
    """/start_profile (`start`, every rank's files named with `tag`) or /stop_profile."""

    start: bool
    tag: str = ""
    client_index: int = 0  # the API server process asking: the reply goes to it alone


class LoRAUpdate(_Message):
    """/v1/load_lora_adapter (`lora` set) or /v1/unload_lora_adapter (`unload` names it)."""

    lora: LoRARequest | None = None
    unload: str | None = None
    client_index: int = 0  # the API server process asking: the reply goes to it alone


# --- core -> API ------------------------------------------------------------------------------

class CoreReady(_Message):
    kv_capacity_tokens: int
    max_model_len: int
    vocab_size: int
    model_dir: str
    served_model_name: str
    num_kv_pages: int
    block_size: int


class CoreFailed(_Message):
    """The core could not start (sent instead of CoreReady) or a step raised; it exits 1."""

    error_type: str  # the exception's class name, e.g. ModelLoadError
    message: str


class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int  # 1 = most likely


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one position: the chosen token first, then the top-N."""

    chosen: Logprob
    top: list[Logprob]


class EngineCoreEventType(enum.IntEnum):
    """A request's lifecycle events, stamped by the scheduler (vLLM V1's `EngineCoreEventType`)."""

    QUEUED = 1  # entered the waiting queue
    SCHEDULED = 2  # admitted from the waiting queue (again after each preemption)
    PREEMPTED = 3  # pages taken back; waits to be recomputed
    FIRST_TOKEN = 4  # its first output token was sampled


class EngineCoreEvent(msgspec.Struct, array_like=True, frozen=True):
    type: EngineCoreEventType
    timestamp: float  # time.time() in the core process


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: array  # int32
    new_logprobs: list[TokenLogprobs] | None = None
    # Filled once, on the step that finishes the prompt: one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Lifecycle events since this request's previous output, oldest first.
    events: list[EngineCoreEvent] | None = None
    # A producer's finished `do_remote_decode` request: where a consumer pulls its prompt's pages.
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if type(self.new_token_ids) is not array:  # (the core builds arrays; this is the hot path)
            self.new_token_ids = token_id_array(self.new_token_ids)


# Upper bounds (seconds) of the buckets of `pagoda:kv_offload_load_seconds`; +Inf follows.
KV_OFFLOAD_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVOffloadTierStats(msgspec.Struct, kw_only=True, array_like=True):
    """One KV offload tier (cpu, disk, remote): gauges now, counters since the start."""

    tier: str
    capacity_bytes: int = 0
    usage_bytes: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    errors: int = 0
    # Loads that finished within each bound of KV_OFFLOAD_LOAD_BUCKETS (cumulative), then all of them.
    load_seconds_buckets: list[int] = []
    load_seconds_sum: float = 0.0


class SchedulerStats(msgspec.Struct, kw_only=True, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of pages in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up since start (counter)
    prefix_cache_hits: int = 0  # tokens found (counter)
    num_preemptions: int = 0  # counter
    num_kv_pages: int = 0
    block_size: int = 16
    num_scheduled_tokens: int = 0  # tokens the step that sent these stats scheduled (0: no step ran)
    kv_offload: list[KVOffloadTierStats] = []  # one per configured tier
    # The tiers' host<->device copies, timed on the device (counters over every rank): load bytes,
    # load seconds, store bytes, store seconds. Empty without tiers or CUDA.
    kv_offload_copy: list[float] = []
    # Speculative decoding's counters (empty when it is off): drafts, drafted tokens, accepted
    # tokens, then the accepted drafts at each position 0..k-1.
    spec_decode: list[int] = []
    # Disaggregated prefill/decode (empty when it is off; `core.kv_transfer.KVTransfer.stats`):
    # bytes sent, bytes received, pull seconds, pulls, failures, fallbacks, pages held now,
    # external prefix-cache queries and hits (tokens).
    kv_transfer: list[float] = []
    # --enable-lora: the adapters of the running and of the waiting requests (vLLM's lora_requests_info).
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Experts across data-parallel cores: tokens each expert of this core's ranks took since
    # start-up, [MoE layer][expert] (counters, read every few seconds, not every step: empty in
    # the stats between reads, where the receiver keeps the last).
    expert_load: list[list[int]] = []


class EngineCoreOutputs(_Message):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None


class EngineCoreError(_Message):
    """A request the core refused."""

    request_id: str
    message: str
    param: str | None = None


class ProfileReply(_Message):
    """A ProfileRequest done: the trace and summary paths written (a stop), or why it failed;
    `already`: it failed because the profiler already was as asked (running, or stopped)."""

    paths: list[str] = []
    error: str | None = None
    already: bool = False


class LoRAUpdateReply(_Message):
    """A LoRAUpdate done, or why not; `missing`: an unload named an adapter the core does not serve."""

    error: str | None = None
    missing: bool = False


ToCore = Union[EngineCoreRequest, AbortRequest, ShutdownRequest, StartDPWave, ProfileRequest, LoRAUpdate]
FromCore = Union[CoreReady, CoreFailed, EngineCoreOutputs, EngineCoreError, ProfileReply, LoRAUpdateReply]

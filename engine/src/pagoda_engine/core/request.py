"""The engine-side request: one sequence inside the engine core, its status and finish reasons."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda_engine.lora import LoRARequest
from pagoda_engine.messages import EngineCoreEvent, EngineCoreEventType
from pagoda_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda_engine.structured_outputs import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # client went away or engine shut down


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False)
class Request:
    """One sequence inside the engine core. `n > 1` is fanned out into n Requests by the caller."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)  # wall clock: stamped by the API process
    priority: int = 0  # lower runs first (vLLM's convention)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # A continuation's first output tokens, generated elsewhere (`EngineCoreRequest.resume_token_ids`).
    num_resumed_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Async scheduling: tokens sampled by a step still in flight, not yet in output_token_ids
    # (their KV counts in num_computed_tokens once a step that feeds them is scheduled).
    num_output_placeholders: int = 0
    num_steps_in_flight: int = 0  # async scheduling: launched steps that hold it, not yet resolved
    num_cached_tokens: int = -1  # prefix-cache hit length at first schedule (-1 = not yet scheduled)
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_preemptions: int = 0
    # Position in the waiting/arrival order; ties in priority go to the earlier one.
    arrival_seq: int = 0
    # Lifecycle events not yet sent to the API process (they ride on the request's next output).
    events: list[EngineCoreEvent] = field(default_factory=list)
    # Structured outputs: the grammar its tokens must follow (it waits, unscheduled, until compiled).
    grammar: RequestGrammar | None = None
    # Speculative decoding: tokens drafted after its last one, verified by the step being scheduled.
    spec_token_ids: list[int] = field(default_factory=list)
    # Disaggregated prefill/decode (`core/kv_transfer.py`): the request's `kv_transfer_params`, and
    # whether it waits, unscheduled, for its prompt's pages from a producer.
    kv_transfer_params: dict | None = None
    waits_for_remote_kv: bool = False
    # The LoRA adapter it runs under (None: the base model); its name keys the prefix cache's pages.
    lora_request: LoRARequest | None = None

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None

    @property
    def page_hash_key(self) -> bytes:
        """The extra key of its pages' hashes: a LoRA adapter's pages hold other K/V than the base
        model's for the same tokens (the prefix cache, the offload tiers and KV transfers alike)."""
        return self.lora_name.encode() if self.lora_name is not None else b""

    def record_event(self, type: EngineCoreEventType, timestamp: float | None = None) -> None:
        self.events.append(EngineCoreEvent(type, time.time() if timestamp is None else timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        events, self.events = self.events, []
        return events or None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def waits_for_grammar(self) -> bool:
        return self.grammar is not None and not self.grammar.ready

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

"""Sampling parameters, the engine-side request, its status and finish reasons."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagoda_engine.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Field names and meanings follow vLLM's SamplingParams."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # top-N logprobs per generated token (0 = only the sampled token's)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise InvalidRequestError(message, param=param)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        check(is_int(self.n) and self.n >= 1, "n", f"n must be an integer >= 1, got {self.n!r}")
        check(is_num(self.temperature) and self.temperature >= 0, "temperature",
              f"temperature must be >= 0, got {self.temperature!r}")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k",
              f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty",
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty",
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        check(is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
              f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              "stop_token_ids must be non-negative integers")
        check(self.seed is None or is_int(self.seed), "seed", f"seed must be an integer, got {self.seed!r}")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
              f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        check(self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
              "prompt_logprobs", f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


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
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first (vLLM's convention)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Async scheduling: tokens sampled by a step still in flight, not yet in output_token_ids
    # (their KV counts in num_computed_tokens once a step that feeds them is scheduled).
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit length at first schedule (-1 = not yet scheduled)
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_preemptions: int = 0
    # Position in the waiting/arrival order; ties in priority go to the earlier one.
    arrival_seq: int = 0

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
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASON.get(self.status)

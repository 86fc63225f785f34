"""What a user gets back for a request: vLLM's `RequestOutput` / `CompletionOutput` shapes.

Built by `output_processor.OutputProcessor` from the engine core's outputs; read by the
offline `LLM` (final outputs) and the OpenAI server (streaming deltas, usage, logprobs).
What an output holds depends on the request's `RequestOutputKind`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda_engine.api.chat_output import ParsedDelta


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's `RequestOutputKind`)."""

    CUMULATIVE = 0  # after every step, everything so far (costs O(length) per step)
    DELTA = 1  # after every step, only what that step added: what streaming sends
    FINAL_ONLY = 2  # one output, when the request finishes, with everything


@dataclass
class Logprob:
    """The log probability of one token at one position (vLLM's shape)."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One dict per position: token id -> Logprob; the sampled (or prompt) token first, then the top-N.
PositionLogprobs = dict[int, Logprob]
SampleLogprobs = list[PositionLogprobs]
PromptLogprobs = list[PositionLogprobs | None]  # None for the first prompt token


@dataclass
class CompletionOutput:
    """One of the n sequences of a request.

    Under CUMULATIVE and FINAL_ONLY, `text`, `token_ids` and `logprobs` hold everything so far;
    under DELTA only what the latest step added (and a RequestOutput lists only the sequences that
    changed in it). `cumulative_logprob` is always the running total.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS
    # `text` split into content, reasoning and tool calls, for a chat request with a ChatOutputSpec
    # (same DELTA / everything-so-far rule as `text`).
    parsed: "ParsedDelta | None" = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A user request after one engine step: its sequences in index order (under DELTA, only
    those that changed). `prompt_logprobs` is the same list in every output of a request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Disaggregated prefill: where a decode engine pulls this prompt's pages (vLLM's field).
    kv_transfer_params: dict | None = None

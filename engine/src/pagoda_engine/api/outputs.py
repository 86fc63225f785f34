"""What a user gets back for a request: vLLM's `RequestOutput` / `CompletionOutput` shapes.

Built by `output_processor.OutputProcessor` from the engine core's outputs; read by the
offline `LLM` (final outputs) and the OpenAI server (streaming deltas, usage, logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """One of the n sequences of a request, as of the latest update.

    `text`, `token_ids`, `logprobs` and `cumulative_logprob` are cumulative. The `delta_*`
    fields hold what this update added, and `updated` says whether this sequence changed in
    it at all (new tokens or finished): a streaming client sends a chunk only for those.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id; None for EOS
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None
    updated: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A user request's state after one engine step: all n sequences, in index order."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

"""The typed boundary between the API process and the engine core (msgspec structs, msgpack
over ZMQ). No torch here: the API process imports this without the model stack."""

from __future__ import annotations

import msgspec

from pagoda_engine.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """One sequence to generate. The API process fans `n > 1` out into n requests
    (ids `<id>-<index>`), each with its own seed derived from the user's."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0


class Logprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    rank: int  # 1 = most likely


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one position: the chosen token first, then the top-N."""

    chosen: Logprob
    top: list[Logprob]


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # Filled once, on the step that finishes the prompt: one entry per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: "SchedulerStats | None" = None


class SchedulerStats(msgspec.Struct, kw_only=True, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of pages in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up since start (counter)
    prefix_cache_hits: int = 0  # tokens found (counter)
    num_preemptions: int = 0  # counter
    num_kv_pages: int = 0
    block_size: int = 16


class AbortRequest(msgspec.Struct, array_like=True):
    request_ids: list[str]


class EngineCoreError(msgspec.Struct, kw_only=True, array_like=True):
    """A request the core refused (validation failed inside the core)."""

    request_id: str
    message: str
    param: str | None = None

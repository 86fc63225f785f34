"""From user requests to engine-core requests and back: the API side of the engine core.

Shared by the offline `LLM` and the OpenAI server. `add_request` fans a request with `n > 1`
out into n independent core requests; `process_outputs` turns the core's token ids into
`RequestOutput`s (detokenized text deltas, stop strings, logprobs, finish reasons) and tells
the caller which sequences a stop string ended, because the core knows nothing of strings.

Child request ids: with n == 1 the core request keeps the user's id; with n > 1 child i is
`f"{request_id}-{i}"`. Child i's seed is `seed + i` when the user gave a seed, so a seeded
request with n > 1 is reproducible yet its n samples differ.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pagoda_engine.api.detokenizer import IncrementalDetokenizer
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.messages import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from pagoda_engine.api.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from pagoda_engine.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Sequences a stop string finished while the core still runs them: abort them there.
    abort_child_ids: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Sequence:
    """One child: a sequence the core generates."""

    request_id: str
    index: int
    parent: "_UserRequest"
    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # This step's changes, reset after each process_outputs call.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: SampleLogprobs | None = None
    updated: bool = False


@dataclass(eq=False)
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, _UserRequest] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._decoded_tokens: dict[int, str] = {}  # logprob token texts, decoded once each

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> list[EngineCoreRequest]:
        """Register a user request; return the core requests (one per sequence) to send."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
        n = params.n
        child_ids = [child_request_id(request_id, i, n) for i in range(n)]
        if request_id in self._requests or any(c in self._sequences for c in child_ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if arrival_time is None:
            arrival_time = time.monotonic()  # the clock `Request.arrival_time` uses
        prompt_token_ids = [int(t) for t in prompt_token_ids]

        user_request = _UserRequest(request_id, prompt, prompt_token_ids, params)
        core_requests = []
        for i, child_id in enumerate(child_ids):
            child_seed = params.seed + i if params.seed is not None else None
            child_params = dataclasses.replace(params, n=1, seed=child_seed)
            wants_logprobs = params.logprobs is not None
            seq = _Sequence(
                request_id=child_id,
                index=i,
                parent=user_request,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child_params),
                logprobs=[] if wants_logprobs else None,
                cumulative_logprob=0.0 if wants_logprobs else None,
                delta_logprobs=[] if wants_logprobs else None,
            )
            user_request.sequences.append(seq)
            core_requests.append(
                EngineCoreRequest(
                    request_id=child_id,
                    prompt_token_ids=list(prompt_token_ids),
                    sampling_params=child_params,
                    arrival_time=arrival_time,
                    priority=priority,
                )
            )
        self._requests[request_id] = user_request
        for seq in user_request.sequences:
            self._sequences[seq.request_id] = seq
        return core_requests

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a user request; return the ids of its sequences the core still runs."""
        user_request = self._requests.pop(request_id, None)
        if user_request is None:
            return []
        for seq in user_request.sequences:
            self._sequences.pop(seq.request_id, None)
        return [seq.request_id for seq in user_request.sequences if seq.finish_reason is None]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step of core outputs; return one RequestOutput per user request that changed."""
        result = ProcessedOutputs()
        changed: dict[str, _UserRequest] = {}
        for out in outputs:
            seq = self._sequences.get(out.request_id)
            if seq is None or seq.finish_reason is not None:
                continue  # aborted, or already ended by a stop string: late tokens are dropped
            self._apply(seq, out, result)
            changed[seq.parent.request_id] = seq.parent

        for user_request in changed.values():
            result.request_outputs.append(self._make_output(user_request))
            if user_request.finished:
                self._requests.pop(user_request.request_id, None)
                for seq in user_request.sequences:
                    self._sequences.pop(seq.request_id, None)
        return result

    # -- internals -----------------------------------------------------------------------------

    def _apply(self, seq: _Sequence, out: EngineCoreOutput, result: ProcessedOutputs) -> None:
        detok = seq.detokenizer
        num_before = len(detok.token_ids)
        new_ids = list(out.new_token_ids)
        text = detok.update(new_ids, num_before + len(new_ids), stop_terminated=out.finish_reason == "stop")
        # A stop string can end the sequence before the last of the new tokens.
        accepted = detok.token_ids[num_before:]
        seq.updated = True
        seq.delta_token_ids.extend(accepted)

        if seq.logprobs is not None and out.new_logprobs:
            position_logprobs = [self._position_logprobs(lp) for lp in out.new_logprobs[: len(accepted)]]
            seq.logprobs.extend(position_logprobs)
            seq.delta_logprobs.extend(position_logprobs)
            seq.cumulative_logprob += sum(lp.chosen.logprob for lp in out.new_logprobs[: len(accepted)])

        parent = seq.parent
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [
                None if lp is None else self._position_logprobs(lp) for lp in out.prompt_logprobs
            ]
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)

        if not detok.finished and out.finish_reason is not None:
            text += detok.flush()
        if detok.finished:
            seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            if out.finish_reason is None:
                result.abort_child_ids.append(seq.request_id)
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        seq.delta_text += text

    def _decoded_token(self, token_id: int) -> str:
        text = self._decoded_tokens.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._decoded_tokens[token_id] = text
        return text

    def _position_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        position = {}
        for entry in [lp.chosen, *lp.top]:
            if entry.token_id not in position:
                position[entry.token_id] = Logprob(entry.logprob, entry.rank, self._decoded_token(entry.token_id))
        return position

    def _make_output(self, user_request: _UserRequest) -> RequestOutput:
        completions = []
        for seq in user_request.sequences:
            detok = seq.detokenizer
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=detok.output_text,
                    token_ids=list(detok.token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    delta_text=seq.delta_text,
                    delta_token_ids=seq.delta_token_ids,
                    delta_logprobs=seq.delta_logprobs,
                    updated=seq.updated,
                )
            )
            seq.delta_text, seq.delta_token_ids, seq.updated = "", [], False
            seq.delta_logprobs = [] if seq.logprobs is not None else None
        return RequestOutput(
            request_id=user_request.request_id,
            prompt=user_request.prompt,
            prompt_token_ids=user_request.prompt_token_ids,
            prompt_logprobs=user_request.prompt_logprobs,
            outputs=completions,
            finished=user_request.finished,
            num_cached_tokens=user_request.num_cached_tokens,
        )

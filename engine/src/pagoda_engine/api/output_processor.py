"""From user requests to engine-core requests and back: the API side of the engine core.

Shared by the offline `LLM` and the OpenAI server. `add_request` fans a request with `n > 1`
out into n independent core requests; `process_outputs` turns the core's token ids into
`RequestOutput`s (detokenized text deltas, stop strings, logprobs, finish reasons) and tells
the caller which sequences a stop string ended, because the core knows nothing of strings.
A chat request may also name a `ChatOutputSpec`: each of its sequences then gets a parser fed
every detokenized piece, which splits it into content, reasoning and tool calls (`parsed`).

Each request names its `RequestOutputKind`: DELTA (streaming) and FINAL_ONLY (the offline `LLM`,
non-streaming HTTP) cost O(new tokens) per step, however long the output; CUMULATIVE copies
everything so far at every step.

Child request ids: with n == 1 the core request keeps the user's id; with n > 1 child i is
`f"{request_id}-{i}"`. Child i's seed is `seed + i` when the user gave a seed, so a seeded
request with n > 1 is reproducible yet its n samples differ.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from pagoda_engine.api.chat_output import ChatOutputParser, ChatOutputSpec, ParsedDelta, merge_parsed
from pagoda_engine.api.detokenizer import IncrementalDetokenizer, ids_decoder
from pagoda_engine.api.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    PromptLogprobs,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.lora import LoRARequest
from pagoda_engine.messages import EngineCoreEvent, EngineCoreOutput, EngineCoreRequest, TokenLogprobs, token_id_array
from pagoda_engine.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}-{index}"


@dataclass
class SequenceUpdate:
    """What one step did to one sequence, whatever its request's output kind: the facts the
    server's metrics are computed from."""

    request_id: str  # the user request's
    index: int
    num_new_tokens: int  # accepted (a stop string may cut the step's tokens short)
    finish_reason: str | None
    events: list[EngineCoreEvent] | None


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Sequences a stop string finished while the core still runs them: abort them there.
    abort_child_ids: list[str] = field(default_factory=list)
    sequence_updates: list[SequenceUpdate] = field(default_factory=list)


@dataclass(eq=False)
class _Sequence:
    """One child: a sequence the core generates.

    `text_parts`, `token_ids` and `logprobs` hold what the next RequestOutput reports: under
    DELTA what arrived since the last one (then they are handed over and started afresh),
    otherwise everything so far."""

    request_id: str
    index: int
    parent: "_UserRequest"
    detokenizer: IncrementalDetokenizer
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    parser: ChatOutputParser | None = None
    parsed_parts: list[ParsedDelta] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    updated: bool = False  # changed since the last RequestOutput


@dataclass(eq=False)
class _UserRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: RequestOutputKind
    sequences: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # a producer's answer (disaggregated prefill)

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decoder = ids_decoder(tokenizer)
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
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        chat_output: ChatOutputSpec | None = None,
        resume_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a user request (its prompt already passed `api.inputs.check_prompt`); return
        the core requests (one per sequence) to send. With `chat_output`, each sequence's text is
        also parsed (streamed calls go out piece by piece only under DELTA).

        `resume_token_ids` (n == 1 only): the output a sequence already streamed elsewhere (a
        router migrating it). They pass through the detokenizer and the parser as if just
        generated and their text is dropped, so what follows is exactly what the first engine
        would have sent next; the core continues after them."""
        if resume_token_ids and params.n != 1:
            raise InvalidRequestError("resume_token_ids needs n == 1", param="resume_token_ids")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        n = params.n
        child_ids = [child_request_id(request_id, i, n) for i in range(n)]
        if request_id in self._requests or any(c in self._sequences for c in child_ids):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if arrival_time is None:
            arrival_time = time.time()  # the wire's clock (messages.py)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        packed_prompt = token_id_array(prompt_token_ids)

        user_request = _UserRequest(request_id, prompt, prompt_token_ids, params, output_kind)
        core_requests = []
        for i, child_id in enumerate(child_ids):
            child_seed = params.seed + i if params.seed is not None else None
            # Stop strings are matched here, never in the core: sending them would cost
            # O(stop strings x n) on the wire for nothing.
            child_params = dataclasses.replace(params, n=1, seed=child_seed, stop=[])
            wants_logprobs = params.logprobs is not None
            seq = _Sequence(
                request_id=child_id,
                index=i,
                parent=user_request,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, self._decoder),
                cumulative_logprob=0.0 if wants_logprobs else None,
                logprobs=[] if wants_logprobs else None,
                parser=chat_output.parser(incremental=output_kind is RequestOutputKind.DELTA)
                if chat_output is not None else None,
            )
            user_request.sequences.append(seq)
            if resume_token_ids:
                self._replay(seq, resume_token_ids)
            core_requests.append(
                EngineCoreRequest(
                    request_id=child_id,
                    prompt_token_ids=packed_prompt,
                    sampling_params=child_params,
                    arrival_time=arrival_time,
                    priority=priority,
                    resume_token_ids=token_id_array(resume_token_ids) if resume_token_ids else None,
                    lora_request=lora_request,
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
        """Apply one step of core outputs. Returns one RequestOutput per user request that changed
        (under FINAL_ONLY, only once it finished) and one SequenceUpdate per sequence that did."""
        result = ProcessedOutputs()
        changed: dict[str, _UserRequest] = {}
        for out in outputs:
            seq = self._sequences.get(out.request_id)
            if seq is None or seq.finish_reason is not None:
                continue  # aborted, or already ended by a stop string: late tokens are dropped
            self._apply(seq, out, result)
            changed[seq.parent.request_id] = seq.parent

        for user_request in changed.values():
            finished = user_request.finished
            if finished or user_request.output_kind is not RequestOutputKind.FINAL_ONLY:
                result.request_outputs.append(self._make_output(user_request, finished))
            if finished:
                self._requests.pop(user_request.request_id, None)
                for seq in user_request.sequences:
                    self._sequences.pop(seq.request_id, None)
        return result

    # -- internals -----------------------------------------------------------------------------

    @staticmethod
    def _replay(seq: _Sequence, token_ids: list[int]) -> None:
        """Feed a resumed sequence's earlier tokens one at a time (as the engine that generated
        them did, one per step) and drop their text: it reached the client already."""
        detok = seq.detokenizer
        for count, token_id in enumerate(token_ids, start=1):
            text = detok.update([token_id], count)
            if detok.finished:
                raise InvalidRequestError("resume_token_ids already end the sequence at a stop string",
                                          param="resume_token_ids")
            if seq.parser is not None and text:
                seq.parser.feed(text)

    def _apply(self, seq: _Sequence, out: EngineCoreOutput, result: ProcessedOutputs) -> None:
        detok = seq.detokenizer
        num_before = detok.num_tokens
        new_ids = out.new_token_ids
        text = detok.update(new_ids, num_before + len(new_ids), stop_terminated=out.finish_reason == "stop")
        # A stop string can end the sequence before the last of the new tokens.
        num_accepted = detok.num_tokens - num_before
        seq.updated = True
        seq.token_ids.extend(new_ids[:num_accepted])

        if seq.logprobs is not None and out.new_logprobs:
            accepted_logprobs = out.new_logprobs[:num_accepted]
            seq.logprobs.extend(self._position_logprobs(lp) for lp in accepted_logprobs)
            seq.cumulative_logprob += sum(lp.chosen.logprob for lp in accepted_logprobs)

        parent = seq.parent
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [
                None if lp is None else self._position_logprobs(lp) for lp in out.prompt_logprobs
            ]
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            parent.kv_transfer_params = out.kv_transfer_params

        if not detok.finished and out.finish_reason is not None:
            text += detok.flush()
        if detok.finished:
            seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            if out.finish_reason is None:
                result.abort_child_ids.append(seq.request_id)
        elif out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        if text:
            seq.text_parts.append(text)
        if seq.parser is not None:
            parsed = seq.parser.feed(text) if text else None
            if seq.finish_reason is not None:
                parsed = merge_parsed([parsed, seq.parser.finish()]) if parsed else seq.parser.finish()
            if parsed is not None:
                seq.parsed_parts.append(parsed)
        result.sequence_updates.append(
            SequenceUpdate(parent.request_id, seq.index, num_accepted, seq.finish_reason, out.events))

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

    def _make_output(self, user_request: _UserRequest, finished: bool) -> RequestOutput:
        if user_request.output_kind is RequestOutputKind.DELTA:
            completions = [self._take_delta(seq) for seq in user_request.sequences if seq.updated]
        else:
            # CUMULATIVE copies what it keeps growing; FINAL_ONLY hands its lists over (last output).
            copy = user_request.output_kind is RequestOutputKind.CUMULATIVE
            completions = [self._snapshot(seq, copy) for seq in user_request.sequences]
        return RequestOutput(
            request_id=user_request.request_id,
            prompt=user_request.prompt,
            prompt_token_ids=user_request.prompt_token_ids,
            prompt_logprobs=user_request.prompt_logprobs,
            outputs=completions,
            finished=finished,
            num_cached_tokens=user_request.num_cached_tokens,
            kv_transfer_params=user_request.kv_transfer_params,
        )

    @staticmethod
    def _take_delta(seq: _Sequence) -> CompletionOutput:
        completion = CompletionOutput(
            index=seq.index, text="".join(seq.text_parts), token_ids=seq.token_ids,
            cumulative_logprob=seq.cumulative_logprob, logprobs=seq.logprobs,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, parsed=_take_parsed(seq))
        seq.text_parts, seq.token_ids, seq.updated = [], [], False
        seq.parsed_parts = []
        seq.logprobs = [] if seq.logprobs is not None else None
        return completion

    @staticmethod
    def _snapshot(seq: _Sequence, copy: bool) -> CompletionOutput:
        if len(seq.text_parts) > 1:
            seq.text_parts = ["".join(seq.text_parts)]
        seq.updated = False
        parsed = _take_parsed(seq)
        if parsed is not None:
            seq.parsed_parts = [parsed]
        return CompletionOutput(
            index=seq.index, text=seq.text_parts[0] if seq.text_parts else "",
            token_ids=list(seq.token_ids) if copy else seq.token_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.logprobs) if copy and seq.logprobs is not None else seq.logprobs,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, parsed=parsed)


def _take_parsed(seq: _Sequence) -> ParsedDelta | None:
    if seq.parser is None:
        return None
    return merge_parsed(seq.parsed_parts) if seq.parsed_parts else ParsedDelta()

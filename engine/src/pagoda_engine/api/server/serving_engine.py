"""What every OpenAI endpoint shares, between the protocol models and the `AsyncEngine`: the
served model (its name, its /v1/models card) and the base class of the endpoint handlers
(`serving_completion`, `serving_chat`, `serving_tokenization`).

`OpenAIServing` owns the checks every generating request goes through, so that everything a
client can get wrong is refused before the core sees it: the model name, the prompt ids against
the vocabulary and context window, `truncate_prompt_tokens`, `max_tokens` fitted to the room left,
fields the server cannot honour, and work beyond the request limits (`ServerConfig.max_*`, each
refusal naming its flag). It also owns the life of a request group once it is built: adding its
sequences without stalling the event loop, collecting the final outputs unless the client leaves
first, and finishing a stream (an in-band error, the group closed, `[DONE]`).

The event loop never does work that grows with the input: the handlers tokenize, template and
check prompts in a worker thread (`asyncio.to_thread`), and a request fanning out into many
sequences yields to the loop between its prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import Request

from pagoda_engine.lora import LoRARequest
from pagoda_engine.api.inputs import check_prompt
from pagoda_engine.api.outputs import PositionLogprobs, RequestOutput, RequestOutputKind
from pagoda_engine.api.server.async_engine import AsyncEngine, RequestGroup
from pagoda_engine.api.server.errors import BadRequestError, ModelNotFoundError
from pagoda_engine.kv_transfer import check_request_params
from pagoda_engine.api.server.protocol import ModelCard, ModelList, UsageInfo
from pagoda_engine.api.server.sse import DONE, SSEResponse, sse_error, sse_response
from pagoda_engine.api.tokenizer import encode_text
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.structured_outputs import check as check_structured_outputs

T = TypeVar("T")
# Sequences added to the engine between two yields to the event loop.
_ADD_SLICE = 64
# vLLM's header: pin a request to one data-parallel engine core instead of the least-loaded one.
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


async def until_disconnected(raw: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client disconnects first; then cancel it (which aborts its requests
    in the core) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise ClientDisconnected()
    return task.result()


def _output_kind(stream: bool) -> RequestOutputKind:
    # A stream sends each step's new text; a whole response needs only the finished outputs.
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def usage_options(req) -> tuple[bool, bool]:
    """(a usage chunk ends the stream, every chunk carries the usage so far), from `stream_options`."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return include_usage, include_usage and req.stream_options.continuous_usage_stats


class OpenAIServing:
    """The served model and the checks and request-group handling its endpoints share; on its
    own it answers /v1/models."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.limits = engine.config.server

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    def response_model(self, req) -> str:
        """The `model` a response names: the adapter the request selected (`check_model` passed), else
        the served model, as vLLM answers."""
        return req.model or self.model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # --- checks -------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (--enable-lora), None for the base model; ModelNotFoundError
        for any other name."""
        if model is None or model == self.model_name:
            return None
        lora = self.engine.loras.get(model)
        if lora is None:
            raise ModelNotFoundError(model, [self.model_name, *self.engine.loras])
        return lora

    def _check_prompt_ids(self, ids: list[int], param: str = "prompt", num_tokens: int | None = None) -> None:
        check_prompt(ids, vocab_size=self.engine.vocab_size, max_model_len=self.engine.max_model_len, param=param,
                     num_tokens=num_tokens)

    def _encode(self, text: str, add_special_tokens: bool = True, keep: int | None = None) -> tuple[list[int], int]:
        """(ids, how many tokens the text has). Without `keep` a prompt of max_model_len tokens or
        more is only counted (ids [], it is refused), so more ids than that are never made; with
        `keep` the ids are the text's last `keep` (the whole text is encoded, bounded by
        --max-request-body-bytes)."""
        if keep is None:
            return encode_text(self.tokenizer, text, add_special_tokens=add_special_tokens,
                               limit=self.engine.max_model_len)
        ids = encode_text(self.tokenizer, text, add_special_tokens=add_special_tokens)[0]
        return ids[-keep:], len(ids)

    def _truncation(self, req) -> int | None:
        """How many prompt tokens a request keeps (`truncate_prompt_tokens`), or None: all."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return None
        if keep == -1:
            return self.engine.max_model_len - 1
        if keep == 0 or keep >= self.engine.max_model_len:
            raise BadRequestError(f"truncate_prompt_tokens value ({keep}) must be -1 or in [1, max_model_len "
                                  f"({self.engine.max_model_len})), leaving room for output. Please select a "
                                  "smaller truncation size.", param="truncate_prompt_tokens")
        return keep

    def _check_limits(self, req, num_prompts: int) -> None:
        """Refuse a request that asks for more work than the server's limits allow."""
        limits = self.limits
        if num_prompts * req.n > limits.max_sequences_per_request:
            raise BadRequestError(
                f"The request asks for {num_prompts * req.n} sequences ({num_prompts} prompt(s) x n={req.n}); "
                f"the limit is {limits.max_sequences_per_request} (--max-sequences-per-request).", param="n",
                code="too_many_sequences")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        if len(stops) > limits.max_stop_strings:
            raise BadRequestError(f"The request has {len(stops)} stop strings; the limit is "
                                  f"{limits.max_stop_strings} (--max-stop-strings).", param="stop",
                                  code="too_many_stop_strings")
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_string_length:
            raise BadRequestError(f"A stop string has {longest} characters; the limit is "
                                  f"{limits.max_stop_string_length} (--max-stop-string-length).", param="stop",
                                  code="stop_string_too_long")
        if req.logit_bias is not None and len(req.logit_bias) > limits.max_logit_bias_entries:
            raise BadRequestError(f"logit_bias has {len(req.logit_bias)} entries; the limit is "
                                  f"{limits.max_logit_bias_entries} (--max-logit-bias-entries).",
                                  param="logit_bias", code="too_many_logit_bias_entries")

    def _check_honoured(self, req) -> None:
        """Refuse fields whose meaning this server cannot give them (vLLM refuses the same)."""
        if req.priority and self.engine.config.scheduler.policy != "priority":
            raise BadRequestError("priority is only honoured with --scheduling-policy priority; this server "
                                  "schedules first come, first served.", param="priority")
        if req.stream_options is not None and not req.stream:
            raise BadRequestError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if req.prompt_logprobs is not None and req.stream:
            raise BadRequestError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        refusal = check_request_params(req.kv_transfer_params, self.engine.config.kv_transfer_config, req.n)
        if refusal is None and req.stream and (req.kv_transfer_params or {}).get("do_remote_decode"):
            refusal = "kv_transfer_params.do_remote_decode returns its params in one response: stream must be false"
        if refusal is not None:
            raise BadRequestError(refusal, param="kv_transfer_params")

    def _check_resume(self, req, ids: list[int], params: SamplingParams) -> None:
        """A continuation (`resume_token_ids`) must be one streamed sequence whose resumed output
        fits the vocabulary, the context window and max_tokens."""
        resume = req.resume_token_ids
        if resume is None:
            return
        why = ("it needs stream=True" if not req.stream else "it needs n == 1" if params.n != 1
               else "echo repeats the prompt" if getattr(req, "echo", False)
               else "prompt_logprobs are not available" if req.prompt_logprobs is not None
               else None)
        if why is not None:
            raise BadRequestError(f"resume_token_ids cannot be used here: {why}.", param="resume_token_ids")
        self._check_prompt_ids(ids + list(resume), param="resume_token_ids")
        if params.max_tokens is not None and len(resume) >= params.max_tokens:
            raise BadRequestError(f"resume_token_ids has {len(resume)} tokens, as many as max_tokens "
                                  f"({params.max_tokens}) allows: the sequence is complete.", param="resume_token_ids")

    def _data_parallel_rank(self, raw: Request) -> int | None:
        """The engine core the client pinned this request to (`X-data-parallel-rank`), or None
        for the least-loaded one; 400 for a value that is not a core's rank."""
        value = raw.headers.get(DATA_PARALLEL_RANK_HEADER)
        if value is None:
            return None
        size = self.engine.config.parallel.data_parallel_size
        try:
            rank = int(value.strip())
        except ValueError:
            rank = -1
        if not 0 <= rank < size:
            raise BadRequestError(f"Invalid {DATA_PARALLEL_RANK_HEADER} header {value!r}: it must be an engine core's "
                                  f"rank, an integer in [0, {size}) (--data-parallel-size {size}).",
                                  code="invalid_data_parallel_rank")
        return rank

    def _check_num_messages(self, messages) -> None:
        if messages is not None and len(messages) > self.limits.max_chat_messages:
            raise BadRequestError(f"The request has {len(messages)} messages; the limit is "
                                  f"{self.limits.max_chat_messages} (--max-chat-messages).", param="messages",
                                  code="too_many_messages")

    def _fit_max_tokens(self, requested: int | None, num_prompt_tokens: int, param: str) -> int:
        """The request's max_tokens, or the room left in the context window; at most the model's
        max_new_tokens where its generation config sets one (as vLLM caps it)."""
        room = self.engine.max_model_len - num_prompt_tokens
        if requested is not None and requested > room:
            raise BadRequestError(
                f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you "
                f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
                f"{requested} for the completion). Please reduce the prompt or {param}.", param=param)
        cap = self.engine.default_sampling.get("max_tokens")
        return min(v for v in (room if requested is None else requested, cap) if v is not None)

    def _finish_params(self, params: SamplingParams) -> SamplingParams:
        if params.top_k >= self.engine.vocab_size:
            params.top_k = 0  # top-k over the whole vocabulary is no top-k
        bad = next((t for t in params.stop_token_ids if t >= self.engine.vocab_size), None)
        if bad is not None:
            raise BadRequestError(f"stop_token_ids: token id {bad} is outside the vocabulary.", param="stop_token_ids")
        bad = next((t for t in params.logit_bias or () if t >= self.engine.vocab_size), None)
        if bad is not None:
            raise BadRequestError(f"logit_bias: token id {bad} is outside the vocabulary [0, "
                                  f"{self.engine.vocab_size}).", param="logit_bias")
        if params.structured_outputs is not None:
            # Compiled once here, off the event loop (cached): a bad grammar is a 400 now.
            check_structured_outputs(params.structured_outputs)
        return params

    def _request_id(self, prefix: str, user_id: str | None) -> str:
        return f"{prefix}-{user_id}" if user_id else f"{prefix}-{uuid.uuid4().hex}"

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    # --- /v1/models ----------------------------------------------------------------------------
    def models(self) -> ModelList:
        """The base model, then each LoRA adapter (`parent`: its --lora-modules `base_model_name`,
        else the served model), as vLLM lists them."""
        base = ModelCard(id=self.model_name, root=self.engine.ready.model_dir, max_model_len=self.engine.max_model_len)
        return ModelList(data=[base, *(ModelCard(id=name, root=lora.lora_path,
                                                 parent=lora.base_model_name or self.model_name,
                                                 max_model_len=self.engine.max_model_len)
                                       for name, lora in self.engine.loras.items())])

    # --- response parts -------------------------------------------------------------------------
    def _usage(self, num_prompt: int, num_generated: int, num_cached: int) -> UsageInfo:
        """The usage block; with --enable-prompt-tokens-details, how many prompt tokens the prefix
        cache (any tier) served, as vLLM reports them."""
        extra = {}
        if self.limits.enable_prompt_tokens_details:
            extra["prompt_tokens_details"] = {"cached_tokens": num_cached}
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                         total_tokens=num_prompt + num_generated, **extra)

    @staticmethod
    def _top_of_prompt(ids: list[int], logprobs: list[PositionLogprobs | None] | None,
                       top_n: int) -> list[PositionLogprobs | None]:
        """Each prompt position's own token and the `top_n` most likely there: the engine computed
        as many as the larger of `logprobs` (echo) and `prompt_logprobs` asked, each gets its own."""
        return [None if position is None else
                {tid: lp for tid, lp in position.items() if tid == token_id or (lp.rank or 0) <= top_n}
                for token_id, position in zip(ids, logprobs or [None] * len(ids))]

    def _prompt_logprobs(self, ids: list[int], logprobs: list[PositionLogprobs | None] | None,
                         top_n: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs` body: per prompt token (None for the first), token id → logprob,
        rank and text, for the prompt's own token and the `top_n` most likely there."""
        return [None if position is None else
                {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                            "decoded_token": lp.decoded_token if lp.decoded_token is not None else self._token_text(tid)}
                 for tid, lp in position.items()}
                for position in self._top_of_prompt(ids, logprobs, top_n)]

    # --- running a request group ----------------------------------------------------------------
    async def _start_group(self, stream: bool, data_parallel_rank: int | None, entries,
                           lora_request: LoRARequest | None = None) -> RequestGroup:
        """A request group (for a stream, or for whole responses) with the (request_id, text, ids,
        params, priority[, structured-output spec]) `entries` added, yielding to the event loop
        between slices so that a large fan-out never stalls other requests; on any error the
        group is closed (its added requests aborted). `lora_request`: their adapter."""
        group = self.engine.group(_output_kind(stream), data_parallel_rank, lora_request)
        try:
            added = 0
            for entry in entries:
                group.add(*entry)
                added += entry[3].n
                if added >= _ADD_SLICE:
                    added = 0
                    await asyncio.sleep(0)
        except BaseException:
            group.close()
            raise
        return group

    async def _final_outputs(self, raw: Request, group: RequestGroup) -> dict[str, RequestOutput]:
        """Each request's finished output, unless the client disconnects first (ClientDisconnected);
        the group is closed either way."""
        try:
            return await until_disconnected(raw, _collect(group))
        finally:
            group.close()

    def _stream_response(self, frames: AsyncIterator[str | bytes], group: RequestGroup) -> SSEResponse:
        """The SSE response of a stream's `frames`, finished by `_finish_stream`."""
        return sse_response(_finish_stream(frames, group))


async def _collect(group: RequestGroup) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    async for out in group:
        if out.finished:
            finals[out.request_id] = out
    return finals


async def _finish_stream(frames: AsyncIterator[str | bytes], group: RequestGroup) -> AsyncIterator[str | bytes]:
    """`frames`, then `[DONE]`. An error is reported in-band (the status line went out already);
    the group is closed when the frames end, fail or the client leaves (aborting what is
    unfinished)."""
    try:
        async with contextlib.aclosing(frames):
            async for frame in frames:
                yield frame
    except Exception as e:
        yield sse_error(e)
    finally:
        group.close()
    yield DONE

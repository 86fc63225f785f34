"""The OpenAI endpoints' logic, between the protocol models and the `AsyncEngine`.

For each request: check the model name, turn prompts or chat messages into token ids, check them
against the model (vocabulary, context window) and fit `max_tokens`, build `SamplingParams`,
run the prompts as one `RequestGroup`, and shape the `RequestOutput`s into OpenAI responses or
SSE chunks. Everything a client can get wrong is refused here, before the core sees it,
including work beyond the request limits (`ServerConfig.max_*`, each refusal naming its flag).

The event loop never does work that grows with the input: tokenization, chat templating, the
prompt checks and building the stop-string automaton run in a worker thread (`asyncio.to_thread`),
and a request fanning out into many sequences yields to the loop between its prompts.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Awaitable, TypeVar

import anyio
from fastapi import Request
from pydantic_core import to_json
from starlette.responses import StreamingResponse

from pagoda_engine.api.detokenizer import stop_strings
from pagoda_engine.api.inputs import check_prompt
from pagoda_engine.api.outputs import CompletionOutput, PositionLogprobs, RequestOutput, RequestOutputKind
from pagoda_engine.api.server.chat_tools import ChatOutputPlan, plan_chat_output
from pagoda_engine.api.server.async_engine import AsyncEngine
from pagoda_engine.api.server.errors import BadRequestError, ModelNotFoundError, exception_to_body, sse_error_frame
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.structured_outputs import check as check_structured_outputs
from pagoda_engine.api.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    UsageInfo,
    chat_message_dicts,
    template_tools,
)
from pagoda_engine.api.tokenizer import encode_text, render_chat

T = TypeVar("T")
_DONE = "data: [DONE]\n\n"
# Sequences added to the engine between two yields to the event loop.
_ADD_SLICE = 64


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


# vLLM's header: pin a request to one data-parallel engine core instead of the least-loaded one.
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"


def _sse(obj) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


class _StreamFrames:
    """The SSE frames of a stream's plain chunks (one choice, no logprobs, no usage), written from
    byte templates instead of pydantic models: the bytes `_sse` would write for the same
    `CompletionStreamResponse` / `ChatCompletionStreamResponse`, at a fraction of the cost
    (strings are escaped by pydantic's own JSON writer)."""

    def __init__(self, request_id: str, created: int, model: str, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        self.head = (f'data: {{"id":{_json(request_id)},"object":"{kind}","created":{created},'
                     f'"model":{_json(model)},"choices":[{{"index":').encode()
        self.chat = chat

    def chunk(self, index: int, text: str, finish_reason: str | None, stop_reason: int | str | None) -> bytes:
        end = b',"finish_reason":' + to_json(finish_reason) + b',"stop_reason":' + to_json(stop_reason)
        if self.chat:
            return b"".join((self.head, str(index).encode(), b',"logprobs":null', end,
                             b',"delta":{"role":null,"content":', to_json(text),
                             b',"reasoning":null,"tool_calls":null}}],"usage":null}\n\n'))
        return b"".join((self.head, str(index).encode(), b',"text":', to_json(text), b',"logprobs":null', end,
                         b'}],"usage":null}\n\n'))


def _json(text: str) -> str:
    return to_json(text).decode()


class OpenAIServing:
    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.limits = engine.config.server

    @property
    def model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # --- checks -------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(model, [self.model_name])

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

    async def _add_to_group(self, group, entries) -> None:
        """Add (request_id, text, ids, params, priority) entries to `group`, yielding to the event
        loop between slices so that a large fan-out never stalls other requests; on any error
        the group is closed (its added requests aborted)."""
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

    # --- /v1/models, /tokenize, /detokenize ---------------------------------------------------
    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, root=self.engine.ready.model_dir,
                                         max_model_len=self.engine.max_model_len)])

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise BadRequestError("Give exactly one of `prompt` and `messages`.", param="prompt")
        self._check_num_messages(req.messages)

        def run() -> list[int]:
            if req.prompt is not None:
                return encode_text(self.tokenizer, req.prompt, add_special_tokens=req.add_special_tokens)[0]
            text = render_chat(self.tokenizer, chat_message_dicts(req.messages), req.add_generation_prompt,
                               self.limits.chat_template, template_tools(req.tools), req.chat_template_kwargs,
                               req.continue_final_message)
            return encode_text(self.tokenizer, text, add_special_tokens=False)[0]

        ids = await asyncio.to_thread(run)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.engine.vocab_size

        def run() -> str:
            bad = next((t for t in req.tokens if t >= vocab), None)
            if bad is not None:
                raise BadRequestError(f"Token id {bad} is outside the vocabulary [0, {vocab}).", param="tokens")
            return self.tokenizer.decode(req.tokens)

        return DetokenizeResponse(prompt=await asyncio.to_thread(run))

    # --- /v1/completions ----------------------------------------------------------------------
    @staticmethod
    def _completion_prompts(prompt) -> list:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise BadRequestError("prompt must not be an empty list.", param="prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt

    def _completion_plan(self, req: CompletionRequest, prompts: list) -> list:
        """(text, ids, params) for each prompt: tokenized, checked, max_tokens fitted. Runs in a
        worker thread (O(prompt length))."""
        plan = []
        keep = self._truncation(req)
        for p in prompts:
            if isinstance(p, str):
                text, (ids, num_tokens) = p, self._encode(p, keep=keep)
                if keep is not None and num_tokens > keep:
                    text, num_tokens = None, keep  # cut: echo shows what the model saw, the kept tokens decoded
            else:
                text, ids = None, list(p)[-keep:] if keep else list(p)
                num_tokens = len(ids)
            self._check_prompt_ids(ids, num_tokens=num_tokens)
            params = req.to_sampling_params(self._fit_max_tokens(req.max_tokens, len(ids), "max_tokens"),
                                            self.engine.default_sampling)
            if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs
                params.prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
            plan.append((text, ids, self._finish_params(params)))
        if plan and plan[0][2].stop:
            stop_strings(tuple(plan[0][2].stop))  # built here, off the loop; the detokenizers share it
        return plan

    async def create_completion(self, req: CompletionRequest, raw: Request):
        self.check_model(req.model)
        self.engine.check_accepting()
        if req.suffix:
            raise BadRequestError("suffix is not supported.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise BadRequestError("best_of must equal n (Pagoda returns every sequence it generates).",
                                  param="best_of")
        prompts = self._completion_prompts(req.prompt)
        self._check_limits(req, len(prompts))
        self._check_honoured(req)
        data_parallel_rank = self._data_parallel_rank(raw)
        plan = await asyncio.to_thread(self._completion_plan, req, prompts)
        request_id = self._request_id("cmpl", req.request_id)

        group = self.engine.group(_output_kind(req.stream), data_parallel_rank)
        await self._add_to_group(group, [
            (request_id if len(plan) == 1 else f"{request_id}-p{i}", text, ids, params, req.priority)
            for i, (text, ids, params) in enumerate(plan)])
        index_of = {s.request_id: i for i, s in enumerate(group.streams)}
        if req.stream:
            return _sse_response(self._completion_stream(req, request_id, plan, group, index_of))
        try:
            finals = await until_disconnected(raw, _collect(group))
        finally:
            group.close()
        return self._completion_response(req, request_id, plan, finals, index_of)

    def _completion_response(self, req, request_id, plan, finals: dict[str, RequestOutput], index_of):
        choices, num_generated = [], 0
        for rid, out in sorted(finals.items(), key=lambda kv: index_of[kv[0]]):
            i = index_of[rid]
            text, ids, _ = plan[i]
            for c in out.outputs:
                num_generated += len(c.token_ids)
                prefix = self._echo_text(text, ids) if req.echo else ""
                logprobs = None
                if req.logprobs is not None:
                    logprobs = CompletionLogprobs()
                    if req.echo:
                        self._add_completion_logprobs(logprobs, ids, self._top_of_prompt(ids, out.prompt_logprobs,
                                                                                          req.logprobs),
                                                      0, self._prompt_offsets(text, ids))
                    self._add_completion_logprobs(logprobs, c.token_ids, c.logprobs, len(prefix))
                extra = {}
                if req.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = self._prompt_logprobs(ids, out.prompt_logprobs, req.prompt_logprobs)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason, **extra))
        num_prompt = sum(len(ids) for _, ids, _ in plan)
        return CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=self._usage(num_prompt, num_generated,
                                                    sum(out.num_cached_tokens for out in finals.values())))

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

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.tokenizer.decode(ids)

    def _prompt_offsets(self, text: str | None, ids: list[int]) -> list[int] | None:
        """Where each prompt token starts in the echoed prompt text, from the tokenizer's offset
        mapping: special tokens such as <s> are not in the text (they start at 0 and take no room).
        None when the prompt came as token ids (its echo is their decoding) or the tokenizer has no
        offsets; the token texts are then laid end to end."""
        if text is None:
            return None
        try:
            enc = self.tokenizer(text, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # slow (Python) tokenizers have no offsets
            return None
        if list(enc["input_ids"]) != list(ids):
            return None
        return [start for start, _ in enc["offset_mapping"]]

    def _add_completion_logprobs(self, into: CompletionLogprobs, token_ids: list[int],
                                 logprobs: list[PositionLogprobs | None] | None, offset: int,
                                 offsets: list[int] | None = None) -> None:
        """Append tokens to `into`; `offset` is where the first of them starts in the choice's text
        (or `offsets`, one per token, where each starts)."""
        if logprobs is None:
            logprobs = [None] * len(token_ids)
        for i, (token_id, position) in enumerate(zip(token_ids, logprobs)):
            token = self._token_text(token_id)
            into.tokens.append(token)
            into.text_offset.append(offsets[i] if offsets is not None else offset)
            offset += len(token)
            if position is None:
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            chosen = position.get(token_id)
            into.token_logprobs.append(chosen.logprob if chosen is not None else None)
            into.top_logprobs.append({
                (lp.decoded_token if lp.decoded_token is not None else self._token_text(tid)): lp.logprob
                for tid, lp in position.items()})

    async def _completion_stream(self, req: CompletionRequest, request_id: str, plan, group,
                                 index_of) -> AsyncIterator[str | bytes]:
        created = int(time.time())
        num_generated = 0
        echoed: set[int] = set()
        text_len: dict[int, int] = {}  # choice index -> characters sent so far (logprob text offsets)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        num_prompt = sum(len(ids) for _, ids, _ in plan)
        cached: dict[str, int] = {}  # prompt's request id -> its tokens the prefix cache served
        # Chunks without logprobs, echo or running usage come from byte templates.
        frames = (_StreamFrames(request_id, created, self.model_name, chat=False)
                  if req.logprobs is None and not req.echo and not continuous else None)
        try:
            async for outs in group.batches():
                sse = []  # the frames of every output that has arrived: one write
                for out in outs:
                    i = index_of[out.request_id]
                    cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
                    text, ids, _ = plan[i]
                    for c in out.outputs:  # DELTA: only the choices this step changed, with what it added
                        num_generated += len(c.token_ids)
                        choice_index = i * req.n + c.index
                        if frames is not None:
                            sse.append(frames.chunk(choice_index, c.text, c.finish_reason, c.stop_reason))
                            continue
                        delta = c.text
                        logprobs = None
                        if req.logprobs is not None:
                            logprobs = CompletionLogprobs()
                        prefix = ""
                        if req.echo and choice_index not in echoed:
                            echoed.add(choice_index)
                            prefix = self._echo_text(text, ids)
                            if logprobs is not None:
                                self._add_completion_logprobs(
                                    logprobs, ids, self._top_of_prompt(ids, out.prompt_logprobs, req.logprobs), 0,
                                    self._prompt_offsets(text, ids))
                        start = text_len.get(choice_index, 0) + len(prefix)
                        if logprobs is not None:
                            self._add_completion_logprobs(logprobs, c.token_ids, c.logprobs, start)
                        text_len[choice_index] = start + len(delta)
                        chunk = CompletionStreamResponse(
                            id=request_id, created=created, model=self.model_name,
                            choices=[CompletionChoice(index=choice_index, text=prefix + delta, logprobs=logprobs,
                                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
                        if continuous:
                            chunk.usage = self._usage(num_prompt, num_generated, sum(cached.values()))
                        sse.append(_sse(chunk).encode())
                yield b"".join(sse)  # never empty: every output has a choice
            if include_usage:
                yield _sse(CompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=self._usage(num_prompt, num_generated, sum(cached.values()))))
        except Exception as e:  # the status line went out already: report in-band
            yield _sse_error(e)
        finally:
            group.close()
        yield _DONE

    # --- /v1/chat/completions -----------------------------------------------------------------
    def _chat_plan(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, ChatOutputPlan]:
        """The prompt ids, sampling parameters and output plan (tools, reasoning) of a chat
        request. Runs in a worker thread."""
        if req.top_logprobs is not None and not req.logprobs:
            raise BadRequestError("top_logprobs needs logprobs set to true.", param="top_logprobs")
        plan = plan_chat_output(req, self.limits)
        text = render_chat(self.tokenizer, req.chat_messages(), req.add_generation_prompt, self.limits.chat_template,
                           plan.template_tools, req.chat_template_kwargs, req.continue_final_message)
        keep = self._truncation(req)
        ids, num_tokens = self._encode(text, add_special_tokens=False, keep=keep)
        if keep is not None:
            num_tokens = len(ids)
        self._check_prompt_ids(ids, param="messages", num_tokens=num_tokens)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = req.to_sampling_params(self._fit_max_tokens(req.requested_max_tokens(), len(ids), param),
                                        self.engine.default_sampling)
        plan.apply(params)
        params = self._finish_params(params)
        if params.stop:
            stop_strings(tuple(params.stop))
        return ids, params, plan

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        self.check_model(req.model)
        self.engine.check_accepting()
        self._check_num_messages(req.messages)
        self._check_limits(req, 1)
        self._check_honoured(req)
        data_parallel_rank = self._data_parallel_rank(raw)
        ids, params, plan = await asyncio.to_thread(self._chat_plan, req)
        request_id = self._request_id("chatcmpl", req.request_id)
        group = self.engine.group(_output_kind(req.stream), data_parallel_rank)
        await self._add_to_group(group, [(request_id, None, ids, params, req.priority, plan.spec)])
        if req.stream:
            return _sse_response(self._chat_stream(req, request_id, ids, group, plan))
        try:
            finals = await until_disconnected(raw, _collect(group))
        finally:
            group.close()
        out = finals[request_id]
        choices = [ChatCompletionChoice(index=c.index, message=_chat_message(c, req),
                                        logprobs=self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                                        if req.logprobs else None,
                                        finish_reason=_chat_finish_reason(c.finish_reason, bool(_parsed_calls(c)),
                                                                          plan),
                                        stop_reason=c.stop_reason)
                   for c in out.outputs]
        num_generated = sum(len(c.token_ids) for c in out.outputs)
        extra = {}
        if req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self._prompt_logprobs(ids, out.prompt_logprobs, req.prompt_logprobs)
        return ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=self._usage(len(ids), num_generated, out.num_cached_tokens), **extra)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs] | None,
                       top_n: int) -> ChatLogprobs:
        content = []
        for token_id, position in zip(token_ids, logprobs or []):
            chosen = position.get(token_id)
            token = self._token_text(token_id)
            top = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
            content.append(ChatLogprobToken(
                token=token, logprob=chosen.logprob if chosen is not None else float("-inf"),
                bytes=list(token.encode()),
                top_logprobs=[ChatTopLogprob(token=self._token_text(tid), logprob=lp.logprob,
                                             bytes=list(self._token_text(tid).encode()))
                              for tid, lp in top[:top_n]]))
        return ChatLogprobs(content=content)

    async def _chat_stream(self, req: ChatCompletionRequest, request_id: str, ids: list[int],
                           group, plan: ChatOutputPlan) -> AsyncIterator[str | bytes]:
        created = int(time.time())
        num_generated = 0
        called: set[int] = set()  # choices that have streamed a tool call
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        num_cached = 0  # prompt tokens the prefix cache served
        try:
            # The first chunk of each choice carries the role, as OpenAI's do.
            for i in range(req.n):
                yield _sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name,
                    choices=[ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]))
            # Chunks of plain text (no parser, logprobs or running usage) come from byte templates.
            frames = (_StreamFrames(request_id, created, self.model_name, chat=True)
                      if not req.logprobs and not continuous else None)
            async for outs in group.batches():
                sse = []  # the frames of every output that has arrived: one write
                num_cached = max([num_cached, *(out.num_cached_tokens for out in outs)])
                for c in (c for out in outs for c in out.outputs):  # DELTA: the choices a step changed
                    num_generated += len(c.token_ids)
                    if frames is not None and c.parsed is None:
                        sse.append(frames.chunk(c.index, c.text, c.finish_reason, c.stop_reason))
                        continue
                    logprobs = (self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                                if req.logprobs else None)
                    if _parsed_calls(c):
                        called.add(c.index)
                    delta = _chat_delta(c, req)
                    if (c.parsed is not None and c.finish_reason is None and logprobs is None
                            and delta.content is None and delta.reasoning is None and delta.tool_calls is None):
                        continue  # the parser holds this step's text back (a tag may be starting)
                    chunk = ChatCompletionStreamResponse(
                        id=request_id, created=created, model=self.model_name,
                        choices=[ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                                  finish_reason=_chat_finish_reason(c.finish_reason,
                                                                                    c.index in called, plan),
                                                  stop_reason=c.stop_reason)])
                    if continuous:
                        chunk.usage = self._usage(len(ids), num_generated, num_cached)
                    sse.append(_sse(chunk).encode())
                if sse:
                    yield b"".join(sse)
            if include_usage:
                yield _sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=self._usage(len(ids), num_generated, num_cached)))
        except Exception as e:
            yield _sse_error(e)
        finally:
            group.close()
        yield _DONE


def _parsed_calls(c: CompletionOutput) -> list:
    return c.parsed.tool_calls if c.parsed is not None else []


def _chat_finish_reason(finish_reason: str | None, called: bool, plan: ChatOutputPlan) -> str | None:
    # A turn that ended by calling tools says so (vLLM keeps "stop" for a named tool_choice).
    if finish_reason == "stop" and called and not plan.named:
        return "tool_calls"
    return finish_reason


def _chat_message(c: CompletionOutput, req: ChatCompletionRequest) -> ChatResponseMessage:
    """A whole choice: its text as content, or (parsed) its content, reasoning and tool calls."""
    parsed = c.parsed
    if parsed is None:
        return ChatResponseMessage(content=c.text)
    calls = [ToolCall(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments)) for t in parsed.tool_calls]
    content = parsed.content
    if not content.strip() and (calls or parsed.reasoning):
        content = None  # nothing outside the calls and the reasoning
    return ChatResponseMessage(content=content, reasoning=parsed.reasoning or None if req.include_reasoning else None,
                               tool_calls=calls or None)


def _chat_delta(c: CompletionOutput, req: ChatCompletionRequest) -> DeltaMessage:
    """One step of a streamed choice: its new text, or (parsed) what the step added to the
    content, the reasoning and each tool call."""
    parsed = c.parsed
    if parsed is None:
        return DeltaMessage(content=c.text)
    calls = [DeltaToolCall(index=t.index, id=t.id, type="function" if t.id is not None else None,
                           function=DeltaFunctionCall(name=t.name, arguments=t.arguments))
             for t in parsed.tool_calls]
    return DeltaMessage(content=parsed.content or None,
                        reasoning=parsed.reasoning or None if req.include_reasoning else None,
                        tool_calls=calls or None)


def _output_kind(stream: bool) -> RequestOutputKind:
    # A stream sends each step's new text; a whole response needs only the finished outputs.
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


async def _collect(group) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    async for out in group:
        if out.finished:
            finals[out.request_id] = out
    return finals


def _sse_error(exc: BaseException) -> str:
    _, body = exception_to_body(exc)
    err = body["error"]
    return sse_error_frame(err["message"], err["type"], err["param"], err["code"])


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response that notices a client going away while the stream waits
    for tokens (not only on the next write) and always closes its body iterator, whose `finally`
    aborts the request in the core."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        async def watch_disconnect() -> None:
            await self.listen_for_disconnect(receive)
            task_group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(watch_disconnect)
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client closed the connection mid-write
                task_group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def _sse_response(stream: AsyncIterator[str | bytes]) -> SSEResponse:
    return SSEResponse(stream, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

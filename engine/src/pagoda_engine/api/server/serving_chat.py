"""POST /v1/chat/completions: messages in, the rendered chat template's completion out, whole or
streamed; with tools or a reasoning parser, the output is split into content, reasoning and tool
calls (`chat_tools` plans that split, the core's parser makes it).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request

from pagoda_engine.api.detokenizer import stop_strings
from pagoda_engine.api.outputs import CompletionOutput, PositionLogprobs
from pagoda_engine.api.server.chat_tools import ChatOutputPlan, plan_chat_output
from pagoda_engine.api.server.errors import BadRequestError
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagoda_engine.api.server.serving_engine import OpenAIServing, usage_options
from pagoda_engine.api.server.sse import StreamFrames, sse_frame
from pagoda_engine.api.tokenizer import render_chat
from pagoda_engine.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
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
        self._check_resume(req, ids, params)
        if params.stop:
            stop_strings(tuple(params.stop))
        return ids, params, plan

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request):
        lora = self.check_model(req.model)
        self.engine.check_accepting()
        self._check_num_messages(req.messages)
        self._check_limits(req, 1)
        self._check_honoured(req)
        data_parallel_rank = self._data_parallel_rank(raw)
        ids, params, plan = await asyncio.to_thread(self._chat_plan, req)
        request_id = self._request_id("chatcmpl", req.request_id)
        group = await self._start_group(req.stream, data_parallel_rank,
                                        [(request_id, None, ids, params, req.priority, plan.spec,
                                          req.resume_token_ids)], lora)
        if req.stream:
            return self._stream_response(self._chat_stream(req, request_id, ids, group, plan), group)
        finals = await self._final_outputs(raw, group)
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
        if req.return_token_ids:
            extra["prompt_token_ids"] = ids
            for choice, c in zip(choices, out.outputs):
                choice.token_ids = c.token_ids
        if req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self._prompt_logprobs(ids, out.prompt_logprobs, req.prompt_logprobs)
        if out.kv_transfer_params is not None:
            extra["kv_transfer_params"] = out.kv_transfer_params
        return ChatCompletionResponse(id=request_id, model=self.response_model(req), choices=choices,
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
        """The stream's frames, each batch of outputs in one write; `_stream_response` ends it."""
        created = int(time.time())
        # A continuation's resumed tokens count as generated: usage reports the whole sequence.
        num_generated = len(req.resume_token_ids or ())
        called: set[int] = set()  # choices that have streamed a tool call
        include_usage, continuous = usage_options(req)
        num_cached = 0  # prompt tokens the prefix cache served
        with_ids = req.return_token_ids
        # The first chunk of each choice carries the role, as OpenAI's do.
        for i in range(req.n):
            first = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.response_model(req),
                choices=[ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            if with_ids and i == 0:
                first.prompt_token_ids = ids
            yield sse_frame(first)
        # Chunks of plain text (no parser, logprobs or running usage) come from byte templates.
        frames = (StreamFrames(request_id, created, self.response_model(req), chat=True)
                  if not req.logprobs and not continuous else None)
        async for outs in group.batches():
            sse = []  # the frames of every output that has arrived: one write
            num_cached = max([num_cached, *(out.num_cached_tokens for out in outs)])
            for c in (c for out in outs for c in out.outputs):  # DELTA: the choices a step changed
                num_generated += len(c.token_ids)
                if frames is not None and c.parsed is None:
                    sse.append(frames.chunk(c.index, c.text, c.finish_reason, c.stop_reason,
                                            c.token_ids if with_ids else None))
                    continue
                logprobs = (self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                            if req.logprobs else None)
                if _parsed_calls(c):
                    called.add(c.index)
                delta = _chat_delta(c, req)
                if (c.parsed is not None and c.finish_reason is None and logprobs is None and not with_ids
                        and delta.content is None and delta.reasoning is None and delta.tool_calls is None):
                    continue  # the parser holds this step's text back (a tag may be starting)
                chunk = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.response_model(req),
                    choices=[ChatStreamChoice(index=c.index, delta=delta, logprobs=logprobs,
                                              finish_reason=_chat_finish_reason(c.finish_reason,
                                                                                c.index in called, plan),
                                              stop_reason=c.stop_reason)])
                if with_ids:
                    chunk.choices[0].token_ids = c.token_ids
                if continuous:
                    chunk.usage = self._usage(len(ids), num_generated, num_cached)
                sse.append(sse_frame(chunk).encode())
            if sse:
                yield b"".join(sse)
        if include_usage:
            yield sse_frame(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.response_model(req), choices=[],
                usage=self._usage(len(ids), num_generated, num_cached)))


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

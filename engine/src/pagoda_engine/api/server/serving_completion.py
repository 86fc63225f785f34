"""POST /v1/completions: prompts (text, token ids, or a list of either) in, completions out,
whole or streamed, with echo and logprobs laid out as OpenAI's legacy completions API lays them.

Each prompt of a request is one request in the core (`<id>-p<i>` when there are several), with
`n` sequences; choice `i * n + j` is prompt i's sequence j.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request

from pagoda_engine.api.detokenizer import stop_strings
from pagoda_engine.api.outputs import PositionLogprobs, RequestOutput
from pagoda_engine.api.server.errors import BadRequestError
from pagoda_engine.api.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from pagoda_engine.api.server.serving_engine import OpenAIServing, usage_options
from pagoda_engine.api.server.sse import StreamFrames, sse_frame


class OpenAIServingCompletion(OpenAIServing):
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
            params = self._finish_params(params)
            if req.resume_token_ids is not None:
                if len(prompts) != 1:
                    raise BadRequestError("resume_token_ids continues one prompt's sequence; this request has "
                                          f"{len(prompts)} prompts.", param="resume_token_ids")
                self._check_resume(req, ids, params)
            plan.append((text, ids, params))
        if plan and plan[0][2].stop:
            stop_strings(tuple(plan[0][2].stop))  # built here, off the loop; the detokenizers share it
        return plan

    async def create_completion(self, req: CompletionRequest, raw: Request):
        lora = self.check_model(req.model)
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

        group = await self._start_group(req.stream, data_parallel_rank, [
            (request_id if len(plan) == 1 else f"{request_id}-p{i}", text, ids, params, req.priority, None,
             req.resume_token_ids)
            for i, (text, ids, params) in enumerate(plan)], lora)
        index_of = {s.request_id: i for i, s in enumerate(group.streams)}
        if req.stream:
            return self._stream_response(self._completion_stream(req, request_id, plan, group, index_of), group)
        finals = await self._final_outputs(raw, group)
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
                if req.return_token_ids:
                    extra.update(prompt_token_ids=ids, token_ids=c.token_ids)
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text, logprobs=logprobs,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason, **extra))
        num_prompt = sum(len(ids) for _, ids, _ in plan)
        transfer = next((out.kv_transfer_params for out in finals.values() if out.kv_transfer_params), None)
        return CompletionResponse(id=request_id, model=self.response_model(req), choices=choices,
                                  usage=self._usage(num_prompt, num_generated,
                                                    sum(out.num_cached_tokens for out in finals.values())),
                                  **({"kv_transfer_params": transfer} if transfer else {}))

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
        """The stream's frames, each batch of outputs in one write; `_stream_response` ends it."""
        created = int(time.time())
        # A continuation's resumed tokens count as generated: usage reports the whole sequence.
        num_generated = len(req.resume_token_ids or ())
        with_ids = req.return_token_ids
        echoed: set[int] = set()
        ids_sent: set[int] = set()  # choices whose prompt_token_ids went out (return_token_ids)
        text_len: dict[int, int] = {}  # choice index -> characters sent so far (logprob text offsets)
        include_usage, continuous = usage_options(req)
        num_prompt = sum(len(ids) for _, ids, _ in plan)
        cached: dict[str, int] = {}  # prompt's request id -> its tokens the prefix cache served
        # Chunks without logprobs, echo or running usage come from byte templates.
        frames = (StreamFrames(request_id, created, self.response_model(req), chat=False)
                  if req.logprobs is None and not req.echo and not continuous else None)
        async for outs in group.batches():
            sse = []  # the frames of every output that has arrived: one write
            for out in outs:
                i = index_of[out.request_id]
                cached[out.request_id] = max(cached.get(out.request_id, 0), out.num_cached_tokens)
                text, ids, _ = plan[i]
                for c in out.outputs:  # DELTA: only the choices this step changed, with what it added
                    num_generated += len(c.token_ids)
                    choice_index = i * req.n + c.index
                    # (A choice's first chunk with token ids also carries the prompt's: the model writes it.)
                    if frames is not None and (not with_ids or choice_index in ids_sent):
                        sse.append(frames.chunk(choice_index, c.text, c.finish_reason, c.stop_reason,
                                                c.token_ids if with_ids else None))
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
                        id=request_id, created=created, model=self.response_model(req),
                        choices=[CompletionChoice(index=choice_index, text=prefix + delta, logprobs=logprobs,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
                    if with_ids:
                        chunk.choices[0].token_ids = c.token_ids
                        if choice_index not in ids_sent:
                            ids_sent.add(choice_index)
                            chunk.choices[0].prompt_token_ids = ids
                    if continuous:
                        chunk.usage = self._usage(num_prompt, num_generated, sum(cached.values()))
                    sse.append(sse_frame(chunk).encode())
            yield b"".join(sse)  # never empty: every output has a choice
        if include_usage:
            yield sse_frame(CompletionStreamResponse(
                id=request_id, created=created, model=self.response_model(req), choices=[],
                usage=self._usage(num_prompt, num_generated, sum(cached.values()))))

"""The offline API, shaped like vLLM's so scripts can switch:

    from pagoda_engine import LLM, SamplingParams
    llm = LLM(model="path/to/model")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))

It runs the same `EngineCore` and `OutputProcessor` as the server, in-process (no ZMQ). Results
are whole (cumulative) outputs, built once when each request finishes (`RequestOutputKind.FINAL_ONLY`).

Profiling, as vLLM's: `LLM(..., profiler_config={"profiler": "torch", "torch_profiler_dir": DIR})`,
then `llm.start_profile()`, some `generate` calls, `llm.stop_profile()` (the files written).
Speculative decoding, as vLLM's: `LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 4})`.
LoRA adapters, as vLLM's: `LLM(..., enable_lora=True, max_loras=4, max_lora_rank=16)`, then
`llm.generate(prompts, params, lora_request=LoRARequest("name", 1, "path/to/adapter"))`, one for
every prompt or a list with one per prompt (None: the base model).
"""

from __future__ import annotations

import itertools
from typing import Sequence, Union

from pagoda_engine.api.inputs import check_prompt
from pagoda_engine.api.output_processor import OutputProcessor
from pagoda_engine.api.outputs import RequestOutput, RequestOutputKind
from pagoda_engine.api.tokenizer import apply_chat_template, encode_prompt, load_tokenizer
from pagoda_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagoda_engine.core.engine_core import EngineCore
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.generation_config import default_sampling_params
from pagoda_engine.lora import LoRARequest
from pagoda_engine.profiler import profile_tag
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.structured_outputs import check as check_structured_outputs

PromptType = Union[str, list[int]]


class LLM:
    # The keywords vLLM's LLM names, with the engine's defaults (the config dataclasses' own); any
    # other engine option goes through `engine_kwargs`. EngineConfig.from_kwargs checks them all.
    def __init__(self, model: str | None = ModelConfig.model, *, tokenizer: str | None = None,
                 dtype: str = ModelConfig.dtype, max_model_len: int | None = ModelConfig.max_model_len,
                 block_size: int = CacheConfig.block_size, enable_prefix_caching: bool = CacheConfig.enable_prefix_caching,
                 max_num_seqs: int | None = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 num_kv_pages: int | None = CacheConfig.num_kv_pages, seed: int = ModelConfig.seed,
                 load_format: str = ModelConfig.load_format, **engine_kwargs):
        config = EngineConfig.from_kwargs(
            model=model, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
            enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, num_kv_pages=num_kv_pages, seed=seed,
            load_format=load_format, **engine_kwargs)
        if config.parallel.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size {config.parallel.data_parallel_size}: the offline LLM runs one "
                             f"engine core in this process; data-parallel engine cores are served by "
                             f"`pagoda serve --data-parallel-size {config.parallel.data_parallel_size}`")
        if config.scheduler.step_launch_pacing:
            raise ValueError("step_launch_pacing times a server's steps to the requests arriving on its socket "
                             "(`pagoda serve --step-launch-pacing`); the offline LLM is handed its requests up front")
        config.scheduler.step_launch_pacing = False  # not None, which `resolve_for_device` turns on on a GPU
        self.core = EngineCore(config)
        try:
            self.default_sampling = default_sampling_params(self.core.model_dir, config.model.generation_config,
                                                            config.model.override_generation_config)
        except ValueError:
            self.core.close()
            raise
        self.tokenizer = load_tokenizer(tokenizer or self.core.model_dir)
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no SamplingParams: the model's recommended
        settings from its generation_config.json (`generation_config` keyword: auto, vllm or a
        directory; `override_generation_config`), else SamplingParams()'s, as vLLM's LLM does."""
        return SamplingParams(**self.default_sampling)

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes, if any. Idempotent."""
        self.core.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start_profile(self) -> None:
        """Start torch.profiler on every rank (ProfilerStateError without a profiler_config)."""
        self.core.start_profile(profile_tag())

    def stop_profile(self) -> list[str]:
        """Stop it; the trace and summary paths every rank wrote."""
        return self.core.stop_profile()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); results in input order.
        `lora_request`: the adapter of every prompt, or a list of one per prompt (None: the base).

        An invalid prompt raises InvalidRequestError before anything is queued."""
        prompt_list = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = ([sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(prompt_list):
            raise InvalidRequestError(f"got {len(prompt_list)} prompts but {len(params_list)} sampling params",
                                      param="sampling_params")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise InvalidRequestError(f"got {len(prompt_list)} prompts but {len(loras)} LoRA requests",
                                          param="lora_request")
        for lora in loras:
            if lora is not None and not isinstance(lora, LoRARequest):
                raise InvalidRequestError(f"lora_request must be a LoRARequest or None, got {type(lora).__name__}",
                                          param="lora_request")

        encoded = []
        for prompt, params in zip(prompt_list, params_list):  # every request is checked before any is queued
            text, ids = (prompt, encode_prompt(self.tokenizer, prompt)) if isinstance(prompt, str) else (None, prompt)
            check_prompt(ids, vocab_size=self.core.vocab_size, max_model_len=self.core.max_model_len)
            if params.structured_outputs is not None:
                check_structured_outputs(params.structured_outputs)  # a grammar that cannot compile
            encoded.append((text, ids))
        for lora in {lora for lora in loras if lora is not None}:
            self.core.check_lora(lora)  # a bad adapter is refused before anything is queued
        request_ids = []
        for (text, ids), params, prio, lora in zip(encoded, params_list, priorities, loras):
            request_id = str(next(self._ids))
            for core_req in self.processor.add_request(request_id, text, ids, params, priority=prio,
                                                       output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora):
                self.core.add_request(core_req)
            request_ids.append(request_id)
        return self._run(request_ids)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             add_generation_prompt: bool = True, chat_template: str | None = None, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate.
        `tools` and `chat_template_kwargs` reach the template as vLLM's `LLM.chat` passes them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [apply_chat_template(self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
                                       chat_template=chat_template, tools=tools,
                                       chat_template_kwargs=chat_template_kwargs,
                                       continue_final_message=continue_final_message) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        while pending:
            step = self.core.step()
            for refused in self.core.take_refused():
                raise InvalidRequestError(refused.message, param=refused.param)
            processed = self.processor.process_outputs(step.outputs)
            if processed.abort_child_ids:
                self.core.abort_requests(processed.abort_child_ids)
            for out in processed.request_outputs:
                if out.finished and out.request_id in pending:
                    finished[out.request_id] = out
                    pending.discard(out.request_id)
            if pending and not self.core.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with requests unfinished: {sorted(pending)}")
        self.core.wait_for_offload()  # so that the next call finds every page this one wrote down
        return [finished[rid] for rid in request_ids]


def _normalize_prompts(prompts) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of either",
                                  param="prompt")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    for p in prompts:
        ok = isinstance(p, str) or (isinstance(p, (list, tuple)) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in p))
        if not ok:
            raise InvalidRequestError(f"invalid prompt {p!r}: expected a string or a list of token ids",
                                      param="prompt")
    return [p if isinstance(p, str) else list(p) for p in prompts]

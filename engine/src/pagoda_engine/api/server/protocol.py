"""The OpenAI-compatible wire format: pydantic models of every request body Pagoda accepts and
every response body it returns (completions, chat, streaming chunks, models, tokenize).

Request models are strict (no string-to-number coercion, no NaN/inf, bools are not ints) and
bounded, so a malformed body is a 400 here and never reaches the engine. Field names and defaults
follow OpenAI's API plus vLLM's extra sampling fields. Range checks that belong to sampling
itself live in `pagoda_engine.sampling_params.SamplingParams` (one owner); the bounds here are the ones
that keep the numbers finite and the work per request bounded.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.sampling_params import SamplingParams, StructuredOutputsParams

# A request's fan-out and sampling magnitudes are bounded so that no body can make the core's
# numbers non-finite (a tiny repetition penalty or temperature overflows fp32 logits) or its
# work unbounded.
MAX_N = 128
MAX_LOGPROBS = 20
_INT64 = 2**63 - 1

# Token ids: non-negative and within int32 (the vocabulary check against the model happens in the
# server, which knows the vocabulary size).
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def _prompt_kind(value: Any) -> str | None:
    # Which form of the prompt union a value is, from its first element: validating it against
    # one form only keeps a long token-id list linear (a plain union tries every form in full).
    if isinstance(value, str):
        return "one-text"
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return "text-list"
        if isinstance(first, list):
            return "token-id-lists"
    return "token-ids" if isinstance(value, list) else None


Prompt = Annotated[
    Annotated[str, Tag("one-text")] | Annotated[list[str], Tag("text-list")] | Annotated[list[TokenId], Tag("token-ids")]
    | Annotated[list[list[TokenId]], Tag("token-id-lists")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="prompt must be a string, a list of strings, a list of token ids "
                                       "or a list of token-id lists"),
]


class _StrictModel(BaseModel):
    # Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields still work.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaResponseFormat(_StrictModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    # The grammar enforces the whole schema whether or not strict is set.
    strict: bool | None = None


class ResponseFormat(_StrictModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON following `json_schema.schema`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputs(_StrictModel):
    """vLLM's `structured_outputs` request field (`SamplingParams.structured_outputs`): exactly one
    of `json` (a JSON schema), `regex`, `choice`, `grammar` (Lark, or GBNF), `json_object`."""

    # Unknown keys are refused (vLLM's structural_tag, whitespace_pattern, ... are not implemented).
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace)


# The legacy `guided_*` fields (vLLM before 0.12) and the `structured_outputs` kind each stands for.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# The one grammar engine Pagoda has, under the names vLLM's `guided_decoding_backend` used for it.
_OUR_BACKENDS = ("auto", "guidance", "llguidance")


class _SamplingRequest(_StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None = the served model
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=1e4)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1 << 31)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, ge=1e-2, le=100)
    stop: str | list[str] | None = None
    # Token id (as a string, OpenAI's form) -> bias added to its logit; bounded by --max-logit-bias-entries.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # Structured outputs: at most one of response_format (not text), structured_outputs, guided_*.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only Pagoda's own (auto, guidance, llguidance)
    guided_whitespace_pattern: str | None = None  # refused: JSON is compact (disable_any_whitespace)
    stop_token_ids: list[TokenId] | None = None
    # vLLM's: each prompt token's logprob and the top-N at its position, in the response's
    # `prompt_logprobs` (not with stream=True, as in vLLM).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep only the prompt's last N tokens (-1: as many as leave room for one output token).
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=1 << 31)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=1 << 31)
    skip_special_tokens: bool = True
    seed: int | None = Field(None, ge=-_INT64, le=_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and unused (README, "Request fields"): OpenAI's bookkeeping fields, which change
    # nothing about the output.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    priority: int = Field(0, ge=-_INT64, le=_INT64)
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's: the response carries token ids beside the text (streamed: each chunk's choice its
    # new `token_ids`; the first chunk the prompt's `prompt_token_ids`).
    return_token_ids: bool = False
    # Pagoda's continuation of a stream that broke elsewhere (`pagoda route` sends it): the output
    # token ids already streamed. The engine re-renders the same prompt, takes these as the
    # start of the output (counted against max_tokens, min_tokens and in `usage`, replayed
    # through stop strings and parsers) and streams only what follows. stream=True and n=1 only.
    resume_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=1 << 20)
    # vLLM's disaggregated prefill/decode fields (`kv_transfer.py`): {"do_remote_decode": true} to a
    # prefill engine; the params its response returned to a decode engine.
    kv_transfer_params: dict[str, Any] | None = None

    def _sampling_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """SamplingParams keywords: the request's values, and `defaults` (the model's, from its
        generation config) for the sampling fields it leaves unset."""
        kw: dict[str, Any] = dict(
            kv_transfer_params=self.kv_transfer_params,
            n=self.n,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            seed=self.seed,
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=self._logit_bias(),
            structured_outputs=self.structured_outputs_params(),
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kw[name] = value
        return kw

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token_id): bias for token_id, bias in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)",
                                      param="logit_bias") from None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint this request asks for, from whichever field it used; an
        InvalidRequestError when it uses several, or a legacy option Pagoda cannot honour."""
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in _OUR_BACKENDS:
            raise InvalidRequestError(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available: Pagoda's grammar "
                f"engine is llguidance ({', '.join(_OUR_BACKENDS)})", param="guided_decoding_backend")
        if self.guided_whitespace_pattern is not None:
            raise InvalidRequestError("guided_whitespace_pattern is not supported: JSON is emitted compact, "
                                      "without free whitespace", param="guided_whitespace_pattern")
        asked = self._constraint_fields()
        if len(asked) > 1:
            raise InvalidRequestError(f"give at most one output constraint; got {', '.join(asked)}", param=asked[0])
        if not asked:
            return None
        if asked[0] == "response_format":
            return self._response_format_params()
        if asked[0] == "structured_outputs":
            return self.structured_outputs.to_params()
        return StructuredOutputsParams(**{_GUIDED[asked[0]]: getattr(self, asked[0])})

    def _constraint_fields(self) -> list[str]:
        """The fields of this request that ask for an output constraint."""
        asked = [name for name in ("response_format", "structured_outputs", *_GUIDED) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            asked.remove("response_format")  # free text: no constraint
        return asked

    def as_sent(self, error: InvalidRequestError) -> InvalidRequestError:
        """`error` naming the field the client sent. The engine checks every constraint as
        `structured_outputs.<kind>`, whichever field carried it: a schema sent as
        `response_format.json_schema.schema` or `guided_json` is reported under that name."""
        asked = self._constraint_fields()
        param = error.param or ""
        if len(asked) != 1 or asked[0] == "structured_outputs" or not param.startswith("structured_outputs"):
            return error
        if asked[0] == "response_format":
            sent = "response_format.json_schema.schema" if self.response_format.type == "json_schema" \
                else "response_format"
        else:
            sent = asked[0]
        return InvalidRequestError(error.message.replace(param, sent), param=sent)

    def _response_format_params(self) -> StructuredOutputsParams:
        fmt = self.response_format
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError("response_format of type json_schema needs json_schema.schema",
                                      param="response_format.json_schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=1 << 31)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None  # accepted for compatibility; a non-empty suffix is refused
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any]) -> SamplingParams:
        """`max_tokens` is the value after the server fitted it to the context window."""
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **self._sampling_kwargs(defaults))


class ChatContentPartText(_StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(_StrictModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ChatMessageToolCall(_StrictModel):
    """A call an earlier assistant turn made (`messages[].tool_calls`)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPartText] | None = None
    name: str | None = None
    tool_calls: list[ChatMessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: which call this answers
    # An assistant turn's reasoning (vLLM's current name, and the older one it still accepts).
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_StrictModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted; required and named calls are always enforced


class ChatCompletionTool(_StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_StrictModel):
    name: str


class NamedToolChoice(_StrictModel):
    """`tool_choice` naming the function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=1 << 31)
    max_completion_tokens: int | None = Field(None, ge=1, le=1 << 31)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # vLLM's: the last message (the assistant's start) is left open and the model continues it.
    continue_final_message: bool = False
    tools: list[ChatCompletionTool] | None = Field(None, min_length=1)
    # None: "auto" when tools are given, else "none" (OpenAI's and vLLM's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    include_reasoning: bool = True  # with --reasoning-parser: False drops the `reasoning` field

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's current name; max_tokens the deprecated one.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def to_sampling_params(self, max_tokens: int | None, defaults: dict[str, Any]) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, logprobs=self.num_logprobs(), **self._sampling_kwargs(defaults))

    def chat_messages(self) -> list[dict[str, Any]]:
        return chat_message_dicts(self.messages)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return template_tools(self.tools)


def template_tools(tools: list[ChatCompletionTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates expect them (transformers' `apply_chat_template(tools=...)`)."""
    if tools is None:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


def chat_message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the tokenizer's chat template expects them. `developer` is OpenAI's newer name
    for `system`; templates know only the latter. A tool call's arguments, JSON text on the wire,
    become the object templates expect (as vLLM does); an assistant turn's reasoning is given
    under both names templates read (`reasoning_content`, Qwen3's, and `reasoning`)."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments_object(
                    c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
        reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
        if reasoning is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def _arguments_object(arguments: str, param: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError as e:
        raise InvalidRequestError(f"{param} must be JSON text: {e}", param=param) from None


class TokenizeRequest(_StrictModel):
    """Either `prompt` (completion style) or `messages` (chat style, through the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ChatCompletionTool] | None = Field(None, min_length=1)  # shown to the chat template
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_StrictModel):
    model: str | None = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def _now() -> int:
    return int(time.time())


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


# A streamed chunk has the response's shape: the choices that changed, usage only at the end.
CompletionStreamResponse = CompletionResponse


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCall] | None = None


class _ChatChoiceBase(_Response):
    index: int
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChoice(_ChatChoiceBase):
    message: ChatResponseMessage


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """A piece of tool call `index`: the first has `id`, `type` and `function.name`, the others
    add to `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatCompletionStreamResponse(ChatCompletionResponse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice] = Field(default_factory=list)
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(_StrictModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_StrictModel):
    """POST /v1/unload_lora_adapter (vLLM's body; `lora_int_id` is accepted and, as in vLLM, not needed)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


def streamed_or(response_model: type[BaseModel]) -> dict:
    """The OpenAPI description of a 200 that is `response_model` as JSON, or with `stream: true`
    a `text/event-stream` of its chunks (each event's `data`: a chunk as JSON, or `[DONE]`)."""
    event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    return {"model": response_model, "content": {"text/event-stream": {"schema": event}}}

"""What a chat request's `tools`, `tool_choice`, `parallel_tool_calls` and reasoning settings mean
for its prompt, its decoding and the parsing of its output (vLLM's rules):

- `tool_choice` defaults to "auto" when tools are given, else "none";
- "none": the tools still reach the chat template (unless --exclude-tools-when-tool-choice-none),
  and no tool calls are parsed;
- "auto": the model decides; its output is parsed with --tool-call-parser, which
  --enable-auto-tool-choice must allow (else a 400, in vLLM's words);
- "required" and a named function are enforced with structured outputs (the JSON schemas of vLLM's
  `get_json_schema_from_tools`), so the output always parses into tool calls, whatever the
  model and its own format;
- `parallel_tool_calls: false` caps "required" at one call (the schema's `maxItems`); under
  "auto" only the first call the model writes is returned.

Runs in the request's worker thread (`OpenAIServingChat._chat_plan`): building a schema is O(tools).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagoda_engine.api.chat_output import ChatOutputSpec
from pagoda_engine.api.server.errors import BadRequestError
from pagoda_engine.api.server.protocol import ChatCompletionRequest, NamedToolChoice
from pagoda_engine.api.tool_parsers import TOOL_PARSERS
from pagoda_engine.config import ServerConfig
from pagoda_engine.sampling_params import SamplingParams, StructuredOutputsParams

# vLLM's sentence first, word for word (clients match on it), then how to act on it.
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set: start '
                    'the server with --enable-auto-tool-choice --tool-call-parser PARSER, PARSER the format the model '
                    f'writes tool calls in ({" | ".join(TOOL_PARSERS)}), or send tool_choice "none" or "required"')


@dataclass
class ChatOutputPlan:
    template_tools: list[dict[str, Any]] | None  # what the chat template gets as `tools`
    spec: ChatOutputSpec | None  # how the output is parsed (None: plain content)
    tool_schema: dict[str, Any] | None = None  # forced tool choice: the schema decoding follows
    keep_special_tokens: bool = False  # tool formats written with special tokens ([TOOL_CALLS], ...)
    named: bool = False  # a named function: finish_reason stays "stop", as in vLLM

    def apply(self, params: SamplingParams) -> None:
        if self.tool_schema is not None:
            params.structured_outputs = StructuredOutputsParams(json=self.tool_schema)
        if self.keep_special_tokens:
            params.skip_special_tokens = False


def plan_chat_output(req: ChatCompletionRequest, server: ServerConfig) -> ChatOutputPlan:
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
    if req.tools is None and choice != "none":
        raise BadRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    reasoning = server.reasoning_parser
    if reasoning == "qwen3" and (req.chat_template_kwargs or {}).get("enable_thinking") is False:
        reasoning = None  # the template closed the thinking block already: all output is content
    tools = req.tool_dicts()
    constrained = req.structured_outputs_params() is not None
    if choice == "none":
        template_tools = None if server.exclude_tools_when_tool_choice_none else tools
        return ChatOutputPlan(template_tools, ChatOutputSpec(reasoning, constrained=constrained) if reasoning else None)
    if choice == "auto":
        if not server.enable_auto_tool_choice or server.tool_call_parser is None:
            raise BadRequestError(AUTO_NEEDS_FLAGS, param="tool_choice")
        parameters = {t.function.name: _parameters(t.function.parameters) for t in req.tools or ()}
        return ChatOutputPlan(tools, ChatOutputSpec(reasoning, tool_parser=server.tool_call_parser,
                                                    single_call=not req.parallel_tool_calls, constrained=constrained,
                                                    tool_parameters=parameters),
                              keep_special_tokens=True)
    if constrained:
        raise BadRequestError("A named or required tool_choice is enforced with structured outputs: it cannot be "
                              "combined with response_format, structured_outputs or guided_*.", param="tool_choice")
    if choice == "required":
        return ChatOutputPlan(tools, ChatOutputSpec(reasoning, required=True),
                              tool_schema=required_tools_schema(req, single=not req.parallel_tool_calls))
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    tool = next((t for t in req.tools if t.function.name == name), None)
    if tool is None:
        raise BadRequestError(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
    return ChatOutputPlan(tools, ChatOutputSpec(reasoning, named_function=name),
                          tool_schema=_parameters(tool.function.parameters), named=True)


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema if schema is not None else {"type": "object", "properties": {}}


def required_tools_schema(req: ChatCompletionRequest, single: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a non-empty array of {name, parameters} objects,
    each name one of the tools' with that tool's parameters (their `$defs` merged at the top, where
    their `#/$defs/...` references point)."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in req.tools:
        parameters = dict(_parameters(tool.function.parameters))
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if key in defs and defs[key] != value:
                raise BadRequestError(f"Tool definition '{key}' has multiple schemas, which is not supported.",
                                      param="tools")
            defs[key] = value
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema

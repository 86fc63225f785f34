"""A chat sequence's output text split into content, reasoning and tool calls.

`ChatOutputSpec` is what the server decided for one request (which reasoning parser, which tool
format, or which forced tool choice); the output processor makes one `ChatOutputParser` per
sequence from it and feeds it each detokenized piece, next to the detokenizer, so parsing costs
O(new text) per step like detokenization. Reasoning is split off first; tool calls are parsed
from the content that remains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda_engine.api.reasoning_parsers import ThinkParser, make_reasoning_parser
from pagoda_engine.api.tool_parsers import (
    TOOL_PARSERS,
    NamedFunctionParser,
    RequiredToolCallsParser,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
)


@dataclass
class ParsedDelta:
    """What a piece of output became. Under a stream, one step's; otherwise everything so far."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def merge_parsed(parts: list[ParsedDelta]) -> ParsedDelta:
    """Pieces joined in order: one delta per tool call (its id and name from its first piece)."""
    if len(parts) == 1 and len(parts[0].tool_calls) <= 1:
        return parts[0]
    calls: dict[int, ToolCallDelta] = {}
    arguments: dict[int, list[str]] = {}
    for part in parts:
        for call in part.tool_calls:
            if call.index not in calls:
                calls[call.index] = ToolCallDelta(call.index, call.id, call.name)
                arguments[call.index] = []
            arguments[call.index].append(call.arguments)
    for index, call in calls.items():
        call.arguments = "".join(arguments[index])
    return ParsedDelta("".join(p.content for p in parts), "".join(p.reasoning for p in parts),
                       list(calls.values()))


@dataclass(frozen=True)
class ChatOutputSpec:
    """How one chat request's output is parsed (any combination may be off)."""

    reasoning_parser: str | None = None  # --reasoning-parser, unless the request turned thinking off
    tool_parser: str | None = None  # --tool-call-parser, when tool_choice is auto
    named_function: str | None = None  # tool_choice named this function: the output is its arguments
    required: bool = False  # tool_choice required: the output is a JSON array of calls
    single_call: bool = False  # parallel_tool_calls false: calls after the first are dropped
    constrained: bool = False  # structured outputs shape the output from its first token
    # The request's tools' parameters schemas by function name, for parsers that type values by them.
    tool_parameters: dict | None = field(default=None, hash=False, compare=False)

    @property
    def forced(self) -> bool:
        return self.named_function is not None or self.required

    def parser(self, incremental: bool) -> "ChatOutputParser":
        tools: ToolParser | None = None
        if self.named_function is not None:
            tools = NamedFunctionParser(incremental, self.named_function)
        elif self.required:
            tools = RequiredToolCallsParser(incremental)
        elif self.tool_parser is not None:
            cls = TOOL_PARSERS[self.tool_parser]
            tools = cls(incremental, tools=self.tool_parameters) if cls.uses_tool_schemas else cls(incremental)
        # Forced calls are constrained from the first token: there is no reasoning to split off.
        reasoning = (make_reasoning_parser(self.reasoning_parser, self.constrained)
                     if self.reasoning_parser and not self.forced else None)
        return ChatOutputParser(reasoning, tools, max_calls=1 if self.single_call else None)


class ChatOutputParser:
    def __init__(self, reasoning: ThinkParser | None, tools: ToolParser | None, max_calls: int | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls

    @property
    def num_tool_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str) -> ParsedDelta:
        return self._split(text, final=False)

    def finish(self) -> ParsedDelta:
        return self._split("", final=True)

    def _split(self, text: str, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        content = text
        if self.reasoning is not None:
            step = self.reasoning.finish() if final else self.reasoning.feed(text)
            out.reasoning, content = step.reasoning, step.content
        if self.tools is None:
            out.content = content
            return out
        found = self.tools.feed(content) if content else ToolDelta()
        if final:
            found.add(self.tools.finish())
        out.content, out.tool_calls = found.content, found.tool_calls
        if self.max_calls is not None:
            out.tool_calls = [c for c in out.tool_calls if c.index < self.max_calls]
        return out

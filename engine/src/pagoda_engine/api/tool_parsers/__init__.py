"""Tool-call parsers: the model's text → OpenAI `tool_calls` (vLLM's `--tool-call-parser` names).

`TOOL_PARSERS` maps each name to its format's parser (the names `--tool-call-parser` takes are
`config.TOOL_CALL_PARSER_NAMES`, where the flag's contract reads them; a test keeps the two
equal); `forced.py` parses what structured outputs forced for `tool_choice` `required` or a
named function, whatever the format. Every parser is fed a sequence's text piece by piece where the output processor detokenizes it (`base.py` says
how each piece stays O(its length) and what happens to malformed calls)."""

from __future__ import annotations

from pagoda_engine.api.tool_parsers.base import ToolCallDelta, ToolDelta, ToolParser
from pagoda_engine.api.tool_parsers.forced import NamedFunctionParser, RequiredToolCallsParser
from pagoda_engine.api.tool_parsers.hermes import HermesToolParser
from pagoda_engine.api.tool_parsers.llama3_json import Llama3JsonToolParser
from pagoda_engine.api.tool_parsers.mistral import MistralToolParser
from pagoda_engine.api.tool_parsers.pythonic import PythonicToolParser
from pagoda_engine.api.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}

__all__ = ["TOOL_PARSERS", "NamedFunctionParser", "RequiredToolCallsParser", "ToolCallDelta", "ToolDelta",
           "ToolParser"]

"""Qwen3-Coder tool calls (vLLM's `qwen3_coder` parser): XML-shaped, one parameter per element,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

with content text around the calls. A parameter's value is text (one newline after its opening
tag and one before its closing tag are the template's, not the value's); it becomes a JSON value
by the type the request's tool schema gives it, as vLLM converts it: strings stay text, integers
and numbers are parsed, booleans are `true`/`false`, objects and arrays are JSON (or a Python
literal), "null" is null where the type is not string; a value that does not convert, or a
parameter the schema does not name, stays text.

Streamed, a call's header goes out when its `<function=NAME>` is complete, then its arguments
object a parameter at a time as each closes (`{`, `"name": value`, ..., `}`). Whole, a call goes
out at its `</tool_call>`. A `<tool_call>` that does not hold a `<function=...>` element, or a call
cut off before its header went out, is content text as written; one cut off after it (streamed)
is closed with the parameters that completed.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagoda_engine.api.tool_parsers.base import TagSplitter, ToolCallDelta, ToolDelta, ToolParser

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_MAX_NAME_CHARS = 256  # a function or parameter name longer than this is not one
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema types it (see the module docstring)."""
    if not isinstance(schema, dict):
        return text
    kind, nullable = "string", False
    if "type" in schema:
        kind = str(schema["type"]).strip().lower()
        nullable = kind == "null"
    elif "anyOf" in schema:
        kinds = [str(o["type"]).strip().lower() for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
        nullable = "null" in kinds
        kind = next((k for k in kinds if k != "null"), "string")
    if text.lower() in ("null", "none") and (nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES:
        return text
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(text)
        except ValueError:
            pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


class Qwen3CoderToolParser(ToolParser):
    uses_tool_schemas = True

    def __init__(self, incremental: bool, tools: dict[str, dict] | None = None):
        """`tools`: each function's parameters schema (JSON Schema of an object), by name."""
        super().__init__(incremental)
        self.tools = tools or {}
        self._tags = TagSplitter()
        self._state = "content"  # content | call | function | name | value
        self._name_of = ""  # "function" or "parameter": whose name is being read
        self._buffer: list[str] = []  # the name being read, or the parameter value
        self._raw: list[str] = []  # the call's text as written, while it may still turn out to be content
        self._function: str | None = None
        self._parameter: str | None = None
        self._arguments: dict[str, Any] = {}
        self._call: ToolCallDelta | None = None  # header sent (streamed)
        self._calls: list[tuple[str, dict]] = []  # complete calls of this <tool_call>, not yet sent (whole)

    # --- the parser interface -------------------------------------------------------------
    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        while text:
            text = getattr(self, f"_in_{self._state}")(text, out)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._state == "content":
            out.content += self._tags.release()
        elif self._call is not None:  # streamed: close what was sent with the parameters that completed
            out.tool_calls.append(ToolCallDelta(self._call.index, arguments="}" if self._arguments else "{}"))
            self.after_call = True
        else:
            self._flush_calls(out)
            out.content += "".join(self._raw) + self._tags.release()
        self._reset()
        return out

    # --- states ---------------------------------------------------------------------------
    def _in_content(self, text: str, out: ToolDelta) -> str:
        before, after, found = self._tags.split(self.strip_after_call(text), CALL_START)
        out.content += before
        if found:
            self._state, self._raw = "call", [CALL_START]
        return after

    def _in_call(self, text: str, out: ToolDelta) -> str:
        """Inside <tool_call>, between functions: the next <function= or </tool_call>."""
        return self._expect(text, out, {FUNCTION: self._open_function, CALL_END: self._close_call})

    def _in_function(self, text: str, out: ToolDelta) -> str:
        """Inside <function=...>, between parameters: the next <parameter= or </function>."""
        return self._expect(text, out, {PARAMETER: self._open_parameter, FUNCTION_END: self._close_function})

    def _in_name(self, text: str, out: ToolDelta) -> str:
        end = text.find(">")
        piece = text if end < 0 else text[:end]
        self._buffer.append(piece)
        self._raw.append(piece if end < 0 else text[:end + 1])
        if sum(map(len, self._buffer)) > _MAX_NAME_CHARS:
            return self._not_a_call(out)
        if end < 0:
            return ""
        name, self._buffer = "".join(self._buffer).strip(), []
        if self._name_of == "function":
            self._function, self._arguments, self._state = name, {}, "function"
            if self.incremental and not self._calls:
                self._call = self.new_call(name)
                out.tool_calls.append(self._call)
        else:
            self._parameter, self._state = name, "value"
        return text[end + 1:]

    def _in_value(self, text: str, out: ToolDelta) -> str:
        before, after, found = self._tags.split(text, PARAMETER_END)
        self._buffer.append(before)
        self._raw.append(before + (PARAMETER_END if found else ""))
        if not found:
            return ""
        value = "".join(self._buffer)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        schema = (self.tools.get(self._function) or {}).get("properties", {}).get(self._parameter)
        converted = convert_value(value, schema)
        if self._call is not None:
            separator = ", " if self._arguments else "{"
            piece = f"{separator}{json.dumps(self._parameter, ensure_ascii=False)}: {json.dumps(converted, ensure_ascii=False)}"
            out.tool_calls.append(ToolCallDelta(self._call.index, arguments=piece))
        self._arguments[self._parameter] = converted
        self._buffer, self._state = [], "function"
        return after

    # --- transitions ----------------------------------------------------------------------
    def _expect(self, text: str, out: ToolDelta, tags: dict) -> str:
        """Whitespace, then one of `tags` (its handler runs); a tag's beginning is held back;
        anything else means this <tool_call> is not a call."""
        text = self._tags.release() + text
        stripped = text.lstrip()
        self._raw.append(text[:len(text) - len(stripped)])
        for tag, handler in tags.items():
            if stripped.startswith(tag):
                self._raw.append(tag)
                return handler(stripped[len(tag):], out)
        if stripped and any(tag.startswith(stripped) for tag in tags):
            self._tags.held = stripped  # may still become a tag
            return ""
        return self._not_a_call(out, stripped) if stripped else ""

    def _open_function(self, text: str, out: ToolDelta) -> str:
        self._state, self._name_of = "name", "function"
        return text

    def _open_parameter(self, text: str, out: ToolDelta) -> str:
        self._state, self._name_of = "name", "parameter"
        return text

    def _close_function(self, text: str, out: ToolDelta) -> str:
        if self._call is not None:
            out.tool_calls.append(ToolCallDelta(self._call.index, arguments="}" if self._arguments else "{}"))
            self._call = None
        else:
            self._calls.append((self._function, self._arguments))
        self._function, self._state, self._raw = None, "call", []  # its text is a call now
        return text

    def _close_call(self, text: str, out: ToolDelta) -> str:
        self._flush_calls(out)
        self._reset()
        self.after_call = True
        return text

    def _not_a_call(self, out: ToolDelta, rest: str = "") -> str:
        """What was read of this <tool_call> is content as written (calls already streamed stay
        sent; whole calls before it in the same element still count); `rest` is read as content."""
        if self._call is not None:
            out.tool_calls.append(ToolCallDelta(self._call.index, arguments="}" if self._arguments else "{}"))
        else:
            out.content += "".join(self._raw)
        self._flush_calls(out)
        self._reset()
        return rest

    def _flush_calls(self, out: ToolDelta) -> None:
        for name, arguments in self._calls:
            out.tool_calls.append(self.new_call(name, json.dumps(arguments, ensure_ascii=False)))
        self._calls = []

    def _reset(self) -> None:
        self._state, self._buffer, self._raw = "content", [], []
        self._function = self._parameter = self._call = None
        self._arguments = {}

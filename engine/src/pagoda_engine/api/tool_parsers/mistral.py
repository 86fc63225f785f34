"""Mistral tool calls (vLLM's `mistral` parser): content, then `[TOOL_CALLS]` and either a JSON
array of `{"name": ..., "arguments": {...}}` objects, or (tokenizer v11 and later) one or more
`[TOOL_CALLS]name[ARGS]{...}` calls."""

from __future__ import annotations

import json
import re
import secrets
import string

from pagoda_engine.api.tool_parsers.base import (
    JsonCallSequence,
    JsonNesting,
    TagSplitter,
    ToolCallDelta,
    ToolDelta,
    ToolParser,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_MAX_NAME_CHARS = 256


class MistralToolParser(ToolParser):
    def call_id(self) -> str:
        # Mistral's chat templates accept only 9 alphanumeric characters (vLLM's MistralToolCall ids).
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def __init__(self, incremental: bool):
        super().__init__(incremental)
        self._tags = TagSplitter()
        self._state = "content"  # content | after_tag | array | name | args
        self._array: JsonCallSequence | None = None
        self._name = ""
        self._args: list[str] = []  # the [ARGS] object's text (whole mode)
        self._nesting: JsonNesting | None = None
        self._call: ToolCallDelta | None = None  # header sent (incremental mode)

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        handlers = {"content": self._on_content, "after_tag": self._on_after_tag, "array": self._on_array,
                    "name": self._on_name, "args": self._on_args}
        while text:
            text = handlers[self._state](text, out)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._state == "array":
            self._array.finish(out)
        elif self._state == "args":
            self._end_args(out)
        elif self._state == "name":
            out.content += TOOL_CALLS + self._name
        out.content += self._tags.release()
        return out

    def _on_content(self, text: str, out: ToolDelta) -> str:
        before, after, found = self._tags.split(self.strip_after_call(text), TOOL_CALLS)
        out.content += before
        if found:
            self._state = "after_tag"
        return after

    def _on_after_tag(self, text: str, out: ToolDelta) -> str:
        stripped = text.lstrip()
        if not stripped:
            return ""
        if stripped[0] == "[":
            self._state = "array"
            self._array = JsonCallSequence(self, separators=",", closer="]", opening=TOOL_CALLS + "[")
            return stripped[1:]
        self._state, self._name = "name", ""
        return stripped

    def _on_array(self, text: str, out: ToolDelta) -> str:
        self._array.feed(text, out)  # after the array everything is content
        return ""

    def _on_name(self, text: str, out: ToolDelta) -> str:
        before, after, found = self._tags.split(text, ARGS)
        name = self._name + before
        if _NAME_CHARS.fullmatch(name) is None or len(name) > _MAX_NAME_CHARS or (found and not name):
            self._state, self._name = "content", ""  # not a call after all
            out.content += TOOL_CALLS
            return name + (ARGS + after if found else self._tags.release())
        self._name = name
        if not found:
            return ""
        self._state = "args"
        self._nesting, self._args = JsonNesting(), []
        if self.incremental:
            self._call = self.new_call(name)
            out.tool_calls.append(self._call)
        return after

    def _on_args(self, text: str, out: ToolDelta) -> str:
        end = self._nesting.scan(text)
        piece, rest = (text, "") if end < 0 else (text[:end], text[end:])
        if self._call is not None:
            last = out.tool_calls[-1] if out.tool_calls else None
            if last is not None and last.index == self._call.index:
                last.arguments += piece  # the header went out in this same piece
            elif piece:
                out.tool_calls.append(ToolCallDelta(self._call.index, arguments=piece))
        else:
            self._args.append(piece)
        if end >= 0:
            self._end_args(out)
        return rest

    def _end_args(self, out: ToolDelta) -> None:
        self._state = "content"
        self.after_call = True
        if self._call is not None:
            self._call = None
            return
        raw = "".join(self._args)
        try:
            args = json.loads(raw)
        except ValueError:
            args = None
        if isinstance(args, dict):
            out.tool_calls.append(self.new_call(self._name, json.dumps(args, ensure_ascii=False)))
        else:
            out.content += TOOL_CALLS + self._name + ARGS + raw
            self.after_call = False

"""Pythonic tool calls (vLLM's `pythonic` parser; Llama 3.2 and 4 with their pythonic chat
templates, ToolACE): the whole output is one Python list of calls with keyword arguments,

    [get_weather(city="San Francisco", days=3), get_time(zone="UTC")]

each argument a Python literal (strings, numbers, True/False/None, lists, dicts), sent as JSON.
An output that does not open with `[` is content; one that is not such a list, or has text after
it, is content as written (whole), as in vLLM. Streamed, each call goes out, header and arguments
together, when its closing parenthesis arrives; a call that does not parse, and everything after
it, is content. Scanning keeps nesting and strings across pieces, so each piece costs O(its
length); each call is parsed once, when complete.
"""

from __future__ import annotations

import ast
import json

from pagoda_engine.api.tool_parsers.base import TagSplitter, ToolDelta, ToolParser


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of `name(key=literal, ...)`, or None when `text` is not one."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return node.func.id, json.dumps(arguments, ensure_ascii=False)
    except (TypeError, ValueError):  # a set, bytes or a complex number: no JSON for it
        return None


class PythonicToolParser(ToolParser):
    def __init__(self, incremental: bool):
        super().__init__(incremental)
        self._tags = TagSplitter()
        self._state = "start"  # start | list | after | content
        self._text: list[str] = []  # the list's text so far (whole), or the open call's (streamed)
        self._depth = 0  # brackets open inside the list
        self._quote: str | None = None
        self._escaped = False
        self._calls: list[tuple[str, str]] = []  # whole mode: complete calls, sent at the end
        self._all: list[str] = []  # everything read of the list, for content when it is no call list
        self._num_parsed = 0

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if self._state == "start":
            opened = self._tags.opening(text, "[", final=False)
            if opened is None:
                return out
            text, tagged = opened
            if not tagged:
                self._state = "content"
            else:
                self._state, self._all = "list", ["["]
        if self._state == "list":
            text = self._scan(text, out)
        if self._state == "after":
            self._trailing(text, out)
        elif self._state == "content":
            out.content += text
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._state == "start":
            out.content += self._tags.opening("", "[", final=True)[0]
        elif self._state == "list":  # cut off inside the list
            self._not_calls(out)
        elif self._state == "after" and self._calls:
            self._send_calls(out)
        return out

    def _scan(self, text: str, out: ToolDelta) -> str:
        """Read the list's text, noting each call's end (a `)` closing at depth 1) and the list's
        (`]` at depth 0); return what follows the list."""
        start = 0
        for i, ch in enumerate(text):
            if self._quote is not None:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = None
            elif ch in "\"'":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                if self._depth == 0:  # the list's own end
                    self._append(text[start:i + 1])
                    if ch != "]" or "".join(self._text)[:-1].strip(" \t\n,") or not self._num_parsed:
                        self._not_calls(out)  # not a list of calls only: `[1, 2]`, `[]`, `[f() x]`
                    else:
                        self._state = "after"
                    return text[i + 1:]
                self._depth -= 1
                if self._depth == 0 and ch == ")":
                    self._append(text[start:i + 1])
                    start = i + 1
                    if not self._call_ended(out):
                        return text[start:]
        self._append(text[start:])
        return ""

    def _append(self, piece: str) -> None:
        self._text.append(piece)
        self._all.append(piece)

    def _call_ended(self, out: ToolDelta) -> bool:
        """A call's text is complete: parse it (without the separator before it)."""
        parsed = parse_call("".join(self._text).strip().lstrip(",").strip())
        if parsed is None:
            self._not_calls(out)
            return False
        self._text = []
        self._num_parsed += 1
        if self.incremental:
            out.tool_calls.append(self.new_call(*parsed))
        else:
            self._calls.append(parsed)
        return True

    def _trailing(self, text: str, out: ToolDelta) -> None:
        """After the list: whitespace only, or the output is no call list (whole); streamed calls stay."""
        if not text.strip():
            self._all.append(text)  # whitespace: still a call list, unless text follows
            return
        if self.incremental:
            self._state = "content"
            out.content += text.lstrip()
            return
        out.content += "".join(self._all) + text
        self._calls, self._state = [], "content"

    def _not_calls(self, out: ToolDelta) -> None:
        """What was read is content as written; streamed calls already sent stay sent, and only
        the text after them is content."""
        out.content += "".join(self._text if self.incremental and self.num_calls else self._all)
        self._calls, self._text, self._state = [], [], "content"

    def _send_calls(self, out: ToolDelta) -> None:
        for name, arguments in self._calls:
            out.tool_calls.append(self.new_call(name, arguments))
        self._calls = []

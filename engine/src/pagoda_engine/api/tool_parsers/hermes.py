"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
number of them, with content text around them (vLLM's `hermes` parser)."""

from __future__ import annotations

from pagoda_engine.api.tool_parsers.base import JsonCallReader, TagSplitter, ToolDelta, ToolParser

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    def __init__(self, incremental: bool):
        super().__init__(incremental)
        self._tags = TagSplitter()
        self._call: JsonCallReader | None = None  # inside <tool_call>
        self._trailing: list[str] = []  # text inside the call after its object (before </tool_call>)

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        while text:
            if self._call is None:
                text = self._content(text, out)
            else:
                text = self._inside_call(text, out)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._call is not None:
            self._close_call(out, closed=False)
        else:
            out.content += self._tags.release()
        return out

    def _content(self, text: str, out: ToolDelta) -> str:
        before, after, found = self._tags.split(self.strip_after_call(text), START)
        out.content += before
        if found:
            self._call = JsonCallReader(self)
            self._trailing = []
        return after

    def _inside_call(self, text: str, out: ToolDelta) -> str:
        body, after, found = self._tags.split(text, END)
        if not self._call.done:
            deltas, body = self._call.feed(body)
            out.tool_calls.extend(deltas)
        self._trailing.append(body)
        if found:
            self._close_call(out, closed=True)
        return after

    def _close_call(self, out: ToolDelta, closed: bool) -> None:
        call, self._call = self._call, None
        trailing = "".join(self._trailing)
        deltas = call.close() if not trailing.strip() else (None if call.call is None else [])
        if deltas is None:  # not a call: its text is content, as the model wrote it
            out.content += START + call.text + trailing + (END if closed else self._tags.release())
        else:
            out.tool_calls.extend(deltas)
            self.after_call = True
        self._trailing = []

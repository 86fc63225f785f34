"""Llama 3.x JSON tool calls (vLLM's `llama3_json` parser): an output that starts with
`<|python_tag|>` or `{` is a `;`-separated sequence of `{"name": ..., "parameters": {...}}`
objects; any other output is content."""

from __future__ import annotations

from pagoda_engine.api.tool_parsers.base import JsonCallSequence, TagSplitter, ToolDelta, ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def __init__(self, incremental: bool):
        super().__init__(incremental)
        self._tags = TagSplitter()  # holds the output's beginning until it says whether it holds calls
        self._calls: JsonCallSequence | None = None
        self._content_only = False

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if self._content_only:
            out.content = text
        elif self._calls is not None:
            self._calls.feed(text, out)
        else:
            self._decide(text, out, final=False)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if self._calls is not None:
            self._calls.finish(out)
        elif self._tags.held:
            self._decide("", out, final=True)
        return out

    def _decide(self, text: str, out: ToolDelta, final: bool) -> None:
        opened = self._tags.opening(text, PYTHON_TAG, final)
        if opened is None:  # empty, whitespace, or the tag's beginning so far
            return
        text, tagged = opened
        if tagged or text.lstrip().startswith("{"):
            self._calls = JsonCallSequence(self, separators=";", opening=PYTHON_TAG if tagged else "")
            self._calls.feed(text if tagged else text.lstrip(), out)
        else:
            self._content_only = True
            out.content = text

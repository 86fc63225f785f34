"""Reasoning parsers: a `<think>...</think>` block → the `reasoning` field, the rest → content
(vLLM's `--reasoning-parser` names). Fed a sequence's text piece by piece where the output
processor detokenizes it; each piece costs O(its length) (a tag's worth of text is held back).

- `qwen3`: reasoning only when the output opens with `<think>`; otherwise it is all content
  (and with `chat_template_kwargs: {"enable_thinking": false}` the parser is off).
- `deepseek_r1`: the output is reasoning until `</think>`, whether or not it opens with
  `<think>` (R1's templates put the opening tag in the prompt); with no `</think>` at all, it is
  all reasoning, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda_engine.api.tool_parsers.base import TagSplitter

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ThinkParser:
    def __init__(self, implicit_start: bool):
        self.implicit_start = implicit_start  # deepseek_r1: reasoning even without <think>
        self._state = "start"  # start | reasoning | content
        self._tags = TagSplitter()

    def feed(self, text: str) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state == "start":
            text = self._open(text, final=False)
        if self._state == "reasoning":
            text = self._reasoning(text, out)
        if self._state == "content":
            out.content += text
        return out

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self._open("", final=True) if self._state == "start" else self._tags.release()
        if self._state == "reasoning":
            out.reasoning += text
        else:
            out.content += text
        return out

    def _open(self, text: str, final: bool) -> str:
        opened = self._tags.opening(text, THINK_START, final)
        if opened is None:  # nothing yet, or the tag's beginning
            return ""
        text, tagged = opened
        self._state = "reasoning" if tagged or self.implicit_start else "content"
        return text

    def _reasoning(self, text: str, out: ReasoningDelta) -> str:
        before, after, found = self._tags.split(text, THINK_END)
        out.reasoning += before
        if found:
            self._state = "content"
        return after


# name -> reasoning starts without <think>. The names `--reasoning-parser` takes are
# `config.REASONING_PARSER_NAMES`, where the flag's contract reads them; a test keeps the two equal.
REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}


def make_reasoning_parser(name: str, constrained: bool = False) -> ThinkParser:
    """`constrained`: structured outputs govern the output from its first token (vLLM would wait
    for the reasoning to end), so reasoning is only what opens with <think>."""
    return ThinkParser(implicit_start=REASONING_PARSERS[name] and not constrained)

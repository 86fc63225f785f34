"""What every tool-call parser shares: the deltas it emits, the base class that numbers calls and
gives them ids, finding tags in text that arrives in pieces (`TagSplitter`, which the reasoning
parser uses too), and the incremental reader of JSON call objects.

A parser is fed a sequence's text as it is detokenized and returns, per piece, the text that is
content and the tool-call deltas it found. Each piece costs O(its length): a parser keeps only
the call it is inside of (and a tag's worth of held-back text), never the whole output.

Two modes. Incremental (streaming): a call's header (`id`, `function.name`) goes out as soon as
its name is known, then its `arguments` as they arrive. Whole (one response): a call goes out when
it is complete and parses, with its arguments re-serialised as vLLM does; a call that does not
parse (malformed, or cut off) is returned as content text, never an error. In incremental mode a
call whose header went out stays a call even if its arguments turn out malformed (what was
streamed cannot be taken back); one whose header never parsed is returned as content text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCallDelta:
    """A piece of tool call `index` (vLLM's `DeltaToolCall`): the first piece of a call has its
    `id` and `name`, later pieces add to its `arguments` (a JSON text once complete)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolDelta:
    """What a piece of output became: content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: "ToolDelta") -> "ToolDelta":
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)
        return self


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


# Leading whitespace held back while deciding what an output opens with: beyond this, it is content.
MAX_OPENING_WHITESPACE = 256


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`: text that must be
    held back because the tag may complete in the next piece."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class TagSplitter:
    """Finds tags (`<think>`, `</tool_call>`, `[TOOL_CALLS]`...) in an output that arrives in
    pieces. A piece's end that may be a tag's beginning, or an opening that cannot be told yet, is
    held back; the next `split` or `opening` puts it in front of its piece, and `release` gives it
    up at the output's end. Holding back at most a tag's worth (or MAX_OPENING_WHITESPACE) keeps
    each piece O(its length)."""

    def __init__(self):
        self.held = ""

    def split(self, text: str, tag: str) -> tuple[str, str, bool]:
        """(before, after, found): with `tag` in the held text and `text`, what comes before and
        after it; without, what can go out now ("" after; the end that may be the tag's
        beginning is held)."""
        text, self.held = self.held + text, ""
        at = text.find(tag)
        if at >= 0:
            return text[:at], text[at + len(tag):], True
        keep = partial_tag_len(text, tag)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], "", False

    def opening(self, text: str, tag: str, final: bool) -> tuple[str, bool] | None:
        """Whether the output (the held text and `text`) opens with `tag`, after whitespace:
        (what follows the tag, True), (the whole text, False), or None while it may still (only
        whitespace or the tag's beginning so far, and not `final`, the output's end): held."""
        text, self.held = self.held + text, ""
        head = text.lstrip()
        if head.startswith(tag):
            return head[len(tag):], True
        if not final and tag.startswith(head) and len(text) <= MAX_OPENING_WHITESPACE:
            self.held = text
            return None
        return text, False

    def release(self) -> str:
        """The text held back, given up (the output ended)."""
        held, self.held = self.held, ""
        return held


class ToolParser:
    """Base of the format parsers: call numbering and ids. Subclasses implement `feed` and `finish`;
    one that reads the request's tool schemas says so (`uses_tool_schemas`) and takes them as
    `tools`, each function's parameters schema by name."""

    uses_tool_schemas = False

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.num_calls = 0
        self.after_call = False  # whitespace right after a call is not content

    def strip_after_call(self, text: str) -> str:
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        return text

    def call_id(self) -> str:
        return tool_call_id()

    def new_call(self, name: str, arguments: str = "") -> ToolCallDelta:
        call = ToolCallDelta(self.num_calls, self.call_id(), name, arguments)
        self.num_calls += 1
        return call

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        """The end of the output: whatever is still held back or open."""
        raise NotImplementedError


# A call object's start while its name is known and its arguments object has begun. The header is
# looked for only in a call's first _MAX_HEADER_CHARS characters (keeping each piece O(its length)).
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_MAX_HEADER_CHARS = 1024
_ARGUMENT_KEYS = ("arguments", "parameters")


def call_from_json(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one complete call object, or None when `text` is not one:
    `{"name": str, "arguments" | "parameters": object}` (arguments given as a JSON string are
    accepted when they hold an object)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in _ARGUMENT_KEYS if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class JsonNesting:
    """JSON nesting over text fed in pieces (brackets inside strings, and escapes, understood)."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.opened = False

    def scan(self, text: str) -> int:
        """Advance over `text` until the value that opened first closes; return the index after
        its last character, or -1 when it is still open at the end of `text`."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
                self.opened = True
            elif ch in "}]":
                self.depth -= 1
                if self.opened and self.depth <= 0:
                    return i + 1
        return -1


class JsonCallReader:
    """Reads one call object, `{"name": ..., "arguments": {...}}`, fed in pieces.

    Knows where the object ends (`done`; what follows is returned by `feed` as the rest) and, in
    incremental mode once the header has parsed, streams the arguments object's text as it
    arrives."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.raw: list[str] = []  # the object's text so far
        self.num_chars = 0
        self.done = False
        self.call: ToolCallDelta | None = None  # header sent (incremental mode)
        self._object = JsonNesting()
        self._arguments: JsonNesting | None = None  # the arguments object's, once the header parsed
        self._arguments_done = False
        self._header_given_up = not parser.incremental

    @property
    def text(self) -> str:
        return "".join(self.raw)

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str]:
        """Consume `text`; return the call pieces it gave and the text after the object's end."""
        end = self._object.scan(text)
        if end >= 0:
            self.done = True
        else:
            end = len(text)
        taken, rest = text[:end], text[end:]
        self.raw.append(taken)
        self.num_chars += len(taken)
        deltas: list[ToolCallDelta] = []
        if self.call is None and not self._header_given_up:
            self._try_header(deltas)
        elif self.call is not None:
            deltas.append(self._arguments_piece(taken))
        return [d for d in deltas if d.name is not None or d.arguments], rest

    def close(self) -> list[ToolCallDelta] | None:
        """The object's end (or the output's): the call's last pieces, or None when it is not a
        call (its text is then the caller's to return as content)."""
        if self.call is not None:
            return []  # already streamed
        parsed = call_from_json(self.text)
        if parsed is None:
            return None
        return [self.parser.new_call(*parsed)]

    def _try_header(self, deltas: list[ToolCallDelta]) -> None:
        text = self.text
        match = _HEADER.match(text[:_MAX_HEADER_CHARS])
        if match is None:
            if self.num_chars >= _MAX_HEADER_CHARS or self.done:
                self._header_given_up = True  # parsed whole at close
            return
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            self._header_given_up = True
            return
        self.call = self.parser.new_call(name)
        self._arguments = JsonNesting()
        self.call.arguments = self._arguments_piece(text[match.end():]).arguments
        deltas.append(self.call)

    def _arguments_piece(self, text: str) -> ToolCallDelta:
        """The part of `text` (the object's newest text) inside the arguments object."""
        if self._arguments_done:
            return ToolCallDelta(self.call.index)
        end = self._arguments.scan(text)
        if end >= 0:
            self._arguments_done = True
            text = text[:end]
        return ToolCallDelta(self.call.index, arguments=text)


class JsonCallSequence:
    """Call objects one after another, separated by whitespace and `separators` (`;` for Llama 3,
    `,` inside a JSON array), optionally ended by `closer` (`]`). Text that is none of these, or a
    call that does not parse, ends the sequence: it and everything after it is content (`ended`),
    and so is the `opening` that started the sequence when no call came before."""

    def __init__(self, parser: ToolParser, separators: str, closer: str | None = None, opening: str = ""):
        self.parser = parser
        self.separators = separators
        self.closer = closer
        self.ended = False
        self._opening = opening  # until the first call parses
        self._call: JsonCallReader | None = None

    def feed(self, text: str, out: ToolDelta) -> None:
        while text:
            if self.ended:
                out.content += text
                return
            if self._call is not None:
                deltas, text = self._call.feed(text)
                out.tool_calls.extend(deltas)
                if self._call.done:
                    self._close(out)
                continue
            stripped = text.lstrip()
            skipped = len(text) - len(stripped)
            if not stripped:
                return
            ch = stripped[0]
            if ch in self.separators:
                text = stripped[1:]
            elif ch == "{":
                self._call = JsonCallReader(self.parser)
                text = stripped
            else:
                self.ended = True
                if ch == self.closer:
                    text = stripped[1:]
                else:
                    out.content += self._opening
                    text = text[skipped:]

    def finish(self, out: ToolDelta) -> None:
        if self._call is not None:
            self._close(out)

    def _close(self, out: ToolDelta) -> None:
        call, self._call = self._call, None
        deltas = call.close()
        if deltas is None:
            out.content += self._opening + call.text
            self.ended = True
        else:
            out.tool_calls.extend(deltas)
        if deltas or call.call is not None:
            self._opening = ""

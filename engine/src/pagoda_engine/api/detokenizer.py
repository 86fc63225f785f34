"""Incremental detokenization of one sequence, with stop strings.

Turns the token ids the engine core streams back into text deltas a client can show at once:
- never half a character: a byte-level token can hold part of a multi-byte UTF-8 character,
  which decodes to U+FFFD until the rest arrives, so such text is held back;
- the concatenated deltas equal `tokenizer.decode(output ids)`: each step decodes a short
  window of ids from a "prefix offset" (a few tokens of context, so spacing rules see their
  neighbours) and emits what lies past the "read offset" (vLLM's and TGI's technique);
- stop strings may span tokens: text that could be the start of a stop string is held back
  until it either completes (the text is cut there) or cannot match any more.
Each update costs O(its new tokens), however long the sequence and however many stop strings:
the detokenizer keeps only the decode window and the text not yet returned (plus the longest
stop string's length of returned text, where a match may start), never the whole output, and
stop strings are matched by one Aho–Corasick automaton fed each new character once.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from pagoda_engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token (as vLLM does).
_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes and every token holds at least one byte, so an
# incomplete character at the end spans at most 3 tokens. A window still ending in U+FFFD
# after this many pending tokens holds invalid bytes, not a character in progress; emitting
# all but its last 3 tokens keeps decoding linear instead of re-decoding an ever-longer window.
_MAX_PENDING_TOKENS = 8
_INCOMPLETE_TAIL_TOKENS = 3


class StopStrings:
    """An Aho–Corasick automaton over one request's stop strings.

    States are ints (0 is the root, the empty string); a state stands for the longest suffix of
    the text fed so far that is a prefix of some stop string. Feeding a character costs O(1)
    amortised, plus O(matches ending there), whatever the number of stop strings, so matching
    is linear in the text. Building costs O(total characters of the stop strings); the server
    builds it off the event loop (`stop_strings`, cached) before the request starts.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.max_len = max((len(s) for s in self.stops), default=0)
        goto: dict[int, int] = {}  # (state << 21 | ord(char)) -> state; 21 bits hold any code point
        depth, first_stop, children = [0], [-1], [[]]
        for index, stop in enumerate(self.stops):
            state = 0
            for char in stop:
                key = state << 21 | ord(char)
                nxt = goto.get(key)
                if nxt is None:
                    nxt = goto[key] = len(depth)
                    depth.append(depth[state] + 1)
                    first_stop.append(-1)
                    children.append([])
                    children[state].append((char, nxt))
                state = nxt
            if first_stop[state] == -1:
                first_stop[state] = index  # a repeated stop string reports its first position
        fail = [0] * len(depth)
        # The nearest proper suffix state that completes a stop string (-1: none).
        match_link = [-1] * len(depth)
        # Length of the longest suffix that is a proper prefix of a stop string: the text that
        # must be held back because a stop string may still complete there.
        self.hold = [0] * len(depth)
        order = [child for _, child in children[0]]
        for state in order:  # breadth first: a state's fail link is shallower than the state
            for char, child in children[state]:
                order.append(child)
                f = fail[state]
                while f and (f << 21 | ord(char)) not in goto:
                    f = fail[f]
                fail[child] = goto.get(f << 21 | ord(char), 0) if state else 0
            f = fail[state]
            match_link[state] = f if first_stop[f] != -1 else match_link[f]
            self.hold[state] = depth[state] if children[state] else self.hold[f]
        self._goto, self._fail, self._depth = goto, fail, depth
        self._first_stop, self._match_link = first_stop, match_link

    def feed(self, state: int, text: str, base: int, find: bool) -> tuple[int, tuple[int, int] | None]:
        """Advance from `state` over `text`, whose first character sits at position `base` of the
        sequence's text. Returns the new state and, when `find`, the match that starts first
        (ties: the stop listed first) among those ending in `text`, as (start, stop index)."""
        goto, fail, depth, first_stop, match_link = (self._goto, self._fail, self._depth, self._first_stop,
                                                     self._match_link)
        best: tuple[int, int] | None = None
        for offset, char in enumerate(text):
            code = ord(char)
            while state and (state << 21 | code) not in goto:
                state = fail[state]
            state = goto.get(state << 21 | code, 0)
            if not find:
                continue
            end = base + offset + 1
            if best is not None and end - self.max_len > best[0]:
                break  # every later match starts after the best one
            hit = state if first_stop[state] != -1 else match_link[state]
            while hit > 0:
                candidate = (end - depth[hit], first_stop[hit])
                if best is None or candidate < best:
                    best = candidate
                hit = match_link[hit]
        return state, best


def ids_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """`decode(ids, skip_special_tokens)`: `tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`. For a transformers tokenizer backed by `tokenizers`
    whose class keeps the library's own decode, that is the Rust tokenizer's decode: called
    directly, without transformers' argument handling around it (several times its cost, and
    the detokenizer decodes twice per token)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        TokenizersBackend = None
    cls = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and cls.decode is PreTrainedTokenizerBase.decode and cls._decode is TokenizersBackend._decode):
        return tokenizer._tokenizer.decode
    return lambda ids, skip_special_tokens: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=16)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The automaton of a stop-string list, shared by the n sequences of a request (and by
    requests sending the same list)."""
    return StopStrings(stops)


class IncrementalDetokenizer:
    """Detokenizes one output sequence as its tokens arrive.

    `update` returns the newly stable text; `flush` returns what was held back once the
    sequence has ended. `finished` and `stop_reason` report a stop-string match; tokens passed
    after that are ignored (the caller should abort the sequence in the engine core), and
    `num_tokens` counts the tokens taken before it.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 decoder: Callable[[list[int], bool], str] | None = None):
        """`decoder`: `ids_decoder(tokenizer)`, when the caller keeps one for many sequences."""
        self.tokenizer = tokenizer
        self._decode_ids = decoder or ids_decoder(tokenizer)
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self._matcher = stop_strings(tuple(self.stop)) if self.stop else None
        self._state = 0  # the matcher's state after all text so far
        self._num_chars = 0  # characters of text so far (the matcher's positions)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.finished = False
        self.stop_reason: str | None = None

        self.num_tokens = 0  # output tokens consumed
        self._ids = self._prompt_context(list(prompt_token_ids[-_CONTEXT_TOKENS:]))  # the decode window
        self._read_offset = len(self._ids)
        self._prefix_offset = max(len(self._ids) - _CONTEXT_TOKENS, 0)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), cached
        # Stable text not yet returned, after the last `_lookback` returned chars (a stop string
        # ending in new text may start in them); cut at the stop string once one matched.
        self._lookback = max((len(stop) for stop in self.stop), default=1) - 1
        self._text = ""
        self._emitted = 0  # chars of _text already returned

    # -- public ------------------------------------------------------------------------------

    def update(self, new_token_ids: list[int], num_output_tokens: int, stop_terminated: bool = False) -> str:
        """Consume the newest tokens and return the text that became stable.

        `num_output_tokens` is the sequence's output length including `new_token_ids`; stop
        strings are looked for only in text produced at or after `min_tokens` outputs.
        `stop_terminated` says the last new token is an EOS or stop token id: like vLLM, its
        text is left out unless `include_stop_str_in_output`.
        """
        first_count = num_output_tokens - len(new_token_ids)
        last = len(new_token_ids) - 1
        for j, token_id in enumerate(new_token_ids):
            if self.finished:
                break
            self.num_tokens += 1
            if stop_terminated and j == last and not self.include_stop_str_in_output:
                continue
            delta = self._decode_next(int(token_id))
            if delta:
                self._append(delta, check_stop=first_count + j + 1 >= self.min_tokens)
        return self._take(final=False)

    def flush(self) -> str:
        """At the end of the sequence: decode what was held back (even an incomplete
        character, as `tokenizer.decode` would) and return all text not yet returned."""
        if not self.finished:
            pending = self._decode(self._ids[self._prefix_offset :])[len(self._get_prefix_text()) :]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = None
            if pending:
                self._append(pending, check_stop=self.num_tokens >= self.min_tokens)
        return self._take(final=True)

    # -- decoding ------------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it looks across neighbours and would make a window's text
        # differ from the same ids' text inside the full sequence.
        return self._decode_ids(ids, self.skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        # A prompt ending inside a character would make the first output bytes complete it,
        # changing text already counted as the prefix; start after such a tail instead.
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        return context

    def _get_prefix_text(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _advance(self, read_offset: int) -> None:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        self._prefix_text = None
        if self._prefix_offset:  # ids before the window are never decoded again
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._get_prefix_text()
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._advance(len(self._ids))
            return new_text[len(prefix_text) :]
        if len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS:
            split = len(self._ids) - _INCOMPLETE_TAIL_TOKENS
            settled = self._decode(self._ids[self._prefix_offset : split])
            # Only if the split is clean: no character straddles it.
            if len(settled) > len(prefix_text) and new_text.startswith(settled):
                self._advance(split)
                return settled[len(prefix_text) :]
        return ""

    # -- stop strings --------------------------------------------------------------------------

    def _append(self, delta: str, check_stop: bool) -> None:
        self._text += delta
        if self._matcher is None:
            return
        # Only matches that end in the new text: older text was checked already (or was produced
        # before min_tokens, where stop strings do not apply); the automaton's state carries
        # the part of a stop string that began earlier.
        start_of_delta = self._num_chars
        self._num_chars += len(delta)
        self._state, match = self._matcher.feed(self._state, delta, start_of_delta, find=check_stop)
        if match is None:
            return
        start, stop_index = match
        stop = self.stop[stop_index]
        index = start - (self._num_chars - len(self._text))  # into _text
        cut = index + len(stop) if self.include_stop_str_in_output else index
        assert cut >= self._emitted, "part of a stop string was already emitted"
        self._text = self._text[:cut]
        self.finished = True
        self.stop_reason = stop

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        return self._matcher.hold[self._state] if self._matcher is not None else 0

    def _take(self, final: bool) -> str:
        end = len(self._text)
        # With include_stop_str_in_output the stop string is shown anyway, so its beginning
        # may go out early; otherwise it must never be shown.
        if not final and not self.finished and self.stop and not self.include_stop_str_in_output:
            end -= self._partial_stop_len()
        if end <= self._emitted:
            return ""
        delta = self._text[self._emitted : end]
        self._emitted = end
        drop = self._emitted - self._lookback
        if drop > 0:
            self._text = self._text[drop:]
            self._emitted -= drop
        return delta

"""Incremental detokenization of one sequence, with stop strings.

Turns the token ids the engine core streams back into text deltas a client can show at once:
- never half a character: a byte-level token can hold part of a multi-byte UTF-8 character,
  which decodes to U+FFFD until the rest arrives, so such text is held back;
- the concatenated deltas equal `tokenizer.decode(output ids)`: each step decodes a short
  window of ids from a "prefix offset" (a few tokens of context, so spacing rules see their
  neighbours) and emits what lies past the "read offset" (vLLM's and TGI's technique);
- stop strings may span tokens: text that could be the start of a stop string is held back
  until it either completes (the text is cut there) or cannot match any more.
Each update costs O(its new tokens), however long the sequence: the detokenizer keeps only the
decode window and the text not yet returned (plus enough returned text to find a stop string
that ends in new text), never the whole output.
"""

from __future__ import annotations

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


class IncrementalDetokenizer:
    """Detokenizes one output sequence as its tokens arrive.

    `update` returns the newly stable text; `flush` returns what was held back once the
    sequence has ended. `finished` and `stop_reason` report a stop-string match; tokens passed
    after that are ignored (the caller should abort the sequence in the engine core), and
    `num_tokens` counts the tokens taken before it.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
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
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

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
        prev_len = len(self._text)
        self._text += delta
        if not (check_stop and self.stop):
            return
        match: tuple[int, str] | None = None
        for stop in self.stop:
            # Only matches that end in the new text: older text was checked already (or was
            # produced before min_tokens, where stop strings do not apply).
            index = self._text.find(stop, max(0, prev_len - len(stop) + 1))
            if index != -1 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return
        index, stop = match
        cut = index + len(stop) if self.include_stop_str_in_output else index
        assert cut >= self._emitted, "part of a stop string was already emitted"
        self._text = self._text[:cut]
        self.finished = True
        self.stop_reason = stop

    def _partial_stop_len(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

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

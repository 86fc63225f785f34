"""The one check of a prompt, wherever it enters (the OpenAI server, the offline `LLM`): the
engine core trusts what passed it. One set of messages, so a client sees the same error whichever
door it used."""

from __future__ import annotations

from typing import Sequence

from pagoda_engine.errors import InvalidRequestError


def check_prompt(token_ids: Sequence[int], *, vocab_size: int, max_model_len: int, param: str = "prompt",
                 num_tokens: int | None = None) -> None:
    """Raise InvalidRequestError (naming `param`) unless the prompt is non-empty, leaves room for
    at least one output token, and every id is in the vocabulary (checked in that order).
    `num_tokens` is the prompt's length, or a lower bound of it, when the prompt was too long to
    keep its ids (`tokenizer.encode_text` with a limit: `token_ids` is [] then)."""
    counted_only = num_tokens is not None and num_tokens != len(token_ids)
    if num_tokens is None:
        num_tokens = len(token_ids)
    if not num_tokens:
        raise InvalidRequestError("The prompt is empty (it has no tokens).", param=param)
    if num_tokens >= max_model_len:
        has = f"at least {num_tokens}" if counted_only else f"{num_tokens}"
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{has} tokens, which leaves no room for output. Please shorten the prompt.", param=param)
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"Token id {bad} is outside the vocabulary [0, {vocab_size}).", param=param)

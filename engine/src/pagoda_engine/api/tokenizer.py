"""Tokenizer loading, end-of-sequence ids, prompt encoding and chat templates.

Everything here runs in the API process (or the offline `LLM`): the core sees token ids only,
and loads the tokenizer just once, to give its grammar engine the vocabulary (structured outputs;
the loading itself is `tokenizer_files`', which both import).
Tokenizers are transformers' AutoTokenizer, so any model directory a Hugging Face user has works
unchanged, and a GGUF file's tokenizer and chat template come from its metadata, as transformers
reads them (`gguf_file=`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.tokenizer_files import has_tokenizer, load_tokenizer  # the API side's names for them

logger = logging.getLogger(__name__)

CHAT_ROLES = ("system", "user", "assistant", "tool")


# Text longer than this many characters is first counted in chunks of it, so that a prompt far
# beyond the context window never becomes one huge encoding (freeing one holds the GIL).
_COUNT_CHUNK_CHARS = 1 << 16
# Tokens a chunk boundary can add or remove (a word split in two, a space marker).
_BOUNDARY_SLACK = 4


def encode_text(tokenizer, text: str, *, add_special_tokens: bool = True,
                limit: int | None = None) -> tuple[list[int], int]:
    """Token ids of `text` and how many there are. Past `limit` tokens the text is only counted
    (the ids are [] then, and the count may be a lower bound): a prompt that long is refused.

    Meant for a worker thread: the Rust tokenizer's batch call releases the GIL while it works,
    while turning ids into Python ints and freeing an encoding hold it, so neither is ever done
    for more than about `limit` tokens at once and a huge prompt costs the event loop nothing."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return (ids if limit is None or len(ids) <= limit else []), len(ids)
    if limit is not None and len(text) > _COUNT_CHUNK_CHARS:
        at_least = 0
        for start in range(0, len(text), _COUNT_CHUNK_CHARS):
            at_least += len(backend.encode_batch([text[start:start + _COUNT_CHUNK_CHARS]],
                                                 add_special_tokens=False)[0]) - _BOUNDARY_SLACK
            if at_least > limit:
                return [], at_least
    encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    num_tokens = len(encoding)
    return (encoding.ids if limit is None or num_tokens <= limit else []), num_tokens


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a completion prompt, with the special tokens (bos) the tokenizer adds."""
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
    return list(tokenizer.encode(prompt))


def _content_text(content: Any, index: int) -> str:
    """A message's content as one string: a string, or OpenAI's list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"messages[{index}].content[{j}] must be {{'type': 'text', 'text': <string>}} "
                    f"(only text parts are supported), got {part!r}",
                    param="messages",
                )
            texts.append(part["text"])
        # vLLM's convention for templates that expect a string.
        return "\n".join(texts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}",
        param="messages",
    )


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the shape of a chat conversation and return it with every content a string.
    Keys other than role and content (name, tool_call_id, ...) pass through to the template."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of message objects", param="messages")
    normalised = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with 'role' and 'content', got {type(message).__name__}",
                param="messages",
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", param="messages"
            )
        if "content" not in message:
            raise InvalidRequestError(f"messages[{i}] has no 'content'", param="messages")
        content = message["content"]
        if content is None and role == "assistant":
            content = ""  # OpenAI allows a null assistant content (a turn that only called tools)
        normalised.append({**message, "content": _content_text(content, i)})
    return normalised


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file holding the template, or the template itself (as vLLM reads it)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def apply_chat_template(
    tokenizer,
    messages: Any,
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """Render a conversation with the model's (or the given) chat template and encode it.

    The template itself writes any bos token, so the rendered text is encoded without
    adding special tokens again (vLLM does the same)."""
    text = render_chat(tokenizer, messages, add_generation_prompt, chat_template, tools, chat_template_kwargs,
                       continue_final_message)
    return list(tokenizer.encode(text, add_special_tokens=False))


# Variables a request's chat_template_kwargs may not set: the ones the renderer itself passes.
_RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "tools", "documents", "add_generation_prompt",
                             "continue_final_message", "chat_template", "tokenize", "padding", "truncation",
                             "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                             "tokenizer_kwargs", "raise_exception", "strftime_now"}


def render_chat(tokenizer, messages: Any, add_generation_prompt: bool = True,
                chat_template: str | None = None, tools: list[dict[str, Any]] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, continue_final_message: bool = False) -> str:
    """A conversation as the text the model's (or the given) chat template renders it to.
    `tools` (OpenAI's function tools) and `chat_template_kwargs` (e.g. `enable_thinking`) reach
    the template as variables. `continue_final_message` leaves the last message open (no end of
    turn after it), for the model to continue; it excludes `add_generation_prompt`."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  param="continue_final_message")
    conversation = validate_messages(messages)
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                  param="chat_template_kwargs")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model has no chat template, so chat completions cannot be served; "
            "use the completions API, or start the server with a chat template",
            param="messages",
        )
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            tools=tools,
            **kwargs,
        )
    except (TemplateError, TypeError) as e:
        # Templates reject conversations they cannot render (e.g. roles not alternating), and a
        # template variable of the wrong type (chat_template_kwargs) fails inside a filter.
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", param="messages") from e
    except ValueError as e:  # continue_final_message: the template did not write the last message as given
        raise InvalidRequestError(f"cannot continue the final message: {e}", param="continue_final_message") from e
    return text

"""Tool calling and reasoning with the official `openai` client against a real `pagoda serve`
(the tiny random model, a Hermes-style chat template from tests/server/templates, --tool-call-parser
hermes with --enable-auto-tool-choice, --reasoning-parser qwen3).

Random weights write no tool calls of their own: `required` and named tool choices must still
give calls that parse (structured outputs enforce them), and the auto/reasoning paths are driven by
a `structured_outputs` regex that makes the model write the format the parsers read."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from conftest import DEFAULT_ARGS, launch

TEMPLATE = Path(__file__).parent / "templates" / "hermes_tools.jinja"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Enough room for any call the schemas allow (a random model fills every string to its bound).
MAX_TOKENS = 200
# The tiny model's 512-token vocabulary spells a tool-laden prompt in ~600 tokens.
ARGS = (*DEFAULT_ARGS, "--max-model-len", "2048", "--num-kv-pages", "1024", "--chat-template", str(TEMPLATE))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = launch(tmp_path_factory.mktemp("serve"), *ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--reasoning-parser", "qwen3")
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _check_calls(calls, names=SCHEMAS):
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def _stream(client, **kw):
    """A streamed chat as (content, reasoning, calls by index {id, name, arguments}, finish_reason),
    checking the pieces' order: a call's id, type and name come first, then only arguments."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning", None) or ""
            for piece in delta.tool_calls or []:
                if piece.index not in calls:
                    assert piece.id.startswith("chatcmpl-tool-") and piece.type == "function"
                    assert piece.function.name
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                else:
                    assert piece.id is None and piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, reasoning, calls, finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_always_gives_parseable_calls(client, parallel):
    for seed in range(3):
        resp = client.chat.completions.create(model="pagoda-tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=parallel, max_tokens=MAX_TOKENS, temperature=1.0,
                                              seed=seed)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_required_tool_choice_streamed(client):
    for seed in range(3):
        content, _, calls, finish = _stream(client, model="pagoda-tiny", messages=ASK, tools=TOOLS,
                                            tool_choice="required", max_tokens=MAX_TOKENS, seed=seed)
        assert finish == "tool_calls" and calls and not content
        assert sorted(calls) == list(range(len(calls)))
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_tool_choice_calls_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    resp = client.chat.completions.create(model="pagoda-tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                          max_tokens=MAX_TOKENS, seed=1)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"  # as vLLM, a named choice keeps "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    _check_calls(choice.message.tool_calls, names={"get_time"})
    assert choice.message.content is None

    content, _, calls, finish = _stream(client, model="pagoda-tiny", messages=ASK, tools=TOOLS, tool_choice=named,
                                        max_tokens=MAX_TOKENS, seed=1)
    assert finish == "stop" and not content and [c["name"] for c in calls.values()] == ["get_time"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), TIME)


HERMES_CALL = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'


def test_auto_tool_choice_parses_the_models_hermes_calls(client):
    """tool_choice auto (the default with tools): the hermes parser reads what the model wrote."""
    regex = "[a-z]{1,6} " + HERMES_CALL
    resp = client.chat.completions.create(model="pagoda-tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                                          extra_body={"structured_outputs": {"regex": regex}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content and "<tool_call>" not in choice.message.content
    _check_calls(choice.message.tool_calls, names={"get_time"})

    content, _, calls, finish = _stream(client, model="pagoda-tiny", messages=ASK, tools=TOOLS, tool_choice="auto",
                                        max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {"regex": regex}})
    assert finish == "tool_calls" and content and "<tool_call>" not in content
    assert [c["name"] for c in calls.values()] == ["get_time"]
    assert json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")


def test_auto_tool_choice_returns_malformed_calls_as_content(client):
    regex = r'<tool_call>\{"name": [a-z]{1,4}\}</tool_call>'
    for stream in (False, True):
        kw = dict(model="pagoda-tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                  extra_body={"structured_outputs": {"regex": regex}})
        if stream:
            content, _, calls, finish = _stream(client, **kw)
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        assert content.startswith('<tool_call>{"name": ') and not calls and finish == "stop"


def test_tool_choice_none_gives_text(client, server):
    resp = client.chat.completions.create(model="pagoda-tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=40, temperature=0,
                                          extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.message.content.startswith("<tool_call>")
    # The tools still reach the template (vLLM's default): the prompt is longer with them.
    with_tools = httpx.post(f"{server.base_url}/chat/completions", json={
        "messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    without = httpx.post(f"{server.base_url}/chat/completions", json={
        "messages": ASK, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert with_tools > without


def test_tool_history_round_trips_through_the_template(client, server):
    history = ASK + [
        {"role": "assistant", "content": None, "reasoning_content": "I need the tool",
         "tool_calls": [{"id": "call-1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 24C"}]
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in text  # an object, not a string
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in text
    assert "<think>\nI need the tool\n</think>" in text
    resp = client.chat.completions.create(model="pagoda-tiny", messages=history, tools=TOOLS, tool_choice="required",
                                          max_tokens=MAX_TOKENS)
    _check_calls(resp.choices[0].message.tool_calls)


REASONED = "<think>[a-z]{1,8}</think>[a-z]{1,8}"


def test_reasoning_is_split_from_content(client):
    kw = dict(model="pagoda-tiny", messages=ASK, max_tokens=40, extra_body={"structured_outputs": {"regex": REASONED}})
    message = client.chat.completions.create(**kw).choices[0].message
    assert message.reasoning.isalpha() and message.content.isalpha()
    content, reasoning, calls, _ = _stream(client, **kw)
    assert reasoning.isalpha() and content.isalpha() and not calls
    # include_reasoning false drops the field; enable_thinking false turns the parser off.
    hidden = client.chat.completions.create(model="pagoda-tiny", messages=ASK, max_tokens=40, extra_body={
        "structured_outputs": {"regex": REASONED}, "include_reasoning": False}).choices[0].message
    assert getattr(hidden, "reasoning", None) is None and hidden.content.isalpha()
    off = client.chat.completions.create(model="pagoda-tiny", messages=ASK, max_tokens=40, extra_body={
        "structured_outputs": {"regex": REASONED}, "chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(off.choices[0].message, "reasoning", None) is None
    assert off.choices[0].message.content.startswith("<think>")


def test_reasoning_then_tool_call(client):
    regex = "<think>[a-z]{1,8}</think>" + HERMES_CALL
    for stream in (False, True):
        kw = dict(model="pagoda-tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                  extra_body={"structured_outputs": {"regex": regex}})
        if stream:
            content, reasoning, calls, finish = _stream(client, **kw)
            names = [c["name"] for c in calls.values()]
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            content, reasoning, finish = choice.message.content, choice.message.reasoning, choice.finish_reason
            names = [c.function.name for c in choice.message.tool_calls]
        assert reasoning.isalpha() and not content and names == ["get_time"] and finish == "tool_calls"


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model="pagoda-tiny", messages=ASK, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob >= token.logprob  # greedy picks the most likely
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs), reverse=True)


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": []}, "tools", ""),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", ""),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice", "structured"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON"),
])
def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(client, server, body, param, words):
    r = httpx.post(f"{server.base_url}/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert client.chat.completions.create(model="pagoda-tiny", messages=ASK, max_tokens=2).choices[0].message.content \
        is not None


def test_auto_tool_choice_without_the_flags_is_a_400(tmp_path):
    srv = launch(tmp_path, *ARGS)
    try:
        r = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 4})
        error = r.json()["error"]
        assert (r.status_code, error["param"], error["type"]) == (400, "tool_choice", "invalid_request_error")
        # vLLM's words first, then the flags to add and the parsers to choose from
        assert error["message"].startswith(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set: start the '
            'server with --enable-auto-tool-choice --tool-call-parser PARSER'), error
        assert "hermes | llama3_json | mistral" in error["message"], error
        # tool_choice none and required need no parser.
        r = httpx.post(f"{srv.base_url}/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 4,
                                                                  "tool_choice": "none"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] is None
    finally:
        srv.proc.stop()


@pytest.mark.parametrize("flags, words", [
    (["--tool-call-parser", "nope"], "invalid tool call parser: nope"),
    (["--reasoning-parser", "nope"], "invalid reasoning parser: nope"),
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--chat-template", "no-such-file"], "--chat-template"),
])
def test_bad_flags_stop_the_server_at_start(flags, words):
    done = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", *flags], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr


def test_auto_tool_choice_without_parallel_calls_returns_the_first(client):
    regex = HERMES_CALL + HERMES_CALL
    for stream in (False, True):
        kw = dict(model="pagoda-tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS, parallel_tool_calls=False,
                  extra_body={"structured_outputs": {"regex": regex}})
        if stream:
            calls = list(_stream(client, **kw)[2].values())
        else:
            message = client.chat.completions.create(**kw).choices[0].message
            calls = [{"name": c.function.name} for c in message.tool_calls]
        assert [c["name"] for c in calls] == ["get_time"]
        kw["parallel_tool_calls"] = True
        both = client.chat.completions.create(**kw).choices[0].message.tool_calls
        assert [c.function.name for c in both] == ["get_time", "get_time"]


def test_fields_this_server_cannot_honour_are_refused(server):
    for body, param in [({"priority": 3}, "priority"), ({"stream_options": {"include_usage": True}}, "stream_options")]:
        for path, base in [("/chat/completions", {"messages": ASK}), ("/completions", {"prompt": "hi"})]:
            r = httpx.post(f"{server.base_url}{path}", json={**base, "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    # accepted and unused: OpenAI's bookkeeping fields
    r = httpx.post(f"{server.base_url}/chat/completions", json={
        "messages": ASK, "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False,
        "service_tier": "auto"})
    assert r.status_code == 200


def test_the_published_schema_describes_tools_and_reasoning(server):
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    request = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "include_reasoning"} <= set(request)
    assert {"tool_calls", "tool_call_id", "reasoning", "reasoning_content"} <= set(schemas["ChatMessage"]["properties"])
    assert {"reasoning", "tool_calls"} <= set(schemas["ChatResponseMessage"]["properties"])
    assert {"id", "type", "function"} <= set(schemas["ToolCall"]["properties"])
    assert {"tools", "chat_template_kwargs"} <= set(schemas["TokenizeRequest"]["properties"])


def _frames(server, body: dict) -> list[dict]:
    r = httpx.post(server.url + "/v1/chat/completions", json=dict(body, stream=True), timeout=120)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def _calls_of(chunks: list[dict]) -> tuple[str, dict, list]:
    """(content, calls by index {name, arguments}, the finish reasons) of streamed chunks, checking
    that each call's id and name come once, in its first piece."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                if piece["index"] not in calls:
                    assert piece["id"] and piece["function"]["name"], piece
                    calls[piece["index"]] = {"name": piece["function"]["name"], "arguments": ""}
                else:
                    assert piece.get("id") is None and piece["function"].get("name") is None, piece
                calls[piece["index"]]["arguments"] += piece["function"].get("arguments") or ""
            if choice.get("finish_reason"):
                finishes.append(choice["finish_reason"])
    return content, calls, finishes


def test_a_tool_call_stream_resumed_mid_call_parses_as_the_uninterrupted_one(server):
    """What `pagoda route` sends when a replica dies mid-call: the parser replays the streamed
    tokens, so the continuation neither repeats the call's name nor loses an argument byte."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}
    full = _frames(server, body)
    want = _calls_of(full)
    assert want[1] and len(want[2]) == 1, want
    ids = [t for c in full for ch in c["choices"] for t in ch.get("token_ids") or []]
    for k in (3, len(ids) // 2, len(ids) - 2):
        sent, n = [], 0
        for c in full:
            if n >= k:
                break
            n += sum(len(ch.get("token_ids") or []) for ch in c["choices"])
            sent.append(c)
        streamed = [t for c in sent for ch in c["choices"] for t in ch.get("token_ids") or []]
        rest = _frames(server, dict(body, resume_token_ids=streamed))
        assert _calls_of(sent + rest[1:]) == want, k  # rest[0]: the continuation's role chunk

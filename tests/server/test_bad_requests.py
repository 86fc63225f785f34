"""Bad input never hurts the server: generated bodies get 4xx (never 5xx), the engine core
survives all of them, and the API key is enforced."""

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import DEFAULT_ARGS, core_pid, launch

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A short context keeps any body that happens to be valid cheap to serve.
    srv = launch(tmp_path_factory.mktemp("serve"), *DEFAULT_ARGS, "--max-model-len", "64", "--api-key", API_KEY)
    srv.core_at_start = core_pid(srv.proc.pid)
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=8)
small_ints = st.integers(-3, 70)
token_ids = st.lists(st.integers(-2, 600), max_size=6)
sampling = {
    "model": st.sampled_from(["pagoda-tiny", "other"]) | json_values,
    "max_tokens": small_ints | json_values, "n": st.integers(-1, 3) | json_values,
    "temperature": st.floats(-1, 3) | json_values, "top_p": st.floats(-0.5, 1.5) | json_values,
    "top_k": small_ints | json_values, "min_p": st.floats(-1, 2) | json_values,
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 200) | json_values, "seed": st.integers(-(2**64), 2**64) | json_values,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | json_values,
    "stop_token_ids": token_ids | json_values, "min_tokens": small_ints | json_values,
    "ignore_eos": st.booleans() | json_values, "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | json_values}) | json_values,
    "priority": small_ints | json_values, "request_id": st.text(max_size=6) | json_values,
    "skip_special_tokens": st.booleans() | json_values,
}
completion_bodies = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=40) | token_ids | st.lists(token_ids, max_size=3) | st.lists(st.text(max_size=8), max_size=3)
    | json_values,
    "echo": st.booleans() | json_values, "logprobs": st.integers(-2, 25) | json_values,
    "suffix": st.text(max_size=3) | json_values, "best_of": small_ints | json_values, **sampling})
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"]) | json_values},
    optional={"content": st.text(max_size=20) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8) | json_values}), max_size=2)
        | json_values, "name": st.text(max_size=5) | json_values}), max_size=3) | json_values
chat_bodies = st.fixed_dictionaries({}, optional={
    "messages": messages, "max_completion_tokens": small_ints | json_values, "logprobs": st.booleans() | json_values,
    "top_logprobs": st.integers(-2, 25) | json_values, "add_generation_prompt": st.booleans() | json_values,
    **sampling})
schemas = st.sampled_from([
    {"type": "object"}, {"type": "string"}, {"type": "nonsense"}, {"properties": {"a": {"$ref": "#/$defs/missing"}}},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5}}, "required": ["a"]},
    {"type": "object", "properties": {"b": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "boolean"}}},
    {"type": "object", "properties": {"b": {"$ref": "#/$defs/x"}}, "$defs": {"x": {"type": "integer"}}}]) | json_values
tool_calls = st.lists(st.fixed_dictionaries({"id": st.text(max_size=3), "type": st.just("function"), "function": (
    st.fixed_dictionaries({"name": st.text(max_size=3), "arguments": st.sampled_from(["{}", '{"a": 1}', "{bad", "1"])}))}),
    max_size=2) | json_values
tool_bodies = st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}]) | st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["assistant", "tool", "user"])}, optional={
        "content": st.text(max_size=5) | st.none(), "tool_calls": tool_calls, "tool_call_id": st.text(max_size=3),
        "reasoning_content": st.text(max_size=5) | json_values}), min_size=1, max_size=3)}, optional={
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function") | json_values, "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", ""]) | json_values},
        optional={"parameters": schemas, "description": st.text(max_size=5)})}), max_size=3) | json_values,
    "tool_choice": st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})})
    | json_values,
    "parallel_tool_calls": st.booleans() | json_values, "include_reasoning": st.booleans() | json_values,
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "tools", "x", "messages"]), json_values,
                                            max_size=2) | json_values,
    "max_tokens": st.integers(1, 8), "stream": st.booleans(),
    "structured_outputs": st.just({"regex": "[a-z]{1,3}"})})
tokenize_bodies = st.fixed_dictionaries({}, optional={
    "prompt": st.text(max_size=20) | json_values, "messages": messages, "add_special_tokens": st.booleans()})
detokenize_bodies = st.fixed_dictionaries({}, optional={"tokens": token_ids | json_values, "model": json_values})
raw_bodies = st.binary(max_size=40) | json_values.map(lambda v: json.dumps(v).encode())

# Bodies of the right types and near the edges of the valid ranges: these get past validation
# and exercise the engine core itself (extreme penalties and seeds, top-k beyond the vocabulary,
# stop tokens, min_tokens, logprobs at the limit, several sequences).
edge_floats = st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0])
plausible_completion_bodies = st.fixed_dictionaries({
    "prompt": st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 511), min_size=1, max_size=20)},
    optional={
        "max_tokens": st.integers(1, 40), "n": st.integers(1, 4), "temperature": edge_floats | st.just(1e4),
        "top_p": st.sampled_from([1e-6, 0.3, 1.0]), "top_k": st.sampled_from([-1, 0, 1, 5, 511, 512, 10**6]),
        "min_p": st.sampled_from([0.0, 0.2, 1.0]), "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
        "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
        "repetition_penalty": st.sampled_from([0.01, 0.5, 1.0, 2.0, 100.0]),
        "seed": st.sampled_from([0, -1, 2**63 - 1, -(2**63) + 1]), "stop": st.lists(st.text(min_size=1, max_size=2),
                                                                                   max_size=2),
        "stop_token_ids": st.lists(st.integers(0, 511), max_size=3), "min_tokens": st.integers(0, 5),
        "ignore_eos": st.booleans(), "logprobs": st.integers(0, 20), "echo": st.booleans(),
        "stream": st.booleans(), "skip_special_tokens": st.booleans(), "priority": st.integers(-5, 5)})

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def _post(http: httpx.Client, path: str, content: bytes) -> int:
    with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as resp:
        body = resp.read()  # a stream that fails mid-way reports in-band; read it all
        if resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream"):
            assert body.rstrip().endswith(b"data: [DONE]")
        elif resp.status_code != 200:
            err = json.loads(body)["error"]
            assert err["message"] and err["type"], err
        return resp.status_code


def _check(http, path, body) -> None:
    status = _post(http, path, json.dumps(body).encode())
    assert status < 500, (path, body, status)


@FUZZ
@given(body=completion_bodies)
def test_generated_completion_bodies_never_5xx(http, body):
    _check(http, "/v1/completions", body)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=plausible_completion_bodies)
def test_plausible_bodies_are_served_or_refused_cleanly(http, body):
    _check(http, "/v1/completions", body)


@FUZZ
@given(body=chat_bodies)
def test_generated_chat_bodies_never_5xx(http, body):
    _check(http, "/v1/chat/completions", body)


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=tool_bodies)
def test_generated_tool_bodies_never_5xx(http, body):
    _check(http, "/v1/chat/completions", body)


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
       content=raw_bodies)
def test_malformed_bodies_are_400(http, path, content):
    status = _post(http, path, content)
    assert status < 500
    try:
        parsed = json.loads(content)
    except ValueError:
        assert status == 400  # not JSON at all
        return
    if not isinstance(parsed, dict):
        assert status == 400


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(tok=tokenize_bodies, detok=detokenize_bodies)
def test_generated_tokenize_bodies_never_5xx(http, tok, detok):
    _check(http, "/tokenize", tok)
    _check(http, "/detokenize", detok)


def test_server_and_core_survive_the_fuzzing(server, http):
    # Runs after the generated bodies above (pytest keeps file order): same core, still serving.
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert core_pid(server.proc.pid) == server.core_at_start  # the core it started with, never replaced


def test_specific_bad_values_name_their_param(http):
    cases = [({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "top_p": 0}, "top_p"),
             ({"prompt": "x", "n": True}, "n"), ({"prompt": [600]}, "prompt"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
             ({"prompt": "x", "max_tokens": 64}, "max_tokens"), ({"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens"),
             ({"prompt": "x", "stop_token_ids": [9999]}, "stop_token_ids"), ({}, "prompt")]
    for body, param in cases:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 400}]})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_api_key_is_required_on_the_api_only(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server.base_url}/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/models").status_code == 401
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{open_path}").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    assert ok.completions.create(model="pagoda-tiny", prompt="x", max_tokens=2).choices


def test_profile_routes_are_absent_without_a_profiler_config(http):
    for route in ("/start_profile", "/stop_profile"):
        r = http.post(route)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_an_empty_pagoda_api_key_stops_the_server_before_it_loads_anything():
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", *DEFAULT_ARGS],
                         env={**os.environ, "PAGODA_API_KEY": " \n"}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "PAGODA_API_KEY is set but empty: give the key, or unset it" in out.stderr


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "text/json", None])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_not_declared_as_json_is_a_415(http, route, content_type):
    body = {"prompt": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = http.post(route, content=json.dumps(body), headers=headers)
    assert r.status_code == 415, r.text
    sent = "the request has no Content-Type" if content_type is None else f"the request's Content-Type is '{content_type}'"
    assert r.json() == {"error": {
        "message": f"Unsupported Media Type: Only 'application/json' is allowed ({sent}; send "
                   "`Content-Type: application/json`).",
        "type": "invalid_request_error", "param": None, "code": "unsupported_media_type"}}


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON",
                                          "application/vnd.api+json"])
def test_a_body_declared_as_json_is_read(http, content_type):
    r = http.post("/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 1}),
                  headers={"Content-Type": content_type})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("constraint, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "structured_outputs.json"),
])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_constraint_is_reported_under_the_field_the_client_sent(http, route, constraint, param):
    body = {"prompt": "x", "max_tokens": 1, **constraint}
    if route.endswith("chat/completions"):
        body = {"messages": [{"role": "user", "content": "x"}], **{k: v for k, v in body.items() if k != "prompt"}}
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"] and ("structured_outputs" in error["message"]) == param.startswith(
        "structured_outputs"), error

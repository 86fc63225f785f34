"""Structured outputs and logit_bias against a real `pagoda serve` (the tiny random model) through
the official openai client: the grammar mask makes even random weights write output that follows
the schema, regex, choice list or grammar asked for; requests without a constraint in the same
batch are untouched; a bad constraint is a 400 naming it, and the server keeps serving. One
server for the module (conftest's `server`)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI


MESSAGES = [{"role": "user", "content": "Describe a person."}]

# Strings, arrays and numbers are bounded so that a random model's output always closes well
# within max_tokens; the grammar must enforce every bound for the outputs to validate.
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
             "required": ["color"], "additionalProperties": False},
    "boolean_and_null": {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
                         "required": ["ok", "none"], "additionalProperties": False},
    "bounded_integer": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}},
                        "required": ["n"], "additionalProperties": False},
    "array_of_enums": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 4},
            "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"], "additionalProperties": False}},
            "required": ["first", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "array_of_objects": {"type": "object", "properties": {"items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["id"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "string_bounds": {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 3}},
                      "required": ["code"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]$"}},
                "required": ["date"], "additionalProperties": False},
    "const_and_optional": {"type": "object", "properties": {"kind": {"const": "user"},
                                                            "note": {"type": "string", "maxLength": 3}},
                           "required": ["kind"], "additionalProperties": False},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                        "minItems": 1, "maxItems": 5},
    "defs_and_ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 3}, "y": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _compact(text: str):
    """The JSON value of `text`, after checking that it has no whitespace outside strings."""
    value = json.loads(text)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), text
    return value


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_responses_validate_and_are_compact(client, name):
    schema = SCHEMAS[name]
    for seed in (0, 1):  # greedy-like and sampled
        r = client.chat.completions.create(
            model=None, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(_compact(choice.message.content), schema)


def test_json_schema_streamed_on_completions(client):
    schema = SCHEMAS["nested"]
    stream = client.completions.create(model=None, prompt="JSON:", max_tokens=300, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"json": schema}})
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[-1].finish_reason == "stop"
    assert len(chunks) > 3  # token by token, not one final blob
    jsonschema.validate(_compact("".join(c.text for c in chunks)), schema)


def test_json_schema_streamed_on_chat_for_each_of_n_choices(client):
    schema = SCHEMAS["array_of_objects"]
    stream = client.chat.completions.create(
        model=None, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=7, n=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "items", "schema": schema}})
    texts, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(_compact(text), schema)


def test_json_object_parses(client):
    """Any JSON object: a random model writes keys without end, so a bias towards "}" (taken
    wherever the grammar allows it) closes the object; the grammar keeps the rest valid."""
    close = _bias_for(client, "}", 100)
    for seed in range(3):
        r = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=100, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"}, logit_bias=close)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        assert isinstance(_compact(r.choices[0].message.content), dict)


@pytest.mark.parametrize("body", [{"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
                                  {"guided_choice": ["yes", "no", "maybe"]}])
def test_choice_output_is_one_of_the_choices(client, body):
    for seed in range(4):
        r = client.completions.create(model=None, prompt="Answer:", max_tokens=20, temperature=1.0, seed=seed,
                                      extra_body=body)
        assert r.choices[0].text in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field", ["structured_outputs", "guided_regex"])
def test_regex_output_matches(client, field):
    regex = r"[A-Z][a-z]{2,5} [0-9]{1,3}(\.[0-9])?"
    body = {"structured_outputs": {"regex": regex}} if field == "structured_outputs" else {"guided_regex": regex}
    for seed in range(3):
        r = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=30, temperature=1.0, seed=seed,
                                           extra_body=body)
        assert re.fullmatch(regex, r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
def test_lark_grammar_output_parses(client, field):
    grammar = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]/\n'
    body = {"structured_outputs": {"grammar": grammar}} if field == "structured_outputs" else {"guided_grammar": grammar}
    r = client.completions.create(model=None, prompt="Math:", max_tokens=60, temperature=0, extra_body=body)
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop", text
    while re.search(r"\([0-9][+*][0-9]\)", text):  # reduce innermost expressions to one digit
        text = re.sub(r"\([0-9][+*][0-9]\)", "0", text)
    assert re.fullmatch(r"[0-9]", text), r.choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"guided_json": {"type": "object"}, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"logit_bias": {"100000": 5}}, "logit_bias"),
    ({"logit_bias": {"abc": 5}}, "logit_bias"),
])
def test_a_bad_constraint_is_a_400_naming_it_and_the_server_keeps_serving(client, server, body, param):
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    ok = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_the_openai_client_reports_an_invalid_schema(client):
    with pytest.raises(BadRequestError, match="frobnicate"):
        client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}})


def test_unconstrained_requests_batched_with_constrained_ones_get_their_greedy_tokens(client):
    prompts = [f"Free prompt number {i}:" for i in range(4)]

    def free(prompt):
        return client.completions.create(model=None, prompt=prompt, max_tokens=24, temperature=0).choices[0].text

    def constrained(i):
        body = {"structured_outputs": {"json": SCHEMAS["array_of_objects"]}} if i % 2 else {
            "guided_regex": "[a-z]{20,40}"}
        return client.completions.create(model=None, prompt=f"Constrained {i}:", max_tokens=60, temperature=1.0,
                                         seed=i, extra_body=body).choices[0].text

    alone = [free(p) for p in prompts]
    with ThreadPoolExecutor(12) as pool:
        mixed = [pool.submit(constrained, i) for i in range(8)]
        together = list(pool.map(free, prompts))
        constrained_texts = [f.result() for f in mixed]
    assert together == alone
    assert all(re.fullmatch("[a-z]{20,40}", t) for t in constrained_texts[0::2]), constrained_texts


def _one_token_text(server, token_id: int) -> str:
    return httpx.post(server.url + "/detokenize", json={"tokens": [token_id]}, timeout=30).json()["prompt"]


def test_a_large_logit_bias_forces_a_token(client, server):
    token_id = 300
    r = client.completions.create(model=None, prompt="Hello", max_tokens=6, temperature=1.0, seed=3,
                                  logit_bias={str(token_id): 100})
    assert r.choices[0].text == _one_token_text(server, token_id) * 6


def test_a_huge_negative_logit_bias_bans_a_token(client):
    r = client.completions.create(model=None, prompt="Hello", max_tokens=1, temperature=0, logprobs=0)
    first = r.choices[0].text
    banned = client.completions.create(model=None, prompt="Hello", max_tokens=1, temperature=0,
                                       logit_bias=_bias_for(client, first, -100))
    assert banned.choices[0].text != first


def _bias_for(client, text: str, bias: float) -> dict[str, float]:
    ids = httpx.post(str(client.base_url).replace("/v1/", "") + "/tokenize",
                     json={"prompt": text, "add_special_tokens": False}, timeout=30).json()["tokens"]
    return {str(t): bias for t in ids}


def test_logit_bias_combines_with_a_grammar(client, server):
    """The bias shifts the logits, the grammar still decides what is allowed: a strongly favoured
    token the grammar forbids never appears."""
    r = client.completions.create(model=None, prompt="Hi", max_tokens=10, temperature=0,
                                  logit_bias={"300": 100}, extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta")


def test_the_published_schema_describes_the_constraint_fields(server):
    schemas = httpx.get(server.url + "/openapi.json", timeout=30).json()["components"]["schemas"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        fields = schemas[model]["properties"]
        assert {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "logit_bias"} <= set(fields)
    assert {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"} == set(
        schemas["StructuredOutputs"]["properties"])
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert "schema" in schemas["JsonSchemaResponseFormat"]["properties"]

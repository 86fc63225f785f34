"""Token-id continuations on a real server: vLLM's `return_token_ids`, and Pagoda's
`resume_token_ids` (what `pagoda route` sends when a stream breaks). A stream resumed after any of
its tokens must go on with exactly the text, token ids and usage the uninterrupted stream had,
greedy or seeded, through stop strings; what cannot be resumed is a 400 naming the field."""

import json

import httpx
import pytest

from conftest import DEFAULT_ARGS, launch


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = launch(tmp_path_factory.mktemp("resume"), *DEFAULT_ARGS)
    yield s
    s.proc.stop()


def _stream(url: str, path: str, body: dict) -> list[dict]:
    r = httpx.post(url + path, json=dict(body, stream=True), timeout=60)
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def _text(chunks: list[dict]) -> str:
    return "".join(ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                   for c in chunks for ch in c.get("choices") or ())


def _ids(chunks: list[dict]) -> list[int]:
    return [t for c in chunks for ch in c.get("choices") or () for t in ch.get("token_ids") or ()]


def _cut(chunks: list[dict], k: int) -> list[dict]:
    """The chunks a client had when the stream broke after its k-th token."""
    out, n = [], 0
    for c in chunks:
        if n >= k:
            break
        n += len([t for ch in c.get("choices") or () for t in ch.get("token_ids") or ()])
        out.append(c)
    return out


CASES = {
    "completions greedy": ("/v1/completions", {"prompt": "Once upon a time", "temperature": 0}),
    "completions seeded": ("/v1/completions", {"prompt": "Once upon a time", "temperature": 1.0, "seed": 7,
                                               "top_p": 0.9}),
    "chat greedy penalties": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}],
                                                       "temperature": 0, "repetition_penalty": 1.3,
                                                       "frequency_penalty": 0.5}),
    "chat seeded": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story"}],
                                             "temperature": 0.8, "seed": 3}),
}


CASES["chat json schema"] = ("/v1/chat/completions", {
    "messages": [{"role": "user", "content": "A person"}], "temperature": 0,
    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"]}}}})
CASES["completions regex seeded"] = ("/v1/completions", {
    "prompt": "Code:", "temperature": 1.0, "seed": 5, "structured_outputs": {"regex": "[a-z]{10,40}"}})


@pytest.mark.parametrize("case", CASES)
def test_a_stream_resumed_after_any_token_goes_on_exactly(srv, case):
    path, body = CASES[case]
    constrained = "response_format" in body or "structured_outputs" in body
    # A grammar ends its sequence where it is complete: no ignore_eos there.
    body = dict(body, max_tokens=24, ignore_eos=not constrained, return_token_ids=True,
                stream_options={"include_usage": True})
    full = _stream(srv.url, path, body)
    ids = _ids(full)
    assert len(ids) == full[-1]["usage"]["completion_tokens"] and len(ids) >= 12, (case, len(ids))
    assert constrained or len(ids) == 24
    for k in (1, 5, 11, len(ids) - 1):
        sent = _cut(full, k)
        k_ids = _ids(sent)
        rest = _stream(srv.url, path, dict(body, resume_token_ids=k_ids))
        assert _text(sent) + _text(rest) == _text(full), (case, k)
        assert k_ids + _ids(rest) == ids, (case, k)
        assert rest[-1]["usage"] == full[-1]["usage"], (case, k)  # the whole sequence's usage


def test_a_stop_string_across_the_resume_point_still_stops_the_stream(srv):
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 40, "ignore_eos": True,
            "return_token_ids": True}
    free = _text(_stream(srv.url, "/v1/completions", body))
    stop = free[len(free) // 2: len(free) // 2 + 4]  # some characters from the middle of the output
    body["stop"] = [stop]
    full = _stream(srv.url, "/v1/completions", body)
    assert full[-1]["choices"][0]["finish_reason"] == "stop" and stop not in _text(full)
    ids = _ids(full)
    for k in range(1, len(ids)):
        sent = _cut(full, k)
        rest = _stream(srv.url, "/v1/completions", dict(body, resume_token_ids=_ids(sent)))
        assert _text(sent) + _text(rest) == _text(full), k
        assert rest[-1]["choices"][0]["finish_reason"] == "stop", k


def test_resume_token_ids_the_grammar_refuses_end_the_stream_naming_the_field(srv):
    bad = httpx.post(srv.url + "/tokenize", json={"prompt": "Zebra 42"}).json()["tokens"][-2:]
    r = httpx.post(srv.url + "/v1/completions", json={
        "prompt": "Code:", "max_tokens": 8, "stream": True, "resume_token_ids": bad,
        "structured_outputs": {"regex": "[a-z]{10,40}"}})
    frames = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert [f["error"]["param"] for f in frames if "error" in f] == ["resume_token_ids"], r.text


def test_return_token_ids_matches_the_whole_response_and_the_tokenizer(srv):
    body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(srv.url + "/v1/completions", json=body).json()
    chunks = _stream(srv.url, "/v1/completions", body)
    assert _ids(chunks) == whole["choices"][0]["token_ids"] and len(whole["choices"][0]["token_ids"]) == 8
    prompt_ids = httpx.post(srv.url + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert whole["choices"][0]["prompt_token_ids"] == prompt_ids == chunks[0]["choices"][0]["prompt_token_ids"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": True}
    first = _stream(srv.url, "/v1/chat/completions", chat)[0]
    assert first["prompt_token_ids"] == httpx.post(srv.url + "/tokenize", json={"messages": chat["messages"]}).json()["tokens"]
    plain = _stream(srv.url, "/v1/completions", dict(body, return_token_ids=False))
    assert all("token_ids" not in ch for c in plain for ch in c["choices"])


@pytest.mark.parametrize("changes, why", [
    ({"stream": False}, "stream=True"),
    ({"n": 2}, "n == 1"),
    ({"echo": True}, "echo"),
    ({"max_tokens": 3}, "as many as max_tokens"),
    ({"resume_token_ids": [10 ** 9]}, "vocabulary"),
])
def test_what_cannot_be_resumed_is_a_400_naming_the_field(srv, changes, why):
    body = dict({"prompt": "Hello", "max_tokens": 8, "stream": True, "resume_token_ids": [5, 6, 7]}, **changes)
    r = httpx.post(srv.url + "/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "resume_token_ids", r.text
    assert why in r.json()["error"]["message"], r.text

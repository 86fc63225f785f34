"""Hostile and heavy requests against a real `pagoda serve` and a real `pagoda route` in front of
it: every class of bad input is a 400 in the OpenAI shape on a connection that stays open; each
request limit refuses one past it (naming its flag) and accepts one at it; and /health keeps
answering fast while the heaviest requests the default limits allow are being served."""

import http.client
import json
import random
import string
import threading
import time

import httpx
import openai
import pytest

from conftest import DEFAULT_ARGS, launch
from pagoda_e2e import PYTHON, Proc, free_port, start_router

# Raw bodies: lone surrogates anywhere, NaN and Infinity, deep nesting, wrong types, bad UTF-8.
BAD_BODIES = {
    "lone surrogate in prompt": rb'{"prompt": "hi \ud800 there", "max_tokens": 2}',
    "lone low surrogate in a prompt list": rb'{"prompt": ["ok", "\udc00"], "max_tokens": 2}',
    "lone surrogate in stop": rb'{"prompt": "hi", "max_tokens": 2, "stop": ["\ud83d"]}',
    "lone surrogate in an unknown field": rb'{"prompt": "hi", "max_tokens": 2, "tools": [{"arguments": "\udfff"}]}',
    "NaN": b'{"prompt": "hi", "temperature": NaN}',
    "Infinity": b'{"prompt": "hi", "top_p": Infinity}',
    "deep nesting": b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "wrong type": b'{"prompt": {"text": "hi"}, "max_tokens": "2"}',
    "invalid UTF-8": b'{"prompt": "\xed\xa0\x80"}',
    "not JSON": b"prompt=hi",
}
BAD_CHAT_BODIES = {
    "lone surrogate in a message": rb'{"messages": [{"role": "user", "content": "\ud800"}]}',
    "lone surrogate in a content part": rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]}',
    "lone surrogate in tool call arguments": (
        rb'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function",'
        rb' "function": {"name": "f", "arguments": "{\"a\": \"\ud800\"}"}}]}, {"role": "user", "content": "x"}]}'),
}
GOOD_COMPLETION = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()


def post_on(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, dict, str | None]:
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read()), resp.getheader("connection")


def assert_400_and_connection_survives(port: int, path: str, body: bytes) -> dict:
    """POST `body`, expect a 400 in the OpenAI error shape, then a good request on the same
    keep-alive connection (the same socket) succeeds."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        status, error, connection = post_on(conn, path, body)
        assert status == 400, error
        assert set(error["error"]) == {"message", "type", "param", "code"}, error
        assert error["error"]["type"] == "invalid_request_error"
        assert connection != "close"
        sock = conn.sock
        status, ok, _ = post_on(conn, "/v1/completions", GOOD_COMPLETION)
        assert status == 200, ok
        assert conn.sock is sock, "the server closed the connection after the bad request"
        return error
    finally:
        conn.close()


@pytest.fixture(scope="module")
def router_port(server, tmp_path_factory):
    port = free_port()
    proc = start_router(port, [server.url], tmp_path_factory.mktemp("route") / "route.log",
                        ["--health-interval", "0.5"])
    proc.wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=30)
    yield port
    proc.stop()


@pytest.mark.parametrize("through", ["serve", "route"])
@pytest.mark.parametrize("case", list(BAD_BODIES) + list(BAD_CHAT_BODIES))
def test_bad_input_is_a_400_and_the_connection_stays_usable(server, router_port, through, case):
    port = server.port if through == "serve" else router_port
    path, body = (("/v1/chat/completions", BAD_CHAT_BODIES[case]) if case in BAD_CHAT_BODIES
                  else ("/v1/completions", BAD_BODIES[case]))
    error = assert_400_and_connection_survives(port, path, body)
    if case in ("NaN", "Infinity", "deep nesting", "invalid UTF-8") or "surrogate" in case:
        assert error["error"]["code"] == "invalid_json", error


def test_a_valid_surrogate_pair_is_text(server):
    r = httpx.post(f"{server.url}/tokenize", content=rb'{"prompt": "\ud83d\ude00"}',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"].endswith("😀")


# --------------------------------------------------------------------------------------- limits

LIMITS = {"--max-request-body-bytes": 4000, "--max-sequences-per-request": 6, "--max-stop-strings": 5,
          "--max-stop-string-length": 10, "--max-logit-bias-entries": 3, "--max-chat-messages": 4}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    args = [a for flag, value in LIMITS.items() for a in (flag, str(value))]
    srv = launch(tmp_path_factory.mktemp("limited"), *DEFAULT_ARGS, *args)
    yield srv
    srv.proc.stop()


def _padded(body: dict, size: int) -> bytes:
    """`body` as JSON of exactly `size` bytes (padding in an ignored field)."""
    raw = json.dumps({**body, "pad": ""}).encode()
    return json.dumps({**body, "pad": "x" * (size - len(raw))}).encode()


def _prompt_body(size: int) -> bytes:
    """A completion whose prompt makes the body exactly `size` bytes."""
    empty = len(json.dumps({"prompt": "", "max_tokens": 1}))
    prompt = ("the quick brown fox jumps over the lazy dog " * (size // 40 + 1))[:size - empty]
    return json.dumps({"prompt": prompt, "max_tokens": 1}).encode()


def _message(n: int) -> list[dict]:
    return [{"role": "user", "content": "hi"}] * n


# (flag, path, body at the limit, body one past it, the param named)
LIMIT_CASES = [
    ("--max-sequences-per-request", "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1},
     {"prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 1}, "n"),
    ("--max-sequences-per-request", "/v1/completions", {"prompt": "a", "n": 6, "max_tokens": 1},
     {"prompt": "a", "n": 7, "max_tokens": 1}, "n"),
    ("--max-stop-strings", "/v1/completions", {"prompt": "a", "stop": list("vwxyz"), "max_tokens": 1},
     {"prompt": "a", "stop": list("uvwxyz"), "max_tokens": 1}, "stop"),
    ("--max-stop-string-length", "/v1/chat/completions",
     {"messages": _message(1), "stop": "x" * 10, "max_tokens": 1},
     {"messages": _message(1), "stop": "x" * 11, "max_tokens": 1}, "stop"),
    ("--max-logit-bias-entries", "/v1/completions",
     {"prompt": "a", "logit_bias": {"1": 0, "2": 0, "3": 0}, "max_tokens": 1},
     {"prompt": "a", "logit_bias": {"1": 1, "2": 2, "3": 3, "4": 4}, "max_tokens": 1}, "logit_bias"),
    ("--max-chat-messages", "/v1/chat/completions", {"messages": _message(4), "max_tokens": 1},
     {"messages": _message(5), "max_tokens": 1}, "messages"),
    ("--max-chat-messages", "/tokenize", {"messages": _message(4)}, {"messages": _message(5)}, "messages"),
]


@pytest.mark.parametrize("flag,path,at_limit,past_limit,param", LIMIT_CASES)
def test_each_limit_accepts_at_it_and_refuses_past_it_naming_the_flag(limited, flag, path, at_limit, past_limit,
                                                                      param):
    ok = httpx.post(limited.url + path, json=at_limit, timeout=60)
    assert ok.status_code == 200, ok.text
    error = assert_400_and_connection_survives(limited.port, path, json.dumps(past_limit).encode())
    assert flag in error["error"]["message"] and error["error"]["param"] == param, error


@pytest.mark.parametrize("declared", [True, False])
def test_the_body_size_limit_accepts_at_it_and_refuses_past_it(limited, declared):
    limit = LIMITS["--max-request-body-bytes"]
    body = {"prompt": "a", "max_tokens": 1}
    assert httpx.post(limited.url + "/v1/completions", content=_padded(body, limit),
                      headers={"Content-Type": "application/json"}).status_code == 200
    over = _padded(body, limit + 1)
    # Without a Content-Length (chunked) the limit is found while the body streams in.
    content = over if declared else iter([over[:1000], over[1000:]])
    r = httpx.post(limited.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "request_too_large"


def test_an_8_mb_body_gets_a_413_the_official_client_can_read(limited):
    """The client is still sending when the limit is found: the server reads the rest and drops
    it, so the answer arrives instead of a connection reset."""
    client = openai.OpenAI(base_url=limited.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=client.models.list().data[0].id, prompt="a" * (8 << 20), max_tokens=1)
    assert refused.value.status_code == 413 and "--max-request-body-bytes" in refused.value.message


# ------------------------------------------------------------------------- a responsive loop


@pytest.fixture(scope="module")
def default_limits(tmp_path_factory):
    # The server's default limits: the heaviest requests below are the largest they allow.
    srv = launch(tmp_path_factory.mktemp("defaults"), *DEFAULT_ARGS)
    yield srv
    srv.proc.stop()


class HealthPoller:
    """GETs `url` back to back in a thread and keeps the slowest answer."""

    def __init__(self, url: str):
        self.url, self.worst, self.count = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                assert client.get(self.url).status_code == 200
                self.worst = max(self.worst, time.perf_counter() - start)
                self.count += 1
                time.sleep(0.005)

    def __enter__(self) -> "HealthPoller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    """A trivial HTTP server in a process of its own: how long any process's answer may take on
    this machine at the moment (another test worker can hold both cores of a CI machine)."""
    port = free_port()
    proc = Proc([PYTHON, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                 "--directory", str(tmp_path_factory.mktemp("empty"))], tmp_path_factory.mktemp("control") / "log")
    url = f"http://127.0.0.1:{port}/"
    proc.wait_http(url, timeout=30)
    yield url
    proc.stop()


def test_health_answers_within_100ms_of_a_trivial_server_while_the_heaviest_requests_run(default_limits, control):
    from pagoda_engine.config import ServerConfig

    limits = ServerConfig()
    url = default_limits.url
    rng = random.Random(0)
    stops = ["".join(rng.choices(string.ascii_letters, k=rng.randint(8, 64))) for _ in range(2000)]
    heavy = {
        # 2,000 stop strings over a 200-token stream (generation ignores EOS so it runs long).
        "stops": {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stop": stops, "stream": True},
        # A prompt as large as the body limit allows (tokenized, then refused as too long).
        "max body": _prompt_body(limits.max_request_body_bytes),
        # As many sequences as one request may ask for.
        "fan-out": {"prompt": ["hi"] * (limits.max_sequences_per_request // 128), "n": 128, "max_tokens": 4},
    }
    with httpx.Client(timeout=300) as warm:  # first requests pay one-time costs (imports, caches)
        warm.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    results = {}

    def run(name, body):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        with httpx.Client(timeout=300) as client:
            r = client.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
            results[name] = (r.status_code, r.text)

    def heaviest_requests_once() -> tuple[HealthPoller, HealthPoller]:
        with HealthPoller(url + "/health") as poller, HealthPoller(control) as machine:
            time.sleep(0.3)
            threads = [threading.Thread(target=run, args=item) for item in heavy.items()]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        assert results["stops"][0] == 200 and "[DONE]" in results["stops"][1], results["stops"]
        assert results["max body"][0] == 400 and "maximum context length" in results["max body"][1], results["max body"]
        assert results["fan-out"][0] == 200 and len(json.loads(results["fan-out"][1])["choices"]) == \
            limits.max_sequences_per_request, results["fan-out"][1][:300]
        assert poller.count > 10 and machine.count > 10
        return poller, machine

    # /health within 100 ms beyond what the machine gave a trivial server in another process over
    # the same round (on a 2-core CI machine the other test worker can hold both cores: a fresh
    # clone's suite saw 650 ms there; alone it is 20-40 ms). A loop that stalls on this work stalls
    # in every round, the trivial server does not.
    rounds = []
    for _ in range(3):
        poller, machine = heaviest_requests_once()
        rounds.append((poller.worst, machine.worst))
        if poller.worst < 0.1 + machine.worst:
            break
    assert rounds[-1][0] < 0.1 + rounds[-1][1], "/health took " + ", ".join(
        f"{h * 1000:.0f} ms (a trivial server {m * 1000:.0f} ms)" for h, m in rounds) + " at worst in each round"

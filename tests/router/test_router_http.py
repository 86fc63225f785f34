"""`pagoda route` as a real process in front of real HTTP engines (fake_engine.py: the engine
server's wire surface, no model): passthrough, retries, failover, policies, the hold queue,
bad input and bad flags."""

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda_e2e import PYTHON, Proc, free_port, start_router

FAKE = str(Path(__file__).resolve().parents[2] / "e2e" / "local" / "fake_engine.py")


def start_fake(tmp: Path, name: str, model: str = "fake-model", token_delay: float = 0.005,
               port: int | None = None, wait: bool = True) -> tuple[Proc, str]:
    port = port or free_port()
    proc = Proc([PYTHON, FAKE, "--port", str(port), "--model", model, "--token-delay", str(token_delay)],
                tmp / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    if wait:
        proc.wait_http(url + "/health", timeout=30)
    return proc, url


def router(tmp: Path, backends: list[str], *extra: str, name: str = "router", wait: bool = True):
    port = free_port()
    proc = start_router(port, backends, tmp / f"{name}.log", ["--health-interval", "0.5", *extra], wait=wait)
    return proc, f"http://127.0.0.1:{port}"


def metric(base: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(name + (labels or "")) and (labels or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    a, url_a = start_fake(tmp, "a")
    b, url_b = start_fake(tmp, "b", model="other-model")
    c, url_c = start_fake(tmp, "c")
    yield {"urls": [url_a, url_b, url_c], "tmp": tmp, "procs": [a, b, c]}
    for p in (a, b, c):
        p.stop()


@pytest.fixture(scope="module")
def rr(pair):
    proc, base = router(pair["tmp"], pair["urls"], "--policy", "round-robin", name="rr")
    yield base
    proc.stop()


def test_stream_passes_through_byte_for_byte(pair, rr):
    direct = pair["urls"][0]
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 5, "stream": True}
    want = httpx.post(direct + "/v1/completions", json=body).content
    got = [httpx.post(rr + "/v1/completions", json=body) for _ in range(2)]
    assert all(r.status_code == 200 and r.content == want for r in got)
    assert got[0].headers["content-type"].startswith("text/event-stream")


def test_openai_client_streams_chat_through_the_router(pair, rr):
    client = openai.OpenAI(base_url=rr + "/v1", api_key="none")
    stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "t0 t1 t2 t3 "


def test_models_are_merged_and_requests_go_only_to_replicas_serving_the_model(pair, rr):
    ids = sorted(m["id"] for m in httpx.get(rr + "/v1/models").json()["data"])
    assert ids == ["fake-model", "other-model"]
    for _ in range(4):
        r = httpx.post(rr + "/v1/completions", json={"model": "other-model", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and r.headers["x-pagoda-backend"] == pair["urls"][1]
    served = {httpx.post(rr + "/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 1})
              .headers["x-pagoda-backend"] for _ in range(4)}
    assert served == {pair["urls"][0], pair["urls"][2]}  # round-robin over the two that serve it


def test_unknown_model_is_404_in_the_openai_shape(rr):
    r = httpx.post(rr + "/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-9" in err["message"]


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "fake-model"}).encode(), "prompt"),
    (json.dumps({"model": "fake-model", "prompt": "x", "max_tokens": -1}).encode(), "max_tokens"),
    (json.dumps({"model": "fake-model", "prompt": "x", "temperature": "hot"}).encode(), "temperature"),
])
def test_malformed_requests_are_rejected_at_the_router_with_the_engine_error_shape(pair, rr, body, param):
    before = sum(httpx.get(u + "/admin").json()["served"] for u in pair["urls"])
    r = httpx.post(rr + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert sum(httpx.get(u + "/admin").json()["served"] for u in pair["urls"]) == before  # no replica saw it


@pytest.mark.parametrize("content_type", ["text/plain", None])
def test_a_body_not_declared_as_json_is_a_415_at_the_router(pair, rr, content_type):
    before = sum(len(httpx.get(u + "/admin").json()["prompts"]) for u in pair["urls"])
    r = httpx.post(rr + "/v1/completions", content=json.dumps({"model": "fake-model", "prompt": "x"}),
                   headers={} if content_type is None else {"content-type": content_type})
    assert r.status_code == 415
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and "Only 'application/json' is allowed" in err["message"]
    assert sum(len(httpx.get(u + "/admin").json()["prompts"]) for u in pair["urls"]) == before  # no replica saw it


def test_health_and_metrics_of_the_router(pair, rr):
    h = httpx.get(rr + "/health").json()
    assert h["backends"] == 3 and h["ready_backends"] == 3
    httpx.post(rr + "/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 1, "stream": True})
    assert metric(rr, "pagoda_router:requests_total") >= 1
    assert metric(rr, "pagoda_router:time_to_first_token_seconds_count") >= 1
    assert metric(rr, "pagoda_router:backends_ready") == 3
    assert metric(rr, "pagoda_router:queue_length") == 0


def test_a_client_that_disconnects_mid_stream_frees_the_replica(tmp_path):
    slow, url = start_fake(tmp_path, "slow", token_delay=0.1)
    proc, base = router(tmp_path, [url])
    try:
        with httpx.stream("POST", base + "/v1/completions", json={"model": "fake-model", "prompt": "x",
                                                                   "max_tokens": 600, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert httpx.get(url + "/admin").json()["running"] == 1
        # the router closed its upstream stream: the engine stopped generating (it would run 60 s)
        deadline = time.monotonic() + 5
        while httpx.get(url + "/admin").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/admin").json()["running"] == 0
        assert metric(base, "pagoda_router:requests_total", f'{{backend="{url}",status="client_disconnected"}}') == 1
    finally:
        proc.stop()
        slow.stop()


def test_a_replica_failing_before_its_first_byte_is_retried_once_elsewhere(tmp_path):
    a, url_a = start_fake(tmp_path, "a")
    b, url_b = start_fake(tmp_path, "b")
    proc, base = router(tmp_path, [url_a, url_b], "--policy", "round-robin")
    try:
        httpx.post(url_a + "/admin", json={"fail_next": 1, "fail_status": 503})
        # round-robin sends one of the two requests to A first; A answers 503 once, B takes it
        for _ in range(2):
            r = httpx.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "t0 t1 "
            assert r.headers["x-pagoda-backend"] in (url_a, url_b)
        assert httpx.get(url_a + "/admin").json()["fail_next"] == 0
        assert metric(base, "pagoda_router:retries_total") == 1
        # both failing: one retry, then the second failure is the answer
        for url in (url_a, url_b):
            httpx.post(url + "/admin", json={"fail_next": 1, "fail_status": 503})
        assert httpx.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "x"}).status_code == 503
        assert metric(base, "pagoda_router:retries_total") == 2
        # a real 4xx/500 from the engine is not retried: it is the answer
        httpx.post(url_a + "/admin", json={"fail_next": 1, "fail_status": 500})
        httpx.post(url_b + "/admin", json={"fail_next": 1, "fail_status": 500})
        assert httpx.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "x"}).status_code == 500
        assert metric(base, "pagoda_router:retries_total") == 2
        httpx.post(url_a + "/admin", json={"fail_next": 0})
        httpx.post(url_b + "/admin", json={"fail_next": 0})
        # a replica that refuses connections (dead, health not yet polled) costs one retry, no error
        b.kill()
        codes = [httpx.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "x",
                                                             "max_tokens": 1}).status_code for _ in range(4)]
        assert codes == [200] * 4
    finally:
        for p in (proc, a, b):
            p.stop()


def test_a_request_whose_replica_failed_waits_for_another_that_is_not_ready_yet(tmp_path):
    """A replica refuses the connection (dead before a health poll noticed) while the only other
    one is not ready at that instant (a missed poll, a restart): the request is held until that
    one is ready, as when none is, not failed with a 502."""
    a, url_a = start_fake(tmp_path, "a")
    port_b = free_port()
    url_b = f"http://127.0.0.1:{port_b}"
    proc, base = router(tmp_path, [url_a, url_b], "--health-interval", "30", "--queue-timeout", "60")
    try:
        deadline = time.monotonic() + 10
        while [b["ready"] for b in httpx.get(base + "/router/backends").json()["backends"]] != [True, False]:
            assert time.monotonic() < deadline, "A ready and B not, in the router"
            time.sleep(0.05)
        a.kill()  # the next poll is 30 s away: the router still counts A ready
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            future = ex.submit(httpx.post, base + "/v1/completions",
                               json={"model": "fake-model", "prompt": "x", "max_tokens": 2}, timeout=60)
            deadline = time.monotonic() + 10
            while metric(base, "pagoda_router:queue_length") < 1:
                assert time.monotonic() < deadline and not future.done(), "the request held after A failed"
                time.sleep(0.05)
            b, _ = start_fake(tmp_path, "b", port=port_b)
            r = future.result(timeout=30)
        assert r.status_code == 200 and r.headers["x-pagoda-backend"] == url_b
        assert r.json()["choices"][0]["text"] == "t0 t1 "
        b.stop()
    finally:
        for p in (proc, a):
            p.stop()


def test_a_replica_stays_ready_through_one_health_poll_that_times_out_not_two(tmp_path):
    """--health-timeouts 2 (the default): a ready replica whose /health answers late once (a loaded
    replica) stays ready; twice in a row, it is taken out until it answers again."""
    a, url_a = start_fake(tmp_path, "a")
    # Polls every 0.2 s, each given 0.4 s.
    proc, base = router(tmp_path, [url_a], "--health-interval", "0.2")
    seen: list[bool] = []

    def ready_until_polled(slow: int) -> None:
        """The replica's readiness as the router sees it, sampled from `slow` late /health answers
        on until it has answered on time again for a while."""
        httpx.post(url_a + "/admin", json={"slow_health": slow, "health_delay": 1.0})
        deadline = time.monotonic() + 10
        while httpx.get(url_a + "/admin").json()["slow_health"]:
            assert time.monotonic() < deadline, "the slow polls made"
            seen.append(httpx.get(base + "/router/backends").json()["backends"][0]["ready"])
            time.sleep(0.02)
        until = time.monotonic() + 2.0  # the last slow poll times out (0.4 s), the next ones answer
        while time.monotonic() < until:
            seen.append(httpx.get(base + "/router/backends").json()["backends"][0]["ready"])
            time.sleep(0.02)

    try:
        deadline = time.monotonic() + 10
        while not httpx.get(base + "/router/backends").json()["backends"][0]["ready"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        ready_until_polled(1)
        assert all(seen), "one late poll took the replica out"
        seen.clear()
        ready_until_polled(2)
        assert False in seen and seen[-1] is True, seen  # out after the second, back once it answers
        r = httpx.post(base + "/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        for p in (proc, a):
            p.stop()


def test_killed_replica_fails_its_streams_clearly_and_the_survivor_takes_new_requests(tmp_path):
    a, url_a = start_fake(tmp_path, "a", token_delay=0.05)
    b, url_b = start_fake(tmp_path, "b", token_delay=0.05)
    proc, base = router(tmp_path, [url_a, url_b], "--policy", "round-robin")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)

    def stream_one(i):
        # 40 tokens x 50 ms = 2 s: the kill lands mid-stream
        with httpx.stream("POST", base + "/v1/completions", json={"model": "fake-model", "prompt": f"p{i}",
                                                                   "max_tokens": 40, "stream": True}) as r:
            backend = r.headers["x-pagoda-backend"]
            frames = [line for line in r.iter_lines() if line.startswith("data: ")]
        return backend, frames

    try:
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(stream_one, i) for i in range(8)]
            time.sleep(0.8)
            a.kill()
            results = [f.result(timeout=30) for f in futures]
        for backend, frames in results:
            if backend == url_a:  # cut off: some tokens, then one clear error frame, no [DONE]
                err = json.loads(frames[-1][6:])["error"]
                assert err["code"] == "backend_stream_error" and url_a in err["message"]
                assert 0 < len(frames) - 1 < 40
            else:
                assert len(frames) == 41 and frames[-1] == "data: [DONE]"
        assert {b for b, _ in results} == {url_a, url_b}
        # new requests, started after the kill: all succeed on the survivor, no 5xx
        for _ in range(6):
            out = client.completions.create(model="fake-model", prompt="after", max_tokens=3)
            assert out.choices[0].text == "t0 t1 t2 "
        assert metric(base, "pagoda_router:requests_total", f'{{backend="{url_a}",status="stream_error"}}') >= 1
    finally:
        for p in (proc, a, b):
            p.stop()


def test_held_requests_are_released_when_a_replica_comes_up(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, base = router(tmp_path, [url], "--queue-timeout", "60")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            futures = [ex.submit(httpx.post, base + "/v1/completions",
                                 json={"model": "fake-model", "prompt": f"q{i}", "max_tokens": 2}, timeout=60)
                       for i in range(3)]
            deadline = time.monotonic() + 10
            while metric(base, "pagoda_router:queue_length") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert metric(base, "pagoda_router:queue_length") == 3
            assert metric(base, "pagoda_router:requests_waiting_for_backend") == 3
            assert not any(f.done() for f in futures)
            fake, _ = start_fake(tmp_path, "late", port=port)
            results = [f.result(timeout=30) for f in futures]
        assert [r.status_code for r in results] == [200, 200, 200]
        assert metric(base, "pagoda_router:queue_length") == 0
        fake.stop()
    finally:
        proc.stop()


def test_held_requests_time_out_with_503_and_retry_after(tmp_path):
    proc, base = router(tmp_path, [f"http://127.0.0.1:{free_port()}"], "--queue-timeout", "1",
                        "--retry-after", "7")
    try:
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        assert 0.9 < time.monotonic() - t0 < 5
        assert r.json()["error"]["code"] == "no_backend_available"
        assert metric(base, "pagoda_router:queue_timeouts_total") == 1
    finally:
        proc.stop()


def test_a_full_hold_queue_answers_503_at_once(tmp_path):
    proc, base = router(tmp_path, [f"http://127.0.0.1:{free_port()}"], "--queue-size", "0")
    try:
        r = httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 503 and "retry-after" in r.headers and "queue is full" in r.json()["error"]["message"]
    finally:
        proc.stop()


@pytest.mark.parametrize("flags, message", [
    (["--backends", ""], "--backends is empty"),
    (["--backends", "grpc://10.0.0.1:9000"], "unsupported scheme 'grpc'"),
    (["--k8s-service", "no-namespace"], "expected NAMESPACE/NAME"),
    (["--backends", "http://127.0.0.1:9", "--health-timeouts", "0"], "--health-timeouts must be >= 1"),
])
def test_router_refuses_to_start_on_bad_backends(flags, message):
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.router.app", *flags], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.startswith("pagoda route: error:")


def test_an_oversized_body_gets_a_413_the_official_client_can_read(pair, rr):
    """An 8 MB prompt, past the router's default 4 MiB: the router reads and drops the rest, and
    answers in OpenAI's shape without costing a replica anything."""
    client = openai.OpenAI(base_url=rr + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="fake-model", prompt="a" * (8 << 20), max_tokens=1)
    assert refused.value.status_code == 413 and "--max-request-body-bytes" in refused.value.message
    assert refused.value.body["code"] == "request_too_large"


def test_past_max_waiting_per_model_requests_get_429_with_retry_after(tmp_path):
    a, url_a = start_fake(tmp_path, "a", token_delay=0.05)
    proc, base = router(tmp_path, [url_a], "--max-waiting-per-model", "3", "--retry-after", "7")
    try:
        body = {"model": "fake-model", "prompt": "p", "max_tokens": 20}  # whole responses: 1 s each, no headers before
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(lambda _: httpx.post(base + "/v1/completions", json=body, timeout=30), range(8)))
        refused = [r for r in answers if r.status_code == 429]
        assert len([r for r in answers if r.status_code == 200]) == 3 and len(refused) == 5
        for r in refused:
            assert r.headers["retry-after"] == "7"
            assert r.json()["error"]["code"] == "too_many_requests" and "--max-waiting-per-model" in r.text
        assert metric(base, "pagoda_router:waiting_rejected_total") == 5
        # Once the load is gone, requests go through again at once.
        assert httpx.post(base + "/v1/completions", json=dict(body, max_tokens=1)).status_code == 200
    finally:
        proc.stop()
        a.stop()

"""--max-waiting-requests: past the bound a new request is answered 429 with Retry-After in
OpenAI's shape (the official client raises RateLimitError), and the server recovers at once when
the load drops."""

import concurrent.futures

import httpx
import openai
import pytest

from conftest import launch
from pagoda_e2e import until
from streams import cores_paused


@pytest.fixture(scope="module")
def bounded(tmp_path_factory):
    # One sequence runs at a time, at most two wait.
    srv = launch(tmp_path_factory.mktemp("bounded"), "--model", "pagoda-tiny", "--num-kv-pages", "512",
                 "--max-num-seqs", "1", "--max-waiting-requests", "2")
    yield srv
    srv.proc.stop()


def test_a_full_waiting_queue_answers_429_with_retry_after(bounded):
    body = {"prompt": "a story", "max_tokens": 200, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(10) as ex:
        # The core is frozen while the ten go in: two wait, the other eight are refused however
        # slowly a loaded machine sends them.
        with cores_paused([bounded.proc.pid]):
            futures = [ex.submit(httpx.post, bounded.url + "/v1/completions", json=body, timeout=120)
                       for _ in range(10)]
            until(lambda: sum(f.done() for f in futures) >= 8, 60, "eight answers")
        answers = [f.result() for f in futures]
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert (len(ok), len(refused)) == (2, 8), [r.status_code for r in answers]
    for r in refused:
        assert r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "too_many_requests" and "--max-waiting-requests" in error["message"]
    assert f'pagoda:queue_rejected_total{{model_name="pagoda-tiny"}} {float(len(refused))}' in \
        httpx.get(bounded.url + "/metrics").text
    client = openai.OpenAI(base_url=bounded.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    # Idle again: served at once.
    assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].finish_reason == "length"


def test_the_official_client_reads_the_429_as_a_rate_limit(bounded):
    client = openai.OpenAI(base_url=bounded.url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    body = {"prompt": "a story", "max_tokens": 1000, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        busy = [ex.submit(httpx.post, bounded.url + "/v1/completions", json=body, timeout=120) for _ in range(3)]
        # One runs, two wait: the queue is full.
        until(lambda: _gauge(bounded.url, "pagoda:num_requests_waiting") >= 2, 30, "two waiting")
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=model, prompt="one more", max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "1"
        assert [f.result().status_code for f in busy] == [200] * 3


def _gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0

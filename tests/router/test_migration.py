"""No request lost to a dying replica: three real `pagoda serve` engines (built-in tiny model)
behind a real `pagoda route`; many streamed requests (chat and completions, greedy and seeded
sampling, some with a JSON schema, some whole responses) run once undisturbed and once while one engine is SIGKILLed and another SIGTERMed
(its drain deadline ends what it still runs). Every stream of the disturbed run must complete
with the undisturbed run's text and token ids, each token once, one finish and one usage."""

import concurrent.futures
import contextlib
import json
import os
import signal
import threading

import httpx
import pytest

from pagoda_e2e import routed_engines, start_engine, until
from streams import Progress, assert_whole, cores_paused, metric, read, run_all, until_engine, until_in_flight

# Long enough (ignore_eos), and few enough sequences at a time (the rest queue), that each engine
# still has streams running and waiting when it goes, however fast the machine: the SIGKILL cuts
# some, the SIGTERMed engine's drain deadline (0.5 s) ends others.
MAX_TOKENS = 192
ENGINE = ["--model", "pagoda-tiny", "--num-kv-pages", "512", "--max-num-seqs", "2", "--drain-timeout", "0.5"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with routed_engines(tmp_path_factory.mktemp("migration"), 3, ENGINE,
                        ["--health-interval", "0.5", "--policy", "round-robin"]) as state:
        yield state


def _requests(n: int) -> list[tuple[str, dict]]:
    """Streams, and every seventh a whole response (retried whole when its replica fails)."""
    out = []
    for i in range(n):
        chat = i % 2 == 0
        body: dict = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": i % 7 != 6}
        body.update({"temperature": 0} if i % 3 else {"temperature": 0.9, "seed": 1000 + i})
        if i % 4 == 1 and body["stream"]:
            body["stream_options"] = {"include_usage": True}
        if i % 5 == 2:
            body["return_token_ids"] = True
        if i % 8 == 3:  # a JSON schema: the continuation's grammar replays what was streamed
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "fox", "schema": {
                "type": "object", "properties": {"name": {"type": "string"}, "story": {"type": "string"}},
                "required": ["name", "story"]}}}
            body["ignore_eos"] = False
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell story number {i} about a fox."}]
        else:
            body["prompt"] = f"Story {i}: once upon a time"
        out.append(("/v1/chat/completions" if chat else "/v1/completions", body))
    return out


def test_streams_survive_a_sigkill_and_a_sigterm(stack):
    base = stack["router"]
    reqs = _requests(30)
    reference = run_all(base, reqs)
    for got in reference:
        assert got["errors"] == [] and len(got["finishes"]) == 1, got

    def disturb(progress):
        # While streams run: one replica is told to stop (its drain deadline, 0.5 s, then ends
        # what it still runs or queues with an in-band error), another dies: the first goes while
        # it generates with streams queued behind, the second while it generates. The cores wait
        # until engine 1 holds eight of its ten streams (round-robin), so that every engine has
        # seconds of work queued however slowly the clients send (on a loaded machine each stream
        # could otherwise end before the next arrives).
        until_in_flight(base, stack["urls"][1], 8)
        paused.close()
        until_engine(stack["urls"][1], running=1, waiting=1)
        stack["engines"][1].popen.send_signal(signal.SIGTERM)
        until_engine(stack["urls"][0], running=1)
        stack["engines"][0].kill()

    with contextlib.ExitStack() as paused:
        paused.enter_context(cores_paused([e.pid for e in stack["engines"]]))
        disturbed = run_all(base, reqs, disturb)
    for (path, body), want, got in zip(reqs, reference, disturbed):
        assert_whole(path, body, want, got)
        if body.get("stream_options") and body["ignore_eos"]:
            assert got["usages"][0]["completion_tokens"] == MAX_TOKENS
    # Both ways of breaking happened: a connection cut (the SIGKILL) and the drain deadline's error.
    assert metric(base, "pagoda_router:migrations_total", '{cause="connection_error"}') >= 1
    assert metric(base, "pagoda_router:migrations_total", '{cause="drain_deadline"}') >= 1
    assert metric(base, "pagoda_router:continuation_tokens_total") > 0
    assert metric(base, "pagoda_router:stream_errors_total") == 0
    assert stack["engines"][1].popen.wait(30) == 0  # the SIGTERMed engine drained and exited cleanly



def test_a_rolling_replacement_under_load_loses_no_request(stack):
    """After the first test only engine 2 is left. Under steady load a replacement comes up on
    engine 0's port, then engine 2 is SIGTERMed (a rollout step: surge one, retire one). Every
    request completes, greedy ones with the text an idle engine gives."""
    base, urls, engines = stack["router"], stack["urls"], stack["engines"]
    reqs = [(path, dict(body, max_tokens=48)) for path, body in _requests(9)]
    results: list[tuple[int, dict]] = []
    stop = threading.Event()
    progress = Progress()

    def load(worker: int):
        i = worker
        while not stop.is_set():
            path, body = reqs[i % len(reqs)]
            results.append((i % len(reqs), read(base, path, body, progress)))
            i += 3

    def ready() -> list[str]:
        return [b["url"] for b in httpx.get(base + "/router/backends").json()["backends"] if b["ready"]]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        workers = [pool.submit(load, w) for w in range(3)]
        engines[0] = start_engine(int(urls[0].rsplit(":", 1)[1]), engines[2].log_path.parent / "engine0-new.log",
                                  ENGINE)
        until(lambda: urls[0] in ready(), 30, "the new replica ready")
        until(lambda: len(results) >= 3, 30, "load on both")
        assert engines[2].stop() == 0  # SIGTERM: drains (0.5 s); the router continues what it cut
        until(lambda: len(results) >= 12, 60, "load after the rollout step")
        stop.set()
        for w in workers:
            w.result()
    undisturbed = {}
    for i, got in results:
        path, body = reqs[i]
        where = f"{path} {body}"
        assert got["errors"] == [] and got["done"] == 1 and len(got["finishes"]) == 1, where
        assert len(got["ids"]) == 1, where
        if body.get("temperature") == 0:
            if i not in undisturbed:
                undisturbed[i] = read(base, path, body, progress)["text"]
            assert got["text"] == undisturbed[i], where
    assert metric(base, "pagoda_router:stream_errors_total") == 0


def _revive(stack) -> None:
    """Every engine of the stack running again (earlier tests kill and retire some), each ready
    in the router."""
    tmp = stack["engines"][0].log_path.parent
    for i, url in enumerate(stack["urls"]):
        if not stack["engines"][i].alive():
            stack["engines"][i] = start_engine(int(url.rsplit(":", 1)[1]), tmp / f"engine{i}-revived.log", ENGINE)

    def all_ready() -> bool:
        backends = httpx.get(stack["router"] + "/router/backends").json()["backends"]
        return sum(b["ready"] for b in backends) == len(stack["urls"])

    until(all_ready, 60, "every replica ready in the router")


NOT_CONTINUED = [
    ("/v1/completions", {"prompt": "Story: once upon a time", "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a fox story."}], "n": 2}),
    ("/v1/completions", {"prompt": "Story: once upon a time", "echo": True}),
]


def test_streams_that_cannot_be_continued_end_with_one_error_event(stack):
    """n > 1 (choices at different points) and echo are not continued elsewhere: when their
    replica dies mid-stream the client gets one OpenAI error event after the tokens it had,
    never a silent cut, and the router counts each."""
    _revive(stack)
    base = stack["router"]
    errors_before = metric(base, "pagoda_router:stream_errors_total")
    with contextlib.ExitStack() as opened:
        streams = []
        for path, extra in NOT_CONTINUED:
            # Long (ignore_eos: some 1,500 steps) so that it is still running when its replica goes.
            body = {"model": "pagoda-tiny", "max_tokens": 1500, "ignore_eos": True, "stream": True, **extra}
            r = opened.enter_context(httpx.stream("POST", base + path, json=body, timeout=120))
            assert r.status_code == 200, r.read()
            lines, frames = r.iter_lines(), []
            for line in lines:  # a few chunks through
                if line.startswith("data: "):
                    frames.append(line[6:])
                if len(frames) == 3:
                    break
            backend = r.headers["x-pagoda-backend"]
            # Frozen at once (its whole process group), so it cannot finish the stream while the
            # others open, however fast it generates; round-robin sends the next stream elsewhere.
            os.killpg(stack["engines"][stack["urls"].index(backend)].pid, signal.SIGSTOP)
            streams.append((backend, lines, frames))
        assert len({backend for backend, _, _ in streams}) == len(streams), "one stream a replica"
        for backend, _, _ in streams:  # then the replicas serving them die
            stack["engines"][stack["urls"].index(backend)].kill()
        for backend, lines, frames in streams:
            frames += [line[6:] for line in lines if line.startswith("data: ")]
            chunks = [json.loads(f) for f in frames if f != "[DONE]"]
            errors = [c["error"] for c in chunks if "error" in c]
            assert "[DONE]" not in frames and len(errors) == 1 and "error" in chunks[-1], frames[-3:]
            assert errors[0]["code"] == "backend_stream_error" and backend in errors[0]["message"], errors
            assert {"message", "type", "param", "code"} <= set(errors[0])
            assert not any(ch.get("finish_reason") for c in chunks for ch in c.get("choices") or ())  # it was cut
    assert metric(base, "pagoda_router:stream_errors_total") == errors_before + len(NOT_CONTINUED)

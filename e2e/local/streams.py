"""Reading OpenAI responses through a router as a client does, for the tests that disturb the
replicas under it (tests/router/test_migration.py, e2e/local/test_no_request_lost.py): each
response reduced to what must not change when a replica dies (text, tool calls, finishes, token
ids, usage) and to what shows a bad splice (frames after [DONE], error frames, several ids or role
chunks), and the checks that a disturbed response is the undisturbed one."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx


class Progress:
    """Frames read so far by all clients."""

    def __init__(self):
        self.frames, self.lock = 0, threading.Lock()

    def add(self) -> None:
        with self.lock:
            self.frames += 1


def _calls(pieces) -> list[dict]:
    """Tool calls from streamed pieces (by index: name once, arguments in parts) or whole ones."""
    calls: dict[int, dict] = {}
    for i, piece in enumerate(pieces):
        index = piece.get("index", i)
        call = calls.setdefault(index, {"name": None, "arguments": ""})
        function = piece.get("function") or {}
        call["name"] = call["name"] or function.get("name")
        call["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


def read(base: str, path: str, body: dict, progress: Progress | None = None, timeout: float = 120) -> dict:
    """The response to `body` at `path`, as the facts a disturbance must leave alone (a whole
    response: the same facts from its one body), and a stream's time to its first frame."""
    chat = path.endswith("chat/completions")
    if not body.get("stream"):
        r = httpx.post(base + path, json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        got = r.json()
        choice = got["choices"][0]
        message = choice.get("message") or {}
        return {"done": 1, "last_is_done": True, "errors": [], "ids": {got["id"]}, "roles": 1,
                "text": (message.get("content") or "") if chat else choice["text"],
                "calls": _calls(message.get("tool_calls") or []),
                "finishes": [choice["finish_reason"]], "usages": [got["usage"]] if body.get("stream_options") else [],
                "token_ids": choice.get("token_ids") or [], "has_token_ids": "token_ids" in choice}
    frames = []
    started, ttft = time.monotonic(), None
    with httpx.stream("POST", base + path, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        backend = r.headers.get("x-pagoda-backend")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if ttft is None:
                ttft = time.monotonic() - started
            frames.append(line[6:])
            if progress is not None:
                progress.add()
    chunks = [json.loads(f) for f in frames if f != "[DONE]"]
    choices = [ch for c in chunks for ch in c.get("choices") or ()]
    return {
        "done": frames.count("[DONE]"), "last_is_done": bool(frames) and frames[-1] == "[DONE]",
        "errors": [c for c in chunks if "error" in c],
        "text": "".join((ch["delta"].get("content") or "") if chat else ch["text"] for ch in choices),
        "calls": _calls([p for ch in choices for p in (ch.get("delta") or {}).get("tool_calls") or ()]),
        "finishes": [ch["finish_reason"] for ch in choices if ch.get("finish_reason")],
        "usages": [c["usage"] for c in chunks if c.get("usage")],
        "ids": {c.get("id") for c in chunks if "error" not in c},
        "roles": sum(1 for ch in choices if (ch.get("delta") or {}).get("role")),
        "token_ids": [t for ch in choices for t in ch.get("token_ids") or ()],
        "has_token_ids": any("token_ids" in ch for ch in choices),
        "ttft": ttft,  # seconds to the first frame
        "backend": backend,  # the replica a router sent it to first
    }


def run_all(base: str, reqs: list[tuple[str, dict]], disturb=None, workers: int | None = None) -> list[dict]:
    """Every request at once (or `workers` at a time), `disturb(progress)` called meanwhile."""
    progress = Progress()
    with concurrent.futures.ThreadPoolExecutor(workers or len(reqs)) as pool:
        futures = [pool.submit(read, base, path, body, progress) for path, body in reqs]
        if disturb is not None:
            disturb(progress)
        return [f.result() for f in futures]


def assert_whole(path: str, body: dict, want: dict, got: dict) -> None:
    """`got` (a disturbed run's response) is `want` (the undisturbed one's), delivered once: every
    token once, one finish, one response id, one role chunk, one usage when asked for."""
    where = f"{path} {body}"
    assert got["errors"] == [], (where, got["errors"])
    assert got["done"] == 1 and got["last_is_done"], where
    assert got["finishes"] == want["finishes"] and len(got["finishes"]) == 1, where
    assert len(got["ids"]) == 1, where  # one response id across the splice
    if path.endswith("chat/completions"):
        assert got["roles"] == 1, where
    assert got["text"] == want["text"], where
    assert got["calls"] == want["calls"], where
    asked_usage = bool(body.get("stream_options"))
    assert got["usages"] == ([want["usages"][0]] if asked_usage else []), where
    assert got["has_token_ids"] == bool(body.get("return_token_ids")), where
    if body.get("return_token_ids"):
        assert got["token_ids"] == want["token_ids"], where


def metric(base: str, name: str, labels: str = "") -> float:
    return metric_text(httpx.get(base + "/metrics", timeout=10).text, name, labels)


def metric_text(text: str, name: str, labels: str = "") -> float:
    """The sum of a Prometheus text exposition's samples of `name` whose labels start with `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + labels) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def until_engine(url: str, running: int = 1, waiting: int = 0, timeout: float = 60) -> None:
    """Until the engine at `url` reports at least `running` running and `waiting` waiting requests
    (read from the engine itself: clients lag behind it)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        if (metric_text(text, "pagoda:num_requests_running") >= running
                and metric_text(text, "pagoda:num_requests_waiting") >= waiting):
            return
        assert time.monotonic() < deadline, f"{url} never had {running} running and {waiting} waiting"
        time.sleep(0.01)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (Linux: /proc's children lists), nearest first."""
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop(0)}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            out += children
            todo += children
    return out


@contextlib.contextmanager
def cores_paused(engine_pids: list[int]):
    """Each engine's core (every process below its `pagoda serve`) frozen with SIGSTOP while the
    block runs, its HTTP server still up: the streams routed to it meanwhile wait for the core,
    which finds them all queued when it resumes (SIGCONT). So an engine has streams running and
    waiting however slowly a loaded machine's clients send them."""
    frozen = [p for pid in engine_pids for p in _descendants(pid)]
    for p in frozen:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)


def until_in_flight(router: str, url: str, count: int, timeout: float = 60) -> None:
    """Until the router has at least `count` requests in flight on the backend at `url`."""
    deadline = time.monotonic() + timeout
    while True:
        backends = httpx.get(router + "/router/backends", timeout=10).json()["backends"]
        if next(b["in_flight"] for b in backends if b["url"] == url) >= count:
            return
        assert time.monotonic() < deadline, f"the router never had {count} requests in flight on {url}"
        time.sleep(0.01)

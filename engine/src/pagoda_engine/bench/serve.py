"""`pagoda bench serve`: workload S1 of docs/benchmarks.md — the OpenAI server under a Poisson load.

Requests (1024-token token-id prompts, 128 output tokens, temperature 1.0, `ignore_eos`,
streamed) arrive with exponential gaps at `--request-rate` per second (`inf`: all at once), each
on its own connection; the client records when every streamed chunk arrives. Reported: time to
first token (TTFT), inter-token latency (ITL: the gaps between chunks), time per output token
after the first (TPOT), end-to-end latency — mean, p50, p90 and p99 — request and token throughput,
and, against a Pagoda server, from its own /metrics: the mean TTFT split into queue time (arrival
at the core to first schedule), prefill time (to the first token) and the rest (API process, hops,
client), plus bounds on the queue time's p50/p99 (vLLM's buckets: 0.3, 0.5, 0.8, 1, ... s), and the
CPU time per request and per streamed token of the API process (when this run started it) and of
the load client itself (a lean HTTP/1.1 + SSE reader, so that its own lag stays small).

`--rates 4,8,16,24,32` sweeps several rates against one server start: one run per rate, in order,
each with the same seeded arrivals and prompts of its own (the k-th run's seeded by k), so that no
run finds the previous one's prompts in the prefix cache, then one table with a row per rate. Each
run prints the prefix cache's hits over it (the server's counters), which stay near none.

`--json-schema-fields N` attaches one fixed JSON schema of N fields (`bench_json_schema`) to every
request (`response_format: json_schema`), to measure structured outputs' cost; a server this
benchmark starts then gets the byte-level synthetic tokenizer (`--synthetic-tokenizer bytes`),
in which JSON can be written; pass that flag alone for the unconstrained baseline.

`--profile` profiles the engine under the load, as vLLM's benchmark does: POST /start_profile
before a rate's requests and /stop_profile after them, on a server started here with a profiler
config (`--profiler-config`, or one writing to `--profile-dir`), or on a `--base-url` server started
with one. `--profile-rates` picks the rates of a sweep to profile and `--profile-window START,DURATION`
a window of each (seconds from its first request): a whole run at a high rate is thousands of
steps, too big a trace. Every rank's trace and summary paths are printed at the end. A profiled
run's figures carry the profiler's cost and the pause while the ranks write their traces: take
the timings from runs without it.

The server is either one already running (`--base-url`, e.g. a Pagoda router or any
OpenAI-compatible server) or, by default, `pagoda serve` started here with the engine flags given
(the same defaults as the offline benchmarks: Llama-3.1-8B's architecture, dummy weights) in a
process of its own, and stopped (SIGTERM: drain, then exit) when the run ends.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec
import numpy as np

from pagoda_engine.api.server.api_server import http_stack, run_event_loop
from pagoda_engine.bench.workloads import fixed_lengths
from pagoda_engine.config import add_server_args
from pagoda_engine import envs

S1_INPUT_LEN, S1_OUTPUT_LEN = 1024, 128


S1_REQUEST_RATE = 10.0


def add_serve_arguments(p: argparse.ArgumentParser, s1: bool = True) -> None:
    """The flags of benchmarks against a server; with `s1`, also those only S1 (`bench serve`) reads."""
    p.add_argument("--base-url", default=None,
                   help="benchmark this running server (http://host:port) instead of starting `pagoda serve`")
    p.add_argument("--request-rate", type=float, default=None,
                   help=f"mean requests per second of the Poisson arrivals (default: {S1_REQUEST_RATE:g} for S1, 4 "
                        "turns/s for M1); inf sends every request at once")
    p.add_argument("--served-model", default=None,
                   help="the `model` field of the requests (default: the server's first /v1/models entry)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids of the prompts are drawn below this (default: config.json of --model)")
    add_server_args(p, only=("api_server_count",))  # passed on to the server this run starts (`_server_args`)
    if not s1:
        return
    p.add_argument("--rates", type=_rate_list, default=None, metavar="R1,R2,...",
                   help="sweep these request rates against one server start, one run each (instead of "
                        "--request-rate)")
    p.add_argument("--json-schema-fields", type=int, default=0,
                   help="attach a fixed JSON schema of this many fields to every request (response_format "
                        "json_schema); 0 = unconstrained")
    p.add_argument("--profile", action="store_true",
                   help="torch.profiler on the engine under the load: /start_profile before each rate's requests "
                        "and /stop_profile after them (the server needs a profiler config; one started here gets "
                        "one writing to --profile-dir, without Python stacks, unless --profiler-config is given)")
    p.add_argument("--profile-dir", default=None,
                   help="where a server started here writes its traces (default: profile/ beside --output-json, "
                        "else a new temporary directory)")
    p.add_argument("--profile-rates", type=_rate_list, default=None, metavar="R1,R2,...",
                   help="with --profile and --rates: profile only these rates of the sweep (default: all)")
    p.add_argument("--profile-window", type=_profile_window, default=None, metavar="START_S,DURATION_S",
                   help="with --profile: record only from START_S after a rate's first request for DURATION_S "
                        "(default: the whole run)")
    p.add_argument("--save-detailed", action="store_true",
                   help="with --output-json: also write every request of every rate (its arrival in the run, "
                        "TTFT, inter-token latencies, E2E, output tokens, error), as vLLM's flag does")
    p.add_argument("--synthetic-tokenizer", choices=("words", "bytes"), default=None,
                   help="for a model directory without a tokenizer: every id one word `<id>` (words), or a "
                        "byte-level vocabulary in which JSON can be written (bytes; the default with "
                        "--json-schema-fields)")


def bench_json_schema(num_fields: int, output_len: int) -> dict:
    """A fixed object schema of `num_fields` required fields, cycling through a bounded integer, a
    string and a three-value enum. The strings are long enough (8 characters per output token in
    all, more than any synthetic token holds) that no output is complete within `output_len`
    tokens: like the unconstrained run, every request writes all its tokens (`ignore_eos` cannot
    stretch a finished grammar)."""
    num_strings = len(range(1, num_fields, 3))
    length = -(-8 * output_len // max(num_strings, 1))
    kinds = [{"type": "integer", "minimum": 0, "maximum": 1000},
             {"type": "string", "minLength": length, "maxLength": length}, {"enum": ["red", "green", "blue"]}]
    properties = {f"field_{i}": kinds[i % 3] for i in range(num_fields)}
    if num_strings == 0:  # one field: make it the string
        properties = {"field_0": kinds[1]}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _rate_list(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, e.g. 4,8,16; got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"every rate must be > 0 (or inf); got {text!r}")
    return rates


def _profile_window(text: str) -> tuple[float, float]:
    start, sep, duration = text.partition(",")
    try:
        window = float(start), float(duration)
    except ValueError:
        window = (-1.0, 0.0)
    if not sep or not (window[0] >= 0 and 0 < window[1] < math.inf):
        raise argparse.ArgumentTypeError(f"expected START_S,DURATION_S with START_S >= 0 and DURATION_S > 0, "
                                         f"got {text!r}")
    return window


def arrival_offsets(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process of `rate`
    requests per second (exponential gaps, the first request at 0), its gaps scaled so that the
    sample offers exactly `rate` (the last request at (n - 1) / rate): a seeded sample of a few
    hundred gaps strays by up to ±10% (seed 0 of 400 offers 0.89 × the rate), which would make
    runs at the "same" rate differ in load. All 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    if num_requests > 1:
        gaps *= (num_requests - 1) / rate / gaps.sum()
    return np.cumsum(gaps).tolist()


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    first_choice: float = 0.0  # arrival of the first chunk with a choice, its text empty or not (a held-back byte)
    done: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""  # the streamed text, when asked to keep it

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent


def api_key_headers() -> dict[str, str]:
    """`Authorization: Bearer $OPENAI_API_KEY` when it is set (as vLLM's benchmark sends it), for
    a server or router that requires a key."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _one_request(client: httpx.AsyncClient, url: str, body: dict, delay: float, t0: float,
                       keep_text: bool = False) -> RequestResult:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    r = RequestResult(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:300]}"
                return r
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and not _take_event(r, time.perf_counter(), line[6:].encode(), keep_text):
                    break
        return _finish(r)
    except (httpx.HTTPError, ValueError) as e:  # ValueError: msgspec's DecodeError too
        r.error = f"{type(e).__name__}: {e}"
    return r


async def _one_stream(url: str, body: dict, delay: float, t0: float) -> RequestResult:
    """`_one_request` over a connection of its own, read by a lean HTTP/1.1 + SSE reader (the
    load client of `bench serve`): httpx spends more CPU per streamed chunk than the server's
    API process does, and a client that falls behind inflates the TTFT and ITL it measures."""
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    r = RequestResult(sent=time.perf_counter())
    parts = urlsplit(url)
    payload = msgspec.json.encode(body)
    writer = None
    auth = "".join(f"{k}: {v}\r\n" for k, v in api_key_headers().items())
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        writer.write(f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n{auth}"
                     f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
                     .encode() + payload)
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(head[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        if status != 200:
            text = b"".join([piece async for piece in _body_pieces(reader, chunked)]).decode(errors="replace")
            r.error = f"HTTP {status}: {text[:300]}"
            return r
        pending = b""
        async for piece in _body_pieces(reader, chunked):
            now = time.perf_counter()
            events = (pending + piece).split(b"\n\n")
            pending = events.pop()  # an event not yet complete
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: ") and not _take_event(r, now, line[6:], False):
                        return _finish(r)
        return _finish(r)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
        r.error = f"{type(e).__name__}: {e}"
        return r
    finally:
        if writer is not None:
            writer.close()


async def _body_pieces(reader: asyncio.StreamReader, chunked: bool):
    """A response body as it arrives: de-chunked (Transfer-Encoding: chunked), or up to the end
    of the connection."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after a chunk


def _take_event(r: RequestResult, now: float, data: bytes, keep_text: bool) -> bool:
    """Record one SSE `data:` payload that arrived at `now`; False when the stream ended
    ([DONE], or an error event)."""
    if data == b"[DONE]":
        return False
    chunk = msgspec.json.decode(data)
    if "error" in chunk:
        r.error = f"stream error: {chunk['error']}"
        return False
    choices = chunk.get("choices")
    if choices and not r.first_choice:
        r.first_choice = now
    if any(c.get("text") for c in choices or ()):
        r.chunk_times.append(now)
        if keep_text:
            r.text += "".join(c.get("text") or "" for c in choices)
    usage = chunk.get("usage")
    if usage:
        r.prompt_tokens = usage.get("prompt_tokens", 0)
        r.output_tokens = usage.get("completion_tokens", 0)
    return True


def _finish(r: RequestResult) -> RequestResult:
    if r.error is not None:
        return r
    r.done = time.perf_counter()
    if not r.chunk_times:
        r.error = "the stream carried no tokens"
        return r
    r.ok = True
    return r


def _percentiles(values: list[float], scale: float = 1e3) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values) * scale
    return {"mean": round(float(arr.mean()), 3),
            **{f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 90, 99)}}


# --- the server's own queue-time histogram -----------------------------------------------------------

QUEUE_TIME = "pagoda:request_queue_time_seconds"  # arrival at the core to the first schedule
PREFILL_TIME = "pagoda:request_prefill_time_seconds"  # first schedule to the first token
SERVER_TTFT = "pagoda:time_to_first_token_seconds"  # arrival at the API server to the first token
PREFIX_QUERIES, PREFIX_HITS = "pagoda:prefix_cache_queries_total", "pagoda:prefix_cache_hits_total"  # tokens


@dataclass
class ServerHistograms:
    """What one scrape of a Pagoda server's /metrics says about the requests so far, summed over
    every label set (models, data-parallel engines): the queue-time buckets (cumulative counts by
    upper bound), and the sums and counts of the queue and prefill times."""

    queue_buckets: dict[float, float] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    prefix_cache: dict[str, float] = field(default_factory=dict)  # queries and hits so far, in tokens

    def mean_ms_since(self, before: ServerHistograms, name: str) -> float | None:
        n = self.counts.get(name, 0.0) - before.counts.get(name, 0.0)
        return round((self.sums.get(name, 0.0) - before.sums.get(name, 0.0)) / n * 1e3, 3) if n > 0 else None


def server_histograms(metrics_text: str) -> ServerHistograms:
    from prometheus_client.parser import text_string_to_metric_families

    h = ServerHistograms()
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{QUEUE_TIME}_bucket":
                le = float(sample.labels["le"])
                h.queue_buckets[le] = h.queue_buckets.get(le, 0.0) + sample.value
            if sample.name in (PREFIX_QUERIES, PREFIX_HITS):
                h.prefix_cache[sample.name] = h.prefix_cache.get(sample.name, 0.0) + sample.value
            for name in (QUEUE_TIME, PREFILL_TIME, SERVER_TTFT):
                if sample.name == f"{name}_sum":
                    h.sums[name] = h.sums.get(name, 0.0) + sample.value
                elif sample.name == f"{name}_count":
                    h.counts[name] = h.counts.get(name, 0.0) + sample.value
    return h


def histogram_quantile_bound(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The upper bound of the bucket that holds the q-th quantile of the observations made between
    two scrapes: the quantile is at most this. (Interpolating inside a bucket, as Prometheus'
    `histogram_quantile` does, invents precision: vLLM's queue-time buckets start at 0.3 s.) None
    when nothing was observed or the quantile lies beyond the last finite bound."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    for bound, count in zip(bounds, counts):
        if count >= rank:
            return None if math.isinf(bound) else bound
    return None


def _scrape(base_url: str) -> ServerHistograms | None:
    """None when the server publishes no queue-time histogram (not a Pagoda engine)."""
    try:
        resp = httpx.get(f"{base_url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    h = server_histograms(resp.text)
    return h if h.queue_buckets else None


def server_breakdown(before: ServerHistograms | None, after: ServerHistograms | None, ttft_mean_ms: float | None) -> dict:
    """Where the mean TTFT went, from the server's own sums: queued in the core, prefill (first
    schedule to first token: the steps the prompt spans), the rest inside the server (the API
    process: parsing, tokenization, the hops to the core and back (including the wait for the
    core to look at its input), detokenization), and the rest outside it (HTTP, SSE, the client)."""
    keys = ("queue_p50_le_ms", "queue_p99_le_ms", "queue_mean_ms", "prefill_mean_ms", "api_mean_ms",
            "client_mean_ms", "rest_mean_ms", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")
    if before is None or after is None:
        return dict.fromkeys(keys)
    queue, prefill = after.mean_ms_since(before, QUEUE_TIME), after.mean_ms_since(before, PREFILL_TIME)
    server_ttft = after.mean_ms_since(before, SERVER_TTFT)
    api = client = rest = None
    if None not in (queue, prefill, ttft_mean_ms):
        rest = round(ttft_mean_ms - queue - prefill, 3)
        if server_ttft is not None:
            api, client = round(server_ttft - queue - prefill, 3), round(ttft_mean_ms - server_ttft, 3)
    return {"queue_p50_le_ms": _ms(histogram_quantile_bound(0.5, before.queue_buckets, after.queue_buckets)),
            "queue_p99_le_ms": _ms(histogram_quantile_bound(0.99, before.queue_buckets, after.queue_buckets)),
            "queue_mean_ms": queue, "prefill_mean_ms": prefill, "api_mean_ms": api, "client_mean_ms": client,
            "rest_mean_ms": rest,
            "prefix_cache_queried_tokens": int(after.prefix_cache.get(PREFIX_QUERIES, 0.0)
                                               - before.prefix_cache.get(PREFIX_QUERIES, 0.0)),
            "prefix_cache_hit_tokens": int(after.prefix_cache.get(PREFIX_HITS, 0.0)
                                           - before.prefix_cache.get(PREFIX_HITS, 0.0))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpots = [(r.done - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration, 3),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "requests_per_s": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(out_tokens / duration, 1),
        "total_tokens_per_s": round((in_tokens + out_tokens) / duration, 1),
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "tpot_ms": _percentiles(tpots),
        "itl_ms": _percentiles(itls),
        "e2e_ms": _percentiles([r.e2e for r in ok]),
    }


async def _post_profile(client: httpx.AsyncClient, base_url: str, route: str) -> dict:
    resp = await client.post(f"{base_url}/{route}")
    if resp.status_code == 404:
        raise RuntimeError(f"{base_url} has no /{route}: start the server with --profiler-config")
    if resp.status_code != 200:
        raise RuntimeError(f"POST /{route}: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


async def _until(deadline: float, done: asyncio.Event) -> bool:
    """Wait until `deadline` (perf_counter) or until `done` is set; whether it was set."""
    try:
        await asyncio.wait_for(done.wait(), max(0.0, deadline - time.perf_counter()))
    except asyncio.TimeoutError:
        pass
    return done.is_set()


async def _profile_in_window(client: httpx.AsyncClient, base_url: str, window: tuple[float, float], t0: float,
                             done: asyncio.Event) -> dict | None:
    """/start_profile `window[0]` s after t0, /stop_profile `window[1]` s later or when the run is
    done; None when the run was done before the window opened."""
    start_s, duration_s = window
    if await _until(t0 + start_s, done):
        return None
    await _post_profile(client, base_url, "start_profile")
    await _until(time.perf_counter() + duration_s, done)
    return await _post_profile(client, base_url, "stop_profile")


def request_details(results: list[RequestResult], t0: float) -> list[dict]:
    """Each request of a run, in arrival order: when it was sent (seconds into the run), its TTFT,
    inter-token latencies and E2E (ms), output tokens and error."""
    ms = lambda s: round(s * 1e3, 3)  # noqa: E731
    return [{"sent_s": round(r.sent - t0, 6), "ttft_ms": ms(r.ttft) if r.ok else None,
             "itl_ms": [ms(b - a) for a, b in zip(r.chunk_times, r.chunk_times[1:])] if r.ok else [],
             "e2e_ms": ms(r.e2e) if r.ok else None, "output_tokens": r.output_tokens, "error": r.error}
            for r in sorted(results, key=lambda r: r.sent)]


async def _drive(base_url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                 json_schema: dict | None = None, profile: bool = False,
                 profile_window: tuple[float, float] | None = None, detailed: bool = False) -> dict:
    """One rate's run; with `profile`, the engine profiled over it (or over `profile_window`);
    with `detailed`, every request's figures under "requests"."""
    offsets = arrival_offsets(len(prompts), rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    extra = ({"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": json_schema}}}
             if json_schema else {})
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, headers=api_key_headers()) as client:
        if json_schema:
            # Untimed: the server compiles the schema once (and builds its grammar tokenizer), as
            # a service serving it all day did long ago.
            warm_up = {"model": model, "prompt": prompts[0], "max_tokens": 1, **extra}
            (await client.post(f"{base_url}/v1/completions", json=warm_up)).raise_for_status()
        url = f"{base_url}/v1/completions"
        lean = urlsplit(url).scheme == "http"  # the lean reader speaks plain HTTP; httpx does TLS

        def request(prompt: list[int], offset: float, t0: float):
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 1.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
            return _one_stream(url, body, offset, t0) if lean else _one_request(client, url, body, offset, t0)

        if profile and profile_window is None:
            await _post_profile(client, base_url, "start_profile")
        done = asyncio.Event()
        t0 = time.perf_counter()
        windowed = (asyncio.create_task(_profile_in_window(client, base_url, profile_window, t0, done))
                    if profile and profile_window is not None else None)
        results = await asyncio.gather(*[request(prompt, offset, t0) for prompt, offset in zip(prompts, offsets)])
        duration = time.perf_counter() - t0
        done.set()
        profiled = None
        if windowed is not None:  # nothing recorded when the run ended before the window opened
            profiled = await windowed or {"traces": [], "summaries": []}
        elif profile:
            profiled = await _post_profile(client, base_url, "stop_profile")
    # Requests over the span of their arrivals: the rate asked for (arrival_offsets scales the
    # sample to it); served req/s also counts the tail after the last arrival.
    offered = (len(offsets) - 1) / offsets[-1] if offsets[-1] > 0 else float("inf")
    summary = {**summarize(results, duration), "offered_requests_per_s": round(offered, 3), "profile": profiled}
    if detailed:
        summary["requests"] = request_details(results, t0)
    return summary


# --- the server this benchmark starts ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_main(args: argparse.Namespace) -> None:
    from pagoda_engine import serve

    raise SystemExit(serve.run(args))


def _server_args(bench_args: argparse.Namespace, port: int) -> argparse.Namespace:
    """`pagoda serve`'s arguments: its defaults, the engine flags of this run, 127.0.0.1:port."""
    from pagoda_engine import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args([])
    for name in vars(args):
        if hasattr(bench_args, name):
            setattr(args, name, getattr(bench_args, name))
    args.host, args.port, args.log_level = "127.0.0.1", port, "warning"
    return args


def with_token_tokenizer(model_dir: str, byte_level: bool = False) -> str:
    """The model `model_dir` names (as `--model` does) if it has a tokenizer; else a cached copy
    of its config with a synthetic one.

    The prompts are token ids, but the server streams text, so it needs a tokenizer: the shipped
    benchmark configs have none (no downloads). The stand-in maps every id to one word `<id>` and
    back (a WordLevel model over the whole vocabulary), like dummy weights stand in for weights;
    with `byte_level`, a vocabulary in which a grammar can write JSON (`_byte_level_tokenizer`)."""
    from pagoda_engine.api.tokenizer import has_tokenizer
    from pagoda_engine.model_path import resolve_model_path
    from pagoda_engine.tiny import cache_dir

    src = Path(resolve_model_path(model_dir))  # pagoda-tiny, a directory or a .gguf file
    if has_tokenizer(src):
        return str(src)
    config = json.loads((src / "config.json").read_text())
    vocab_size = int(config["vocab_size"])
    digest = hashlib.blake2b((src / "config.json").read_bytes(), digest_size=8).hexdigest()
    dst = cache_dir() / "bench" / f"{src.name}-{digest}{'-bytes' if byte_level else ''}"
    if (dst / "tokenizer.json").is_file():
        return str(dst)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    for name in ("config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, tmp / name)
    eos = config.get("eos_token_id")
    eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int)]
    if byte_level:
        _byte_level_tokenizer(vocab_size, eos_ids).save_pretrained(str(tmp))
    else:
        words = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<0>",
                                eos_token=f"<{eos_ids[0]}>" if eos_ids else None).save_pretrained(str(tmp))
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared
    try:
        tmp.rename(dst)  # atomic: a concurrent run either finds it complete or makes its own
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _byte_level_tokenizer(vocab_size: int, eos_ids: list[int]):
    """A byte-level BPE vocabulary of `vocab_size` tokens (no merges: it only decodes, and tells a
    grammar engine each token's bytes): the 256 bytes, the EOS ids as special tokens, and the rest
    seeded random strings of 2-7 characters drawn from letters, digits, space and JSON punctuation,
    so that a JSON schema's mask has as many candidate tokens to sift as a real vocabulary's."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _gpt2_byte_chars()
    specials = {i: f"<|eos_{i}|>" for i in eos_ids if i >= 256}
    tokens = list(byte_chars)
    seen = set(tokens)
    rng = np.random.default_rng(0)
    alphabet = np.array(list('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 {}[]":,.-_'))
    while len(tokens) < vocab_size:
        if len(tokens) in specials:
            tokens.append(specials[len(tokens)])
            continue
        text = "".join(alphabet[rng.integers(len(alphabet), size=int(rng.integers(2, 8)))])
        token = "".join(byte_chars[b] for b in text.encode())
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=next(iter(specials.values()), None))


# The flags of a server started here that shape its steps, recorded with its figures
# (`--output-json`'s "server_flags"; None where the engine decides, as the command line's default).
_RECORDED_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "async_scheduling",
                   "step_launch_pacing", "cudagraph_mode", "enable_prefix_caching", "api_server_count")


class LaunchedServer:
    """`pagoda serve` in a process of its own (spawned: the engine starts CUDA in it)."""

    def __init__(self, bench_args: argparse.Namespace):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = multiprocessing.get_context("spawn").Process(
            target=_server_main, args=(_server_args(bench_args, self.port),), name="pagoda-bench-server")

    def start(self) -> float:
        """Start and wait for /health; returns the seconds it took."""
        timeout_s = envs.bench_server_timeout_s()
        t0 = time.monotonic()
        self.process.start()
        while time.monotonic() - t0 < timeout_s:
            if not self.process.is_alive():
                raise RuntimeError(f"pagoda serve exited with code {self.process.exitcode} before it was ready")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"pagoda serve was not ready within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGTERM)  # drains, stops its engine core, exits 0
            self.process.join(60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) process `pid` has used so far, from Linux's /proc; None
    elsewhere, once it is gone, or for no process."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def cpu_costs(api_cpu_s: float | None, client_cpu_s: float, summary: dict) -> dict:
    """CPU milliseconds per request and per streamed token of the API server process (when this
    run started a single one and could read its clock) and of this load client."""
    requests, tokens = summary["completed"], summary["output_tokens"]

    def per(cpu_s: float | None, n: int) -> float | None:
        return round(cpu_s * 1e3 / n, 4) if cpu_s is not None and n else None

    return {"api_cpu_s": None if api_cpu_s is None else round(api_cpu_s, 3),
            "api_cpu_ms_per_request": per(api_cpu_s, requests), "api_cpu_ms_per_token": per(api_cpu_s, tokens),
            "client_cpu_s": round(client_cpu_s, 3), "client_cpu_ms_per_request": per(client_cpu_s, requests),
            "client_cpu_ms_per_token": per(client_cpu_s, tokens)}


def _served_model(base_url: str) -> str:
    models = httpx.get(f"{base_url}/v1/models", timeout=30, headers=api_key_headers()).json()["data"]
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


def _vocab_size(args: argparse.Namespace) -> int:
    if args.vocab_size:
        return args.vocab_size
    from pagoda_engine.model_path import resolve_model_path
    from pagoda_engine.worker.model.loader import load_hf_config

    return int(load_hf_config(resolve_model_path(args.model)).vocab_size)


def run_serve(args: argparse.Namespace) -> dict:
    if args.rates and args.request_rate is not None:
        raise SystemExit("error: give --rates (a sweep) or --request-rate (one rate), not both")
    if args.request_rate is None:
        args.request_rate = S1_REQUEST_RATE
    if args.request_rate <= 0:
        raise SystemExit("error: --request-rate must be > 0 (or inf)")
    rates = args.rates or [args.request_rate]
    input_len, output_len = args.input_len or S1_INPUT_LEN, args.output_len or S1_OUTPUT_LEN
    num_prompts = args.num_prompts or 500
    if args.json_schema_fields < 0:
        raise SystemExit("error: --json-schema-fields must be >= 0")
    json_schema = bench_json_schema(args.json_schema_fields, output_len) if args.json_schema_fields else None
    profile_rates = _profile_plan(args, rates)
    if args.save_detailed and not args.output_json:
        raise SystemExit("error: --save-detailed writes into --output-json; give it a file")
    vocab = _vocab_size(args)
    server = None
    startup_s = None
    server_http = None  # what the server started here serves on (it shares this environment)
    server_flags = None  # the step-shaping flags it was started with (None where the engine decides)
    base_url = (args.base_url or "").rstrip("/")
    from pagoda_engine.api.tokenizer import has_tokenizer
    from pagoda_engine.model_path import resolve_model_path

    if args.synthetic_tokenizer and (base_url or has_tokenizer(resolve_model_path(args.model))):
        raise SystemExit("error: --synthetic-tokenizer is for a server this run starts on a model directory "
                         "without a tokenizer; this one " + ("is already running" if base_url else "has its own"))
    if not base_url:
        if args.served_model_name is None:
            args.served_model_name = Path(args.model).name
        if args.profile:
            args.profiler_config = _server_profiler_config(args)
        tokenizer = args.synthetic_tokenizer or ("bytes" if args.json_schema_fields else "words")
        args.model = with_token_tokenizer(args.model, byte_level=tokenizer == "bytes")
        server = LaunchedServer(args)
        startup_s = round(server.start(), 2)
        server_http = http_stack()
        server_flags = {name: getattr(args, name) for name in _RECORDED_FLAGS}
        base_url = server.url
    try:
        model = args.served_model or _served_model(base_url)
        print(f"=== pagoda bench serve: workload S1 ({num_prompts} requests x {input_len} input x {output_len} "
              f"output tokens, Poisson arrivals at {', '.join(f'{r:g}' for r in rates)} req/s) against "
              f"{base_url} (model {model!r}) ===")
        if startup_s is not None:
            print(f"started `pagoda serve` ({args.model}): ready in {startup_s} s, on the {server_http['event_loop']} "
                  f"event loop and the {server_http['http_parser']} HTTP parser")
        if json_schema:
            print(f"every request carries a JSON schema of {args.json_schema_fields} fields (response_format)")
        # The API process's CPU clock: the process started here, when it serves alone (with
        # --api-server-count > 1 it is a launcher and the API processes are its children).
        api_pid = server.process.pid if server is not None and args.api_server_count == 1 else None
        runs = []
        for k, rate in enumerate(rates):
            prompts = fixed_lengths("S1", vocab, num_prompts, input_len, output_len, seed=k).prompts
            before = _scrape(base_url)
            api_cpu_before, client_cpu_before = process_cpu_s(api_pid), time.process_time()
            summary = run_event_loop(_drive(base_url, model, prompts, output_len, rate, json_schema,
                                            profile=rate in profile_rates, profile_window=args.profile_window,
                                            detailed=args.save_detailed))
            client_cpu = time.process_time() - client_cpu_before
            api_cpu_after = process_cpu_s(api_pid)
            api_cpu = api_cpu_after - api_cpu_before if None not in (api_cpu_before, api_cpu_after) else None
            after = _scrape(base_url) if before is not None else None
            run = {"request_rate": rate, "num_requests": num_prompts, **summary,
                   "server": server_breakdown(before, after, summary["ttft_ms"]["mean"]),
                   "cpu": cpu_costs(api_cpu, client_cpu, summary)}
            if len(rates) > 1:
                print(f"--- {rate:g} req/s")
            _print(run)
            runs.append(run)
    finally:
        if server is not None:
            server.stop()
    common = {"bench": "serve", "workload": "S1",
              "standard_workload": args.num_prompts is None and args.input_len is None and args.output_len is None,
              "base_url": args.base_url, "model": model, "server_startup_s": startup_s, "server_http": server_http,
              "server_flags": server_flags,
              "json_schema_fields": args.json_schema_fields}
    if len(runs) == 1:
        _print_profiles(runs)
        return {**common, **runs[0]}
    _print_sweep(runs)
    _print_profiles(runs)
    return {**common, "rates": rates, "runs": runs, "completed": min(r["completed"] for r in runs)}


def _profile_plan(args: argparse.Namespace, rates: list[float]) -> set[float]:
    """The rates `--profile` profiles; the profiling flags checked before anything starts."""
    if not args.profile:
        given = [f for f in ("profile_dir", "profile_rates", "profile_window") if getattr(args, f) is not None]
        if given:
            raise SystemExit(f"error: --{given[0].replace('_', '-')} needs --profile")
        return set()
    if args.base_url and args.profile_dir:
        raise SystemExit("error: --profile-dir is for a server started here; a --base-url server writes its "
                         "traces where its own --profiler-config says")
    if args.profile_rates is None:
        return set(rates)
    missing = [r for r in args.profile_rates if r not in rates]
    if missing:
        raise SystemExit(f"error: --profile-rates {','.join(f'{r:g}' for r in missing)} not among the rates run "
                         f"({','.join(f'{r:g}' for r in rates)})")
    return set(args.profile_rates)


def _server_profiler_config(args: argparse.Namespace) -> str:
    """The --profiler-config of the server started here: the one given (its directory must agree
    with --profile-dir), else one writing to --profile-dir without Python stacks (smaller traces)."""
    from pagoda_engine.profiler import InvalidProfilerConfigError, parse_profiler_config

    try:
        given = parse_profiler_config(args.profiler_config)
    except InvalidProfilerConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if given.enabled:
        if args.profile_dir and os.path.abspath(args.profile_dir) != given.torch_profiler_dir:
            raise SystemExit(f"error: --profile-dir {args.profile_dir} and --profiler-config's torch_profiler_dir "
                             f"{given.torch_profiler_dir} differ; give one")
        return args.profiler_config
    out_dir = args.profile_dir
    if out_dir is None:
        out_dir = (str(Path(args.output_json).resolve().parent / "profile") if args.output_json
                   else tempfile.mkdtemp(prefix="pagoda-profile-"))
    return json.dumps({"profiler": "torch", "torch_profiler_dir": os.path.abspath(out_dir),
                       "torch_profiler_with_stack": False})


def _print_profiles(runs: list[dict]) -> None:
    for r in runs:
        files = r.get("profile")
        if files is None:
            continue
        print(f"--- profile of {r['request_rate']:g} req/s: {len(files['traces'])} trace(s) (chrome traces, for "
              f"ui.perfetto.dev) and their summaries:")
        for path in files["traces"] + files["summaries"]:
            print(f"  {path}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _print_sweep(runs: list[dict]) -> None:
    def fmt(s: dict, keys=("p50", "p90", "p99")) -> str:
        return " / ".join("-" if s.get(k) is None else f"{s[k]:.1f}" for k in keys)

    print("\n| rate req/s | offered / served req/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | TPOT p50 / p99 ms "
          "| E2E p50 / p99 ms | queue p50 / p99 ≤ ms | TTFT mean = queue + prefill + API + client ms | out tok/s "
          "| failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        srv = r["server"]
        print(f"| {r['request_rate']:g} | {r['offered_requests_per_s']:.2f} / {r['requests_per_s']:.2f} | {fmt(r['ttft_ms'])} | {fmt(r['itl_ms'])} "
              f"| {fmt(r['tpot_ms'], ('p50', 'p99'))} | {fmt(r['e2e_ms'], ('p50', 'p99'))} "
              f"| {fmt(srv, ('queue_p50_le_ms', 'queue_p99_le_ms'))} "
              f"| {fmt(r['ttft_ms'], ('mean',))} = "
              f"{fmt(srv, ('queue_mean_ms', 'prefill_mean_ms', 'api_mean_ms', 'client_mean_ms')).replace(' / ', ' + ')} "
              f"| {r['output_tokens_per_s']:,.0f} | {r['failed']} |")


def _print(r: dict) -> None:
    print(f"completed {r['completed']} of {r['num_requests']} requests in {r['duration_s']:.2f} s "
          f"({r['failed']} failed)")
    for error in r["errors"]:
        print(f"  error: {error}")
    print(f"requests/s: {r['requests_per_s']}   output tokens/s: {r['output_tokens_per_s']:,.1f}   "
          f"total tokens/s: {r['total_tokens_per_s']:,.1f}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = r[f"{name}_ms"]
        if s["mean"] is not None:
            print(f"{name.upper():5s} ms: mean {s['mean']:.2f}   p50 {s['p50']:.2f}   p90 {s['p90']:.2f}   "
                  f"p99 {s['p99']:.2f}")
    srv = r["server"]
    if srv["queue_mean_ms"] is not None:
        print(f"server ms: queue mean {srv['queue_mean_ms']:.2f} (p50 <= {srv['queue_p50_le_ms'] or '-'}, "
              f"p99 <= {srv['queue_p99_le_ms'] or '-'}), prefill mean {srv['prefill_mean_ms']:.2f}, "
              f"API process and hops {srv['api_mean_ms']}, HTTP and client {srv['client_mean_ms']}")
        print(f"prefix cache: {srv['prefix_cache_hit_tokens']:,} of {srv['prefix_cache_queried_tokens']:,} prompt "
              f"tokens hit")
    cpu = r["cpu"]
    if cpu["api_cpu_ms_per_token"] is not None:
        print(f"API process CPU: {cpu['api_cpu_s']:.2f} s, {cpu['api_cpu_ms_per_request']:.3f} ms per request, "
              f"{cpu['api_cpu_ms_per_token']:.4f} ms per streamed token")
    if cpu["client_cpu_ms_per_token"] is not None:
        print(f"load client CPU: {cpu['client_cpu_s']:.2f} s, {cpu['client_cpu_ms_per_request']:.3f} ms per request, "
              f"{cpu['client_cpu_ms_per_token']:.4f} ms per streamed token")

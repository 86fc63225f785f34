"""The engine server's Prometheus metrics (`GET /metrics`).

Names are vLLM's with the prefix `pagoda:` (ARCHITECTURE §2), so dashboards, KEDA triggers and
routers written for vLLM map one-to-one. Two sources feed them:
  - the core's `SchedulerStats` (running/waiting gauges, KV usage, cumulative prefix-cache and
    preemption counters), exported as they are by a collector at scrape time;
  - each sequence's steps (`SequenceUpdate`s from the output processor): queue time and TTFT from
    the lifecycle events the core's scheduler stamped, end-to-end latency from the arrival time,
    all wall clock (`time.time()`, comparable across the processes); inter-token latency from
    when each step's tokens reached this process (`time.monotonic()`); token and finished-request
    counters.
Every series carries vLLM's labels `model_name` and `engine` (the data-parallel rank of the core
that ran the request or reported the stats: `engine="0"` with one core), so the pod's figure is
the sum over `engine`.
Each server owns its registry, so several servers (or tests) in one process never collide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagoda_engine.api.output_processor import SequenceUpdate
from pagoda_engine.messages import EngineCoreEventType, SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


_LABELS = ["model_name", "engine"]


# The families exported straight from each core's SchedulerStats: (type, name, help, field).
_STATS_FAMILIES = (
    (GaugeMetricFamily, "pagoda:num_requests_running", "Number of requests in the model execution batch.", "num_running"),
    (GaugeMetricFamily, "pagoda:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    (GaugeMetricFamily, "pagoda:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent of pages in use.",
     "kv_cache_usage"),
    (CounterMetricFamily, "pagoda:prefix_cache_queries", "Prefix-cache queries, in tokens.", "prefix_cache_queries"),
    (CounterMetricFamily, "pagoda:prefix_cache_hits", "Prefix-cache hits, in tokens.", "prefix_cache_hits"),
    (CounterMetricFamily, "pagoda:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
)


class _SchedulerStatsCollector(Collector):
    """Exports each core's latest SchedulerStats snapshot; the core's counters are already cumulative."""

    def __init__(self, model_name: str, num_engines: int):
        self.model_name = model_name
        self.stats = [SchedulerStats() for _ in range(num_engines)]

    def collect(self):
        for kind, name, doc, field in _STATS_FAMILIES:
            family = kind(name, doc, labels=_LABELS)
            for engine, stats in enumerate(self.stats):
                family.add_metric([self.model_name, str(engine)], getattr(stats, field))
            yield family


@dataclass(eq=False)
class SequenceTimes:
    """What the metrics remember about one sequence between its steps."""

    arrival_time: float  # time.time() when the API process got the request
    num_prompt_tokens: int
    engine: int = 0  # the data-parallel rank of the core running it
    queued_at: float | None = None  # the core's QUEUED stamp, until the first SCHEDULED one
    last_token: float | None = None  # time.monotonic() when its latest tokens arrived here
    done: bool = False


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._stats = _SchedulerStatsCollector(model_name, num_engines)
        self.registry.register(self._stats)
        r = self.registry
        self._prompt_tokens = Counter("pagoda:prompt_tokens", "Number of prefill tokens processed.", _LABELS,
                                      registry=r)
        self._generation_tokens = Counter("pagoda:generation_tokens", "Number of generation tokens processed.",
                                          _LABELS, registry=r)
        self._request_success = Counter("pagoda:request_success", "Count of finished requests by finish reason.",
                                        [*_LABELS, "finished_reason"], registry=r)
        self._ttft = Histogram("pagoda:time_to_first_token_seconds", "Time to first token in seconds.", _LABELS,
                               buckets=_TTFT_BUCKETS, registry=r)
        self._itl = Histogram("pagoda:inter_token_latency_seconds", "Inter-token latency in seconds.", _LABELS,
                              buckets=_ITL_BUCKETS, registry=r)
        self._e2e = Histogram("pagoda:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                              _LABELS, buckets=_LATENCY_BUCKETS, registry=r)
        self._queue_time = Histogram("pagoda:request_queue_time_seconds",
                                     "Time a request spent waiting in the engine before it was first scheduled.",
                                     _LABELS, buckets=_LATENCY_BUCKETS, registry=r)
        for engine in range(num_engines):  # every engine's series exported at 0 from the start
            labels = (model_name, str(engine))
            for family in (self._prompt_tokens, self._generation_tokens, self._ttft, self._itl, self._e2e,
                           self._queue_time):
                family.labels(*labels)
            for reason in ("stop", "length", "abort"):
                self._request_success.labels(*labels, reason)

    def observe(self, times: SequenceTimes, update: SequenceUpdate) -> None:
        """Record one step of one sequence."""
        labels = (self.model_name, str(times.engine))
        for event in update.events or ():
            if event.type == EngineCoreEventType.QUEUED:
                times.queued_at = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and times.queued_at is not None:
                self._queue_time.labels(*labels).observe(max(0.0, event.timestamp - times.queued_at))
                times.queued_at = None  # a preempted request's second admission is not queue time
            elif event.type == EngineCoreEventType.FIRST_TOKEN:
                self._ttft.labels(*labels).observe(max(0.0, event.timestamp - times.arrival_time))
                self._prompt_tokens.labels(*labels).inc(times.num_prompt_tokens)
        num = update.num_new_tokens
        if num:
            now = time.monotonic()
            itl = self._itl.labels(*labels)
            if times.last_token is not None:
                for _ in range(num):
                    itl.observe((now - times.last_token) / num)
            elif num > 1:  # the first of several tokens opens no gap
                for _ in range(num - 1):
                    itl.observe(0.0)
            times.last_token = now
            self._generation_tokens.labels(*labels).inc(num)
        if update.finish_reason is not None and not times.done:
            times.done = True
            self._e2e.labels(*labels).observe(max(0.0, time.time() - times.arrival_time))
            self.request_finished(times.engine, update.finish_reason)

    def update_stats(self, engine: int, stats: SchedulerStats) -> None:
        self._stats.stats[engine] = stats

    def request_finished(self, engine: int, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, str(engine), finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

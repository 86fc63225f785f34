"""The engine server's Prometheus metrics (`GET /metrics`).

Names are vLLM's with the prefix `pagoda:` (docs/architecture.md, "Metrics"), so dashboards, KEDA triggers and
routers written for vLLM map one-to-one. The few families the Gateway API inference extension's
model-server protocol names (queue, running, KV usage, `cache_config_info`) are exported under
vLLM's own `vllm:` names as well (`VLLM_ALIASED`), so an Endpoint Picker configured for vLLM reads
a Pagoda pod with no per-engine setting; `--no-vllm-metric-names` drops that copy. Two sources
feed them:
  - the core's `SchedulerStats` (running/waiting gauges, KV usage, cumulative prefix-cache and
    preemption counters), exported as they are by a collector at scrape time;
  - each sequence's steps (`SequenceUpdate`s from the output processor): queue time and TTFT from
    the lifecycle events the core's scheduler stamped, end-to-end latency from the arrival time,
    all wall clock (`time.time()`, comparable across the processes); inter-token latency from
    when each step's tokens reached this process (`time.monotonic()`); token and finished-request
    counters. At a sequence's end, vLLM's intervals: prefill = first token - first scheduled (the
    core's stamps), decode = last token - first token (both as they reached this process, so the
    two ends share a clock), inference = prefill + decode (= last - scheduled), time per output
    token = decode / (generated - 1); the prompt and generation lengths and `max_tokens`.
  - each step's scheduled token count (`SchedulerStats.num_scheduled_tokens`):
    `iteration_tokens_total`;
  - with speculative decoding, vLLM's counters from `SchedulerStats.spec_decode`:
    `spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens` and
    `_num_accepted_tokens_per_pos` (labelled `position`);
  - with `--kv-transfer-config`, `SchedulerStats.kv_transfer`: `kv_transfer_*` (bytes sent and
    received, pull seconds, pulls, failures, fallbacks, pages held) and vLLM's
    `external_prefix_cache_queries` / `_hits` (prompt tokens received instead of computed);
  - with KV offload tiers, each tier's figures (`SchedulerStats.kv_offload`), labelled
    `tier="cpu"|"disk"|"remote"`: capacity and usage in bytes, hit and miss tokens, bytes stored
    and loaded, errors, and the load-latency histogram `kv_offload_load_seconds`; with CUDA,
    the bytes and device seconds of their host<->device copies (`kv_offload_copy_*`, by direction).
Every series carries vLLM's labels `model_name` and `engine` (the data-parallel rank of the core
that ran the request or reported the stats: `engine="0"` with one core), so the pod's figure is
the sum over `engine`.
Each server owns its registry, so several servers (or tests) in one process never collide.

With several API server processes (`--api-server-count N`), the pod still has one set of series,
whichever process a scrape reaches: the counters and histograms each process records (its own
requests) live in prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, set by the
launcher before any API process starts) and a scrape sums them over the processes, as vLLM does;
the cores' stats, which every API process receives, are exported from the scraping process's own
latest snapshot, once (a sum over processes would count them N times); and the per-step histogram
`iteration_tokens_total` is recorded by API process 0 alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from pagoda_engine.api.output_processor import SequenceUpdate
from pagoda_engine.config import CacheConfig
from pagoda_engine.messages import KV_OFFLOAD_LOAD_BUCKETS, EngineCoreEventType, SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    out, magnitude = [], 1
    while True:
        for step in (1, 2, 5):
            if step * magnitude > limit:
                return tuple(out)
            out.append(step * magnitude)
        magnitude *= 10


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


# The KV offload tiers' families, from each core's `SchedulerStats.kv_offload`, labelled by tier.
_OFFLOAD_FAMILIES = (
    (GaugeMetricFamily, "pagoda:kv_offload_capacity_bytes", "Bytes a KV offload tier can hold.", "capacity_bytes"),
    (GaugeMetricFamily, "pagoda:kv_offload_usage_bytes", "Bytes a KV offload tier holds.", "usage_bytes"),
    (CounterMetricFamily, "pagoda:kv_offload_hit_tokens", "Prompt tokens found in a KV offload tier.", "hit_tokens"),
    (CounterMetricFamily, "pagoda:kv_offload_miss_tokens", "Prompt tokens looked up in a KV offload tier and not found.",
     "miss_tokens"),
    (CounterMetricFamily, "pagoda:kv_offload_stored_bytes", "Bytes written to a KV offload tier.", "stored_bytes"),
    (CounterMetricFamily, "pagoda:kv_offload_loaded_bytes", "Bytes loaded back from a KV offload tier.", "loaded_bytes"),
    (CounterMetricFamily, "pagoda:kv_offload_errors", "Failed operations of a KV offload tier (unreachable, timed "
     "out, corrupt or truncated entries, failed writes).", "errors"),
)


# The families an Endpoint Picker configured for vLLM reads (Gateway API inference extension,
# model-server protocol): also exported under vLLM's own names unless --no-vllm-metric-names.
VLLM_ALIASED = ("pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
                "pagoda:cache_config_info")


def _vllm_name(name: str) -> str:
    return "vllm:" + name.removeprefix("pagoda:")


class _SchedulerStatsCollector(Collector):
    """Exports each core's latest SchedulerStats snapshot; the core's counters are already cumulative."""

    def __init__(self, model_name: str, num_engines: int, vllm_names: bool = True):
        self.model_name = model_name
        self.vllm_names = vllm_names
        self.stats = [SchedulerStats() for _ in range(num_engines)]

    def collect(self):
        for kind, name, doc, field in _STATS_FAMILIES:
            names = (name, _vllm_name(name)) if self.vllm_names and name in VLLM_ALIASED else (name,)
            for exported in names:
                family = kind(exported, doc, labels=_LABELS)
                for engine, stats in enumerate(self.stats):
                    family.add_metric([self.model_name, str(engine)], getattr(stats, field))
                yield family
        yield from self._spec_decode()
        yield from self._kv_transfer()
        yield from self._expert_load()
        if not any(stats.kv_offload for stats in self.stats):
            return
        labels = [*_LABELS, "tier"]
        for kind, name, doc, field in _OFFLOAD_FAMILIES:
            family = kind(name, doc, labels=labels)
            for engine, stats in enumerate(self.stats):
                for tier in stats.kv_offload:
                    family.add_metric([self.model_name, str(engine), tier.tier], getattr(tier, field))
            yield family
        family = HistogramMetricFamily("pagoda:kv_offload_load_seconds",
                                       "Time from starting a load from a KV offload tier (the deepest it reads) "
                                       "until its pages are on the device.", labels=labels)
        for engine, stats in enumerate(self.stats):
            for tier in stats.kv_offload:
                counts = tier.load_seconds_buckets or [0] * (len(KV_OFFLOAD_LOAD_BUCKETS) + 1)
                buckets = [(str(b), n) for b, n in zip(KV_OFFLOAD_LOAD_BUCKETS, counts)] + [("+Inf", counts[-1])]
                family.add_metric([self.model_name, str(engine), tier.tier], buckets, tier.load_seconds_sum)
        yield family
        if not any(stats.kv_offload_copy for stats in self.stats):
            return
        labels = [*_LABELS, "direction"]
        for name, doc, offset in (
                ("pagoda:kv_offload_copy_bytes", "Bytes the KV offload tiers copied between device and host memory.", 0),
                ("pagoda:kv_offload_copy_seconds", "Device time of the KV offload tiers' host<->device copies "
                 "(CUDA events around them on their streams).", 1)):
            family = CounterMetricFamily(name, doc, labels=labels)
            for engine, stats in enumerate(self.stats):
                if stats.kv_offload_copy:
                    for direction, base in (("load", 0), ("store", 2)):
                        family.add_metric([self.model_name, str(engine), direction], stats.kv_offload_copy[base + offset])
            yield family


    def _expert_load(self):
        """Experts across data-parallel cores: tokens each expert took, per MoE layer (counted on
        the core whose ranks hold it: the pod's figure is the sum over `engine`)."""
        if not any(stats.expert_load for stats in self.stats):
            return
        family = CounterMetricFamily("pagoda:moe_expert_tokens", "Tokens routed to each MoE expert, per layer "
                                     "(counted where the expert's weights are).", labels=[*_LABELS, "layer", "expert"])
        for engine, stats in enumerate(self.stats):
            for layer, counts in enumerate(stats.expert_load):
                for expert, count in enumerate(counts):
                    family.add_metric([self.model_name, str(engine), str(layer), str(expert)], count)
        yield family

    def _spec_decode(self):
        """Speculative decoding's counters (`SchedulerStats.spec_decode`), where it is on."""
        if not any(stats.spec_decode for stats in self.stats):
            return
        for i, (name, doc) in enumerate(_SPEC_DECODE_FAMILIES):
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            for engine, stats in enumerate(self.stats):
                if stats.spec_decode:
                    family.add_metric([self.model_name, str(engine)], stats.spec_decode[i])
            yield family
        family = CounterMetricFamily("pagoda:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens at each position.", labels=[*_LABELS, "position"])
        for engine, stats in enumerate(self.stats):
            for position, count in enumerate(stats.spec_decode[len(_SPEC_DECODE_FAMILIES):]):
                family.add_metric([self.model_name, str(engine), str(position)], count)
        yield family


    def _kv_transfer(self):
        """Disaggregated prefill/decode's figures (`SchedulerStats.kv_transfer`), where it is on."""
        if not any(stats.kv_transfer for stats in self.stats):
            return
        for i, (kind, name, doc) in enumerate(_KV_TRANSFER_FAMILIES):
            family = kind(name, doc, labels=_LABELS)
            for engine, stats in enumerate(self.stats):
                if stats.kv_transfer:
                    family.add_metric([self.model_name, str(engine)], stats.kv_transfer[i])
            yield family


# Disaggregated prefill/decode, in `SchedulerStats.kv_transfer`'s order .
_KV_TRANSFER_FAMILIES = (
    (CounterMetricFamily, "pagoda:kv_transfer_sent_bytes", "KV page bytes this producer sent to decode engines."),
    (CounterMetricFamily, "pagoda:kv_transfer_received_bytes", "KV page bytes this consumer pulled from producers."),
    (CounterMetricFamily, "pagoda:kv_transfer_seconds", "Wall time of this consumer's pulls that landed "
                                                         "(handshake and pages)."),
    (CounterMetricFamily, "pagoda:kv_transfer_pulls", "Pulls of remote KV pages that landed."),
    (CounterMetricFamily, "pagoda:kv_transfer_failures", "Pulls that failed, timed out or were refused at the "
                                                          "handshake."),
    (CounterMetricFamily, "pagoda:kv_transfer_fallbacks", "Requests that computed their prompt themselves instead "
                                                           "of pulling it."),
    (GaugeMetricFamily, "pagoda:kv_transfer_pages_held", "Pages a producer holds for decode engines to pull."),
    (CounterMetricFamily, "pagoda:external_prefix_cache_queries",
     "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
     "queried tokens."),
    (CounterMetricFamily, "pagoda:external_prefix_cache_hits",
     "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
     "cached tokens."),
)


# Speculative decoding's counters, in `SchedulerStats.spec_decode`'s order (vLLM's names and help).
_SPEC_DECODE_FAMILIES = (
    ("pagoda:spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("pagoda:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("pagoda:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)


class _CacheConfigInfo(Collector):
    """vLLM's `cache_config_info`: a gauge of 1 whose labels are the cache configuration, per engine."""

    def __init__(self, info: dict[str, str], num_engines: int, vllm_names: bool = True):
        self.info = info
        self.num_engines = num_engines
        self.names = ("pagoda:cache_config_info", "vllm:cache_config_info") if vllm_names else (
            "pagoda:cache_config_info",)

    def collect(self):
        for name in self.names:
            family = GaugeMetricFamily(name, "Information of the LLMEngine CacheConfig.",
                                       labels=[*self.info, "engine"])
            for engine in range(self.num_engines):
                family.add_metric([*self.info.values(), str(engine)], 1)
            yield family


class _LoRARequestsInfo(Collector):
    """vLLM's `lora_requests_info` (--enable-lora): a gauge whose labels are `max_lora` and the
    comma-separated adapters of the running and of the waiting requests, and whose value is when
    that combination was last reported (time.time()), one series per combination seen, as vLLM's
    `set_to_current_time` leaves them: a reader (the Gateway API's Endpoint Picker) takes the
    newest. The adapters are the union over the pod's engine cores, named in sorted order."""

    def __init__(self, max_lora: int, num_engines: int, vllm_names: bool = True):
        self.max_lora = str(max_lora)
        self.names = ("pagoda:lora_requests_info", "vllm:lora_requests_info") if vllm_names else (
            "pagoda:lora_requests_info",)
        self.latest: list[SchedulerStats | None] = [None] * num_engines
        self.series: dict[tuple[str, str], float] = {}  # (running, waiting) -> when last reported

    def update(self, engine: int, stats: SchedulerStats) -> None:
        self.latest[engine] = stats
        running = sorted({a for s in self.latest if s is not None for a in s.running_lora_adapters})
        waiting = sorted({a for s in self.latest if s is not None for a in s.waiting_lora_adapters})
        self.series[(",".join(running), ",".join(waiting))] = time.time()

    def collect(self):
        for name in self.names:
            family = GaugeMetricFamily(name, "Running stats on lora requests.",
                                       labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            for (running, waiting), stamp in self.series.items():
                family.add_metric([self.max_lora, running, waiting], stamp)
            yield family


def cache_config_info(cache: CacheConfig, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of `cache_config_info`: the engine's cache flags and the pool it measured."""
    return {"block_size": str(cache.block_size), "enable_prefix_caching": str(cache.enable_prefix_caching),
            "gpu_memory_utilization": str(cache.gpu_memory_utilization), "num_gpu_blocks": str(num_gpu_blocks)}


@dataclass(eq=False)
class SequenceTimes:
    """What the metrics remember about one sequence between its steps."""

    arrival_time: float  # time.time() when the API process got the request
    num_prompt_tokens: int
    engine: int = 0  # the data-parallel rank of the core running it
    max_tokens: int | None = None  # the request's max_tokens (None: up to max_model_len)
    queued_at: float | None = None  # the core's QUEUED stamp, until the first SCHEDULED one
    scheduled_at: float | None = None  # the core's first SCHEDULED stamp
    prefill_time: float | None = None  # the core's FIRST_TOKEN stamp - scheduled_at
    first_token: float | None = None  # time.time() when its first tokens arrived here
    last_token: float | None = None  # time.monotonic() when its latest tokens arrived here
    num_generated: int = 0
    done: bool = False


class ServerMetrics:
    def __init__(self, model_name: str, num_engines: int = 1, max_model_len: int = 8192,
                 cache_info: dict[str, str] | None = None, multiprocess: bool = False,
                 records_steps: bool = True, vllm_metric_names: bool = True, max_lora: int | None = None):
        """`multiprocess`: one of several API server processes (the module docstring);
        `records_steps`: this process records `iteration_tokens_total`; `vllm_metric_names`: also
        export `VLLM_ALIASED` under vLLM's names; `max_lora`: --max-loras under --enable-lora
        (`lora_requests_info` and the per-adapter request counts)."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.records_steps = records_steps
        self.registry = CollectorRegistry()
        self._stats = _SchedulerStatsCollector(model_name, num_engines, vllm_metric_names)
        self._lora_info = _LoRARequestsInfo(max_lora, num_engines, vllm_metric_names) if max_lora else None
        engine_collectors = (self._stats, _CacheConfigInfo(cache_info or {}, num_engines, vllm_metric_names),
                             *((self._lora_info,) if self._lora_info is not None else ()))
        if multiprocess:
            self.exposition = CollectorRegistry()
            MultiProcessCollector(self.exposition)
        else:
            self.exposition = self.registry
        for collector in engine_collectors:
            self.exposition.register(collector)
        lengths = buckets_1_2_5(max_model_len)
        per_engine = []  # the families every engine exports at 0 from the start

        def counter(name: str, doc: str) -> Counter:
            per_engine.append(Counter(name, doc, _LABELS, registry=self.registry))
            return per_engine[-1]

        def histogram(name: str, doc: str, buckets) -> Histogram:
            per_engine.append(Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry))
            return per_engine[-1]

        self._prompt_tokens = counter("pagoda:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("pagoda:generation_tokens", "Number of generation tokens processed.")
        self._request_success = Counter("pagoda:request_success", "Count of finished requests by finish reason.",
                                        [*_LABELS, "finished_reason"], registry=self.registry)
        self._ttft = histogram("pagoda:time_to_first_token_seconds", "Time to first token in seconds.",
                               _TTFT_BUCKETS)
        self._itl = histogram("pagoda:inter_token_latency_seconds", "Inter-token latency in seconds.", _ITL_BUCKETS)
        # vLLM's older name of the same gaps (deprecated there, still read by dashboards), its buckets.
        self._itl_alias = histogram("pagoda:time_per_output_token_seconds",
                                    "Inter-token latency in seconds (the older name of inter_token_latency_seconds).",
                                    _TPOT_BUCKETS)
        self._e2e = histogram("pagoda:e2e_request_latency_seconds", "End-to-end request latency in seconds.",
                              _LATENCY_BUCKETS)
        self._queue_time = histogram("pagoda:request_queue_time_seconds",
                                     "Time a request spent waiting in the engine before it was first scheduled.",
                                     _LATENCY_BUCKETS)
        self._prefill_time = histogram("pagoda:request_prefill_time_seconds",
                                       "Histogram of time spent in PREFILL phase for request.", _LATENCY_BUCKETS)
        self._decode_time = histogram("pagoda:request_decode_time_seconds",
                                      "Histogram of time spent in DECODE phase for request.", _LATENCY_BUCKETS)
        self._inference_time = histogram("pagoda:request_inference_time_seconds",
                                         "Histogram of time spent in RUNNING phase for request.", _LATENCY_BUCKETS)
        self._tpot = histogram("pagoda:request_time_per_output_token_seconds",
                               "Histogram of time_per_output_token_seconds per request.", _TPOT_BUCKETS)
        self._request_prompt_tokens = histogram("pagoda:request_prompt_tokens",
                                                "Number of prefill tokens processed.", lengths)
        self._request_generation_tokens = histogram("pagoda:request_generation_tokens",
                                                    "Number of generation tokens processed.", lengths)
        self._max_tokens = histogram("pagoda:request_params_max_tokens",
                                     "Histogram of the max_tokens request parameter.", lengths)
        self._queue_rejected = Counter("pagoda:queue_rejected", "Requests answered 429 because the waiting "
                                       "queue was full (--max-waiting-requests).", ["model_name"],
                                       registry=self.registry)
        self._n = histogram("pagoda:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS)
        self._lora_requests = Counter("pagoda:lora_requests", "Requests received per LoRA adapter (--enable-lora).",
                                      [*_LABELS, "lora_name"], registry=self.registry) if max_lora else None
        self._iteration_tokens = histogram("pagoda:iteration_tokens_total",
                                           "Histogram of number of tokens per engine_step.", _ITERATION_TOKENS_BUCKETS)
        for engine in range(num_engines):
            labels = (model_name, str(engine))
            for family in per_engine:
                family.labels(*labels)
            for reason in ("stop", "length", "abort"):
                self._request_success.labels(*labels, reason)
        # Each engine's children of the families every step of every sequence touches, looked
        # up once: `labels()` costs more than the observation itself.
        self._token_children = [(self._itl.labels(model_name, str(engine)),
                                 self._itl_alias.labels(model_name, str(engine)),
                                 self._generation_tokens.labels(model_name, str(engine)))
                                for engine in range(num_engines)]

    def observe(self, times: SequenceTimes, update: SequenceUpdate) -> None:
        """Record one step of one sequence."""
        labels = (self.model_name, str(times.engine))
        for event in update.events or ():
            if event.type == EngineCoreEventType.QUEUED:
                times.queued_at = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED and times.queued_at is not None:
                self._queue_time.labels(*labels).observe(max(0.0, event.timestamp - times.queued_at))
                times.queued_at = None  # a preempted request's second admission is not queue time
                times.scheduled_at = event.timestamp
            elif event.type == EngineCoreEventType.FIRST_TOKEN:
                self._ttft.labels(*labels).observe(max(0.0, event.timestamp - times.arrival_time))
                self._prompt_tokens.labels(*labels).inc(times.num_prompt_tokens)
                if times.scheduled_at is not None:
                    times.prefill_time = max(0.0, event.timestamp - times.scheduled_at)
        num = update.num_new_tokens
        if num:
            if times.first_token is None:
                times.first_token = time.time()
            times.num_generated += num
            now = time.monotonic()
            itl, itl_alias, generation_tokens = self._token_children[times.engine]
            if times.last_token is not None:
                gap, num_gaps = (now - times.last_token) / num, num
            else:
                gap, num_gaps = 0.0, num - 1  # the first of several tokens opens no gap
            for _ in range(num_gaps):
                itl.observe(gap)
                itl_alias.observe(gap)
            times.last_token = now
            generation_tokens.inc(num)
        if update.finish_reason is not None and not times.done:
            times.done = True
            self._e2e.labels(*labels).observe(max(0.0, time.time() - times.arrival_time))
            self.request_finished(times.engine, update.finish_reason)
            self._observe_finished(times, labels)

    def _observe_finished(self, times: SequenceTimes, labels: tuple[str, str]) -> None:
        """vLLM's per-request histograms, for a sequence the core finished."""
        self._request_prompt_tokens.labels(*labels).observe(times.num_prompt_tokens)
        self._request_generation_tokens.labels(*labels).observe(times.num_generated)
        max_tokens = times.max_tokens if times.max_tokens is not None else self.max_model_len - times.num_prompt_tokens
        self._max_tokens.labels(*labels).observe(max_tokens)
        if times.first_token is None:
            return  # finished before its first token: it had no prefill or decode
        decode = max(0.0, time.time() - times.first_token)
        self._decode_time.labels(*labels).observe(decode)
        self._tpot.labels(*labels).observe(decode / (times.num_generated - 1) if times.num_generated > 1 else 0.0)
        if times.prefill_time is not None:
            self._prefill_time.labels(*labels).observe(times.prefill_time)
            self._inference_time.labels(*labels).observe(times.prefill_time + decode)

    def request_added(self, engine: int, n: int, lora_name: str | None = None) -> None:
        """One prompt of a request, fanned out into `n` sequences; `lora_name`: its adapter."""
        self._n.labels(self.model_name, str(engine)).observe(n)
        if lora_name is not None and self._lora_requests is not None:
            self._lora_requests.labels(self.model_name, str(engine), lora_name).inc()

    def update_stats(self, engine: int, stats: SchedulerStats) -> None:
        if not stats.expert_load:  # read every few seconds: the last read stands between
            stats.expert_load = self._stats.stats[engine].expert_load
        self._stats.stats[engine] = stats
        if self._lora_info is not None:
            self._lora_info.update(engine, stats)
        if stats.num_scheduled_tokens and self.records_steps:
            self._iteration_tokens.labels(self.model_name, str(engine)).observe(stats.num_scheduled_tokens)

    def queue_rejected(self) -> None:
        self._queue_rejected.labels(self.model_name).inc()

    def request_finished(self, engine: int, finish_reason: str) -> None:
        self._request_success.labels(self.model_name, str(engine), finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.exposition)

"""The router's own Prometheus metrics (prefix `pagoda_router:`), in a registry of its own so that
two routers in one process (tests) do not collide.

`queue_length` and `requests_waiting_for_backend` are what the autoscaler reads to scale from
zero: the first counts requests held because no replica is ready; the second also counts requests
that are being connected or retried, i.e. everything accepted that has no response headers yet.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pagoda_router:requests", "Requests answered, by backend and HTTP status",
                                ["backend", "status"], registry=r)
        self.retries = Counter("pagoda_router:retries", "Requests retried on another backend after a "
                               "failure before the first byte", registry=r)
        self.ttft = Histogram("pagoda_router:time_to_first_token_seconds",
                              "Request arrival to first response byte sent to the client (streams: "
                              "first chunk)", buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("pagoda_router:e2e_request_latency_seconds",
                             "Request arrival to last byte sent", buckets=_TTFT_BUCKETS, registry=r)
        self.queue_length = Gauge("pagoda_router:queue_length",
                                  "Requests held because no backend is ready", registry=r)
        self.waiting_for_backend = Gauge("pagoda_router:requests_waiting_for_backend",
                                         "Accepted requests with no backend response yet (held, "
                                         "connecting or retrying)", registry=r)
        self.queue_timeouts = Counter("pagoda_router:queue_timeouts", "Held requests answered 503 "
                                      "after the queue wait expired", registry=r)
        self.queue_rejected = Counter("pagoda_router:queue_rejected", "Requests answered 503 because "
                                      "the hold queue was full", registry=r)
        self.waiting_rejected = Counter("pagoda_router:waiting_rejected", "Requests answered 429 because their "
                                        "model had --max-waiting-per-model requests waiting already", ["model"],
                                        registry=r)
        self.migrations = Counter("pagoda_router:migrations", "Streams continued on another backend after "
                                  "theirs failed mid-way, by cause (connection_error, drain_deadline, server_error)", ["cause"],
                                  registry=r)
        self.continuation_tokens = Counter("pagoda_router:continuation_tokens", "Output tokens handed to "
                                           "another backend as a continuation's resume_token_ids", registry=r)
        self.stream_errors = Counter("pagoda_router:stream_errors", "Streams ended by an error event: they "
                                     "broke and could not be continued", registry=r)
        self.pd_requests = Counter("pagoda_router:pd_requests", "Requests in prefill/decode mode by how they "
                                   "ran: disaggregated (a prefill engine, then a decode engine) or decode_only "
                                   "(no prefill engine ready, the prefill failed, or n > 1)", ["mode"], registry=r)
        self.backends_ready = Gauge("pagoda_router:backends_ready", "Backends passing health checks",
                                    registry=r)
        self.backend_up = Gauge("pagoda_router:backend_up", "1 when the backend passes health checks",
                                ["backend"], registry=r)
        self.kv_index_pages = Gauge("pagoda_router:kv_index_pages", "Pages each pod's KV events say it holds "
                                    "(precise prefix routing's index; pod as its events' topic names it)",
                                    ["pod"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

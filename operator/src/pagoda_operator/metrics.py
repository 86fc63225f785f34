"""The operator's own Prometheus metrics (`pagoda-operator run --metrics-port`): what the built-in
autoscaler decided for each InferenceService, so a dashboard can draw desired against actual
replicas beside the engines' series.

Series (gauges; vLLM-style `pagoda:` names), labelled `namespace` and `service` as the engines'
series are (the engine Service, `<name>-engine`: the Grafana dashboard's $service selects both;
spec.prefill: each role's, `<name>-prefill` and `<name>-decode`), and `inferenceservice` (`<name>`):

  pagoda:autoscaler_desired_replicas   replicas the last decision set
  pagoda:autoscaler_current_replicas   replicas in effect when it decided (spec.replicas)
  pagoda:autoscaler_ready_replicas     engine replicas ready when it decided (status.readyReplicas)
  pagoda:autoscaler_scaling_ready      1 while decisions can be trusted (ScalingReady=True), else 0

A service's series go when it is deleted or stops using the built-in autoscaler (`forget`).
Scraped through the chart's operator ServiceMonitor with honorLabels, so these labels, not the
operator pod's, name the service.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, Gauge, generate_latest

REGISTRY = CollectorRegistry(auto_describe=True)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("namespace", "service", "inferenceservice")

DESIRED_REPLICAS = Gauge("pagoda:autoscaler_desired_replicas", "Engine replicas the autoscaler's last decision set.",
                         LABELS, registry=REGISTRY)
CURRENT_REPLICAS = Gauge("pagoda:autoscaler_current_replicas", "Engine replicas in effect when the autoscaler decided.",
                         LABELS, registry=REGISTRY)
READY_REPLICAS = Gauge("pagoda:autoscaler_ready_replicas", "Engine replicas ready when the autoscaler decided.",
                       LABELS, registry=REGISTRY)
SCALING_READY = Gauge("pagoda:autoscaler_scaling_ready", "1 while the autoscaler's metrics can be trusted, else 0.",
                      LABELS, registry=REGISTRY)
AUTOSCALER_GAUGES = (DESIRED_REPLICAS, CURRENT_REPLICAS, READY_REPLICAS, SCALING_READY)


ROLES = (None, "prefill", "decode")  # the engine Service's suffix: -engine, or a role's


def _labels(namespace: str, name: str, role: str | None = None) -> tuple[str, str, str]:
    return namespace, f"{name}-{role or 'engine'}", name


def record_decision(namespace: str, name: str, *, current: int, ready: int, desired: int, scaling_ready: bool,
                    role: str | None = None) -> None:
    """`role`: spec.prefill's prefill or decode pods (None: the engine pods of one role)."""
    labels = _labels(namespace, name, role)
    DESIRED_REPLICAS.labels(*labels).set(desired)
    CURRENT_REPLICAS.labels(*labels).set(current)
    READY_REPLICAS.labels(*labels).set(ready)
    SCALING_READY.labels(*labels).set(1 if scaling_ready else 0)


def forget(namespace: str, name: str, roles: tuple[str | None, ...] = ROLES) -> None:
    """Drop a service's series (deleted, or no longer autoscaled by the built-in driver), of
    every role or of `roles`."""
    for role in roles:
        labels = _labels(namespace, name, role)
        for gauge in AUTOSCALER_GAUGES:
            try:
                gauge.remove(*labels)
            except KeyError:
                pass


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics in Prometheus' text format 0.0.4, whatever the scraper accepts, as the engine
    and the router serve theirs: prometheus_client's own server would honour a scraper asking for
    OpenMetrics with escaped names, turning `pagoda:` into `pagoda_`."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404)
            return
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # scrapes every few seconds: not worth a log line each
        pass


def serve(port: int, address: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve /metrics from a daemon thread."""
    server = ThreadingHTTPServer((address, port), _MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


# The series names (a dashboard's test checks its queries against them and a real operator's /metrics).
SERIES = tuple(family.name for gauge in AUTOSCALER_GAUGES for family in gauge.describe())

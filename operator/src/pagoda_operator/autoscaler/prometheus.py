"""Reading an InferenceService's engines from the Prometheus HTTP API: their load, for the
autoscaler, and (through `query_by`) the KV tiers' figures, for `kv_status`.

Series are selected by the labels the Prometheus operator puts on ServiceMonitor targets
(`namespace`, and `service` = the Service the target belongs to): the engines are
`service="<name>-engine"` (spec.prefill: `<name>-prefill` and `<name>-decode`), the router
`service="<name>"`. A Prometheus configured by hand must attach the same two labels (e2e/local
does).

`observe()` runs the queries a policy needs and returns a `decision.Observation`; an absent
series is `None`, so the decision can tell "zero" from "not measured".
"""

from __future__ import annotations

import asyncio
import math
import os

import httpx

from pagoda_operator.autoscaler.decision import Observation
from pagoda_operator.spec import InferenceServiceSpec

PROMETHEUS_URL_ENV = "PAGODA_PROMETHEUS_URL"  # operator-wide default for spec.autoscaling.prometheusURL


def spec_prometheus_url(spec: InferenceServiceSpec, prefill: bool = False) -> str | None:
    """The spec's Prometheus: spec.autoscaling.prometheusURL (with `prefill`:
    spec.prefill.autoscaling's first)."""
    blocks = [spec.autoscaling]
    if prefill and spec.prefill is not None:
        blocks.insert(0, spec.prefill.autoscaling)
    return next((a.prometheus_url for a in blocks if a is not None and a.prometheus_url), None)


def prometheus_url(spec: InferenceServiceSpec, prefill: bool = False) -> str | None:
    """Where the operator asks about a service's engines: the spec's (`spec_prometheus_url`), else
    the operator's PAGODA_PROMETHEUS_URL."""
    return spec_prometheus_url(spec, prefill) or os.environ.get(PROMETHEUS_URL_ENV) or None


class PrometheusError(RuntimeError):
    """The Prometheus HTTP API could not answer a query."""


def selectors(namespace: str, name: str, disaggregated: bool = False, role: str | None = None) -> tuple[str, str]:
    """(engine selector, router selector) as PromQL label matchers; `disaggregated` (spec.prefill):
    the engines are both roles' Services, <name>-prefill and <name>-decode, or with `role` one of them."""
    if role is not None:
        engine = f'service="{name}-{role}"'
    elif disaggregated:
        engine = f'service=~"{name}-(prefill|decode)"'
    else:
        engine = f'service="{name}-engine"'
    return f'namespace="{namespace}",{engine}', f'namespace="{namespace}",service="{name}"'


# The latency policies: the Observation field and the engines' histogram (api/server/metrics.py).
_HISTOGRAMS = {"ttft": ("ttft_p90", "pagoda:time_to_first_token_seconds"),
               "itl": ("itl_p90", "pagoda:inter_token_latency_seconds")}


def queries(policy: str, namespace: str, name: str, rate_window_s: int = 60, role: str | None = None) -> dict[str, str]:
    """The PromQL of each Observation field a policy needs (waiting, running and the router's held
    requests are always read: they decide scale-from-zero and idleness); `role`: of one role's
    engines (spec.prefill). The prefill role reads no held requests: the router holds a request
    only while no decode pod can take it (without a prefill pod it sends the whole request to a
    decode pod), so they are the decode role's demand."""
    engine, router = selectors(namespace, name, role=role)
    out = {
        "waiting": f"sum(pagoda:num_requests_waiting{{{engine}}})",
        "running": f"sum(pagoda:num_requests_running{{{engine}}})",
    }
    if role != "prefill":
        out["router_held"] = f"sum(pagoda_router:queue_length{{{router}}})"
    if policy == "kvUtilization":
        out["kv_usage"] = f"avg(pagoda:kv_cache_usage_perc{{{engine}}})"
    elif policy in _HISTOGRAMS:
        field, family = _HISTOGRAMS[policy]
        out[field] = (f"histogram_quantile(0.9, sum by (le) "
                      f"(rate({family}_bucket{{{engine}}}[{rate_window_s}s])))")
    return out


class PrometheusClient:
    def __init__(self, base_url: str, timeout_s: float = 5.0, client: httpx.AsyncClient | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = client

    async def _result(self, promql: str) -> dict:
        """The `data` of an instant query's answer; PrometheusError when there is none."""
        client = self._client or httpx.AsyncClient()
        try:
            r = await client.get(f"{self.base_url}/api/v1/query", params={"query": promql}, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise PrometheusError(f"{self.base_url} unreachable: {type(e).__name__}: {e}") from e
        finally:
            if self._client is None:
                await client.aclose()
        try:
            body = r.json()
        except ValueError:
            raise PrometheusError(f"{self.base_url} answered {r.status_code} with a non-JSON body") from None
        if r.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {r.status_code} {body.get('error', '')}")
        return body.get("data") or {}

    async def query(self, promql: str) -> float | None:
        """An instant query reduced to one number: None for an empty result, the sum when a
        query returns several series (it should not: every query above aggregates)."""
        data = await self._result(promql)
        result = data.get("result") or []
        if data.get("resultType") == "scalar":
            return float(result[1])
        if not result:
            return None
        values = [float(series["value"][1]) for series in result]
        return math.fsum(values)

    async def query_by(self, promql: str, label: str) -> dict[str, float]:
        """An instant query of a vector aggregated `by (label)`: label value -> value."""
        data = await self._result(promql)
        return {series["metric"].get(label, ""): float(series["value"][1]) for series in data.get("result") or []}

    async def observe(self, policy: str, namespace: str, name: str, current_replicas: int, ready_replicas: int,
                      rate_window_s: int = 60, role: str | None = None) -> Observation:
        named = queries(policy, namespace, name, rate_window_s, role)
        try:
            values = await asyncio.gather(*(self.query(q) for q in named.values()))
        except PrometheusError as e:
            return Observation(current_replicas, ready_replicas, error=str(e))
        return Observation(current_replicas, ready_replicas, **dict(zip(named, values)))

"""status.kvCache: each KV tier's configured size and what the engines report about it.

A kopf timer per InferenceService with KV tiers (every KV_STATUS_INTERVAL_S) asks Prometheus, as
the autoscaler does (`autoscaler.prometheus`: the same URL, the same engine selector), for the
engines' offload series summed over the service's engine pods:

  capacity  sum by (tier) (pagoda:kv_offload_capacity_bytes)
  usage     sum by (tier) (pagoda:kv_offload_usage_bytes)
  hitRate   hit tokens / (hit + miss tokens) over the last HIT_RATE_WINDOW_S, from
            pagoda:kv_offload_hit_tokens_total and pagoda:kv_offload_miss_tokens_total
            (absent while no lookup happened in the window)

and applies `status.kvCache` as its own field manager, `pagoda-kv-status` (the reconciler and
the autoscaler own the rest of the status). No Prometheus, or no series yet: the tiers with
their configured sizes and a message that says why the figures are missing. A write happens
only when something but the time of reading changed. `kv_cache_status` is pure.
"""

from __future__ import annotations

import datetime
import math
import time
from typing import Any

import kopf

from pagoda_operator import kube
from pagoda_operator.autoscaler.prometheus import (PROMETHEUS_URL_ENV, PrometheusClient, PrometheusError,
                                                   prometheus_url, selectors)
from pagoda_operator.quantity import GIB, format_gib, gib
from pagoda_operator.schema import SpecProblems
from pagoda_operator.spec import GROUP, PLURAL, VERSION, InferenceServiceSpec, parse_spec

FIELD_MANAGER = "pagoda-kv-status"
KV_STATUS_INTERVAL_S = 30.0
HIT_RATE_WINDOW_S = 300
# The engines' series (issue 15's names; label tier="cpu"|"disk"|"remote").
CAPACITY = "pagoda:kv_offload_capacity_bytes"
USAGE = "pagoda:kv_offload_usage_bytes"
HITS = "pagoda:kv_offload_hit_tokens_total"
MISSES = "pagoda:kv_offload_miss_tokens_total"


def queries(namespace: str, name: str, window_s: int = HIT_RATE_WINDOW_S, disaggregated: bool = False) -> dict[str, str]:
    """PromQL of each figure, per tier, over the service's engine pods (spec.prefill: both roles')."""
    engine, _ = selectors(namespace, name, disaggregated)
    return {
        "capacity": f"sum by (tier) ({CAPACITY}{{{engine}}})",
        "usage": f"sum by (tier) ({USAGE}{{{engine}}})",
        # One expression, so hits and misses are read at the same instant (no lookup: 0/0, NaN).
        "hit_rate": f"sum by (tier) (increase({HITS}{{{engine}}}[{window_s}s])) / "
                    f"(sum by (tier) (increase({HITS}{{{engine}}}[{window_s}s])) + "
                    f"sum by (tier) (increase({MISSES}{{{engine}}}[{window_s}s])))",
    }


async def read_figures(prometheus: PrometheusClient, namespace: str, name: str,
                       disaggregated: bool = False) -> dict[str, dict[str, float]]:
    """figure -> tier -> value; PrometheusError when Prometheus cannot answer."""
    return {figure: await prometheus.query_by(promql, "tier") for figure, promql in queries(namespace, name, disaggregated=disaggregated).items()}


def _bytes(value: float) -> str:
    return format_gib(value / GIB)


def kv_cache_status(spec: InferenceServiceSpec, figures: dict[str, dict[str, float]] | None, why_missing: str | None,
                    now: str) -> dict[str, Any]:
    """status.kvCache from the spec's tiers and the figures read (None: not read, see why_missing)."""
    figures = figures or {}
    tiers = []
    for tier in spec.kv_cache.tiers:
        entry: dict[str, Any] = {"type": tier.type}
        if tier.size is not None:
            entry["size"] = format_gib(gib(tier.size))
        if tier.type in figures.get("capacity", {}):
            entry["capacity"] = _bytes(figures["capacity"][tier.type])
        if tier.type in figures.get("usage", {}):
            entry["usage"] = _bytes(figures["usage"][tier.type])
        hit_rate = figures.get("hit_rate", {}).get(tier.type)
        if hit_rate is not None and math.isfinite(hit_rate):
            entry["hitRate"] = round(hit_rate, 4)
        tiers.append(entry)
    status: dict[str, Any] = {"tiers": tiers, "time": now}
    if why_missing is None and spec.kv_cache.tiers and not figures.get("capacity"):
        why_missing = f"no engine reports {CAPACITY} yet"
    if why_missing is not None:
        status["message"] = why_missing
    return status


def _unchanged(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    strip = lambda d: {k: v for k, v in (d or {}).items() if k != "time"}  # noqa: E731
    return strip(old) == strip(new)


async def observe_kv_cache(body: dict[str, Any], prometheus: PrometheusClient | None = None,
                           now: float | None = None) -> dict[str, Any] | None:
    """The service's status.kvCache now (None: no tiers, or a spec that does not parse)."""
    try:
        spec = parse_spec(body.get("spec"))
    except SpecProblems:
        return None
    if not spec.kv_cache.tiers:
        return None
    meta = body.get("metadata") or {}
    stamp = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.timezone.utc)
    now_text = stamp.strftime("%Y-%m-%dT%H:%M:%SZ")
    url = prometheus_url(spec)
    if prometheus is None and url:
        prometheus = PrometheusClient(url)
    if prometheus is None:
        why = f"no Prometheus to read the engines' metrics from: set spec.autoscaling.prometheusURL (or {PROMETHEUS_URL_ENV} on the operator)"
        return kv_cache_status(spec, None, why, now_text)
    try:
        figures = await read_figures(prometheus, meta.get("namespace") or "default", meta["name"],
                                     disaggregated=spec.prefill is not None)
    except PrometheusError as e:
        return kv_cache_status(spec, None, f"Prometheus query failed: {e}", now_text)
    return kv_cache_status(spec, figures, None, now_text)


async def refresh_kv_status(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The timer: apply status.kvCache when it changed; with no tiers left, apply nothing, which
    removes the kvCache this manager wrote before."""
    meta = body.get("metadata") or {}
    current = (body.get("status") or {}).get("kvCache")
    new = await observe_kv_cache(dict(body))
    if new is None and current is None:
        return
    if new is not None and _unchanged(current, new):
        return
    await kube.apply_status(memo.kube, meta.get("namespace") or "default", meta["name"],
                            {} if new is None else {"kvCache": new}, FIELD_MANAGER)


def _has_tiers_or_their_status(spec: Any, status: Any, **_: Any) -> bool:
    return bool(((spec or {}).get("kvCache") or {}).get("tiers")) or bool((status or {}).get("kvCache"))


def register(registry: kopf.OperatorRegistry, *, interval_s: float = KV_STATUS_INTERVAL_S) -> None:
    """Attach the timer to a kopf registry (`handlers.register` does, for the operator)."""
    kopf.timer(GROUP, VERSION, PLURAL, registry=registry, id="kv-status", interval=interval_s,
               when=_has_tiers_or_their_status)(refresh_kv_status)

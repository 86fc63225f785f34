"""The live set of engine replicas: which exist (from discovery), which are ready (GET /health),
how loaded they are (GET /metrics) and which models they serve (GET /v1/models, every poll:
LoRA adapters come and go at run time), and where each LoRA adapter runs (`lora_requests_info`,
for `adapter_affinity`).

One poll loop per pool. A replica is ready only after a successful /health; a failed poll or a
connection error while proxying takes it out at once, the next good poll brings it back. Waiters
(the hold queue) are woken whenever the ready set becomes non-empty.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from pagoda_engine.router.metrics import RouterMetrics
from pagoda_engine.router.policy import BackendView

log = logging.getLogger("pagoda.router")

# The engine gauges a policy uses (vLLM's names under Pagoda's prefix).
ENGINE_GAUGES = {
    "pagoda:num_requests_running": "running",
    "pagoda:num_requests_waiting": "waiting",
    "pagoda:kv_cache_usage_perc": "kv_usage",
}


class BackendConfigError(ValueError):
    """A backend URL or list the router cannot use; the router refuses to start."""


def normalize_backend_url(url: str) -> str:
    """`http://host:port` without a trailing slash; anything but http(s) with a host is refused."""
    raw = url.strip()
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https"):
        raise BackendConfigError(f"backend URL {raw!r}: unsupported scheme {parts.scheme or '(none)'!r}; "
                                 f"use http:// or https://, e.g. http://10.0.0.5:8000")
    if not parts.hostname:
        raise BackendConfigError(f"backend URL {raw!r} has no host")
    if parts.query or parts.fragment:
        raise BackendConfigError(f"backend URL {raw!r} must not carry a query or fragment")
    return raw.rstrip("/")


def parse_backend_list(value: str) -> list[str]:
    urls = [normalize_backend_url(u) for u in value.split(",") if u.strip()]
    if not urls:
        raise BackendConfigError("--backends is empty: give at least one engine URL, "
                                 "e.g. --backends http://127.0.0.1:8001,http://127.0.0.1:8002")
    return list(dict.fromkeys(urls))


# Gauges that are fractions of one core's pool: the pod's figure is their mean over the cores.
_MEAN_GAUGES = ("kv_usage",)
LORA_INFO = "pagoda:lora_requests_info"


@dataclass(frozen=True)
class LoRAInfo:
    """An engine's newest `lora_requests_info` series: the adapters of its running and waiting
    requests, and how many it holds on the device at once."""

    running: frozenset[str] = frozenset()
    waiting: frozenset[str] = frozenset()
    max_lora: int = 0


def parse_lora_info(text: str) -> LoRAInfo | None:
    """The newest series of the `lora_requests_info` gauge (its value: when that combination was
    last reported, as vLLM's), or None when the engine exports none (no --enable-lora)."""
    newest, info = None, None
    for line in text.splitlines():
        if not line.startswith(LORA_INFO + "{"):
            continue
        labels_text, _, rest = line[len(LORA_INFO) + 1:].rpartition("}")
        try:
            stamp = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if newest is not None and stamp <= newest:
            continue
        labels = dict(_label_pairs(labels_text))
        try:
            max_lora = int(labels.get("max_lora", "0"))
        except ValueError:
            continue
        newest = stamp
        info = LoRAInfo(frozenset(filter(None, labels.get("running_lora_adapters", "").split(","))),
                        frozenset(filter(None, labels.get("waiting_lora_adapters", "").split(","))), max_lora)
    return info


def _label_pairs(text: str):
    """`k="v",k2="v2"` → (k, v) pairs (adapter names hold no quotes or backslashes)."""
    for part in text.split('",'):
        key, eq, value = part.partition("=")
        if eq:
            yield key.strip().lstrip(","), value.strip().strip('"')


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Sum each gauge in ENGINE_GAUGES over its label sets (an engine with several cores reports
    one series per core; KV usage, a fraction, is averaged). A hand parser: the text format's
    sample lines are `name{labels} value`, and prometheus_client's full parser costs ~100x more
    per scrape."""
    out: dict[str, float] = {}
    series: dict[str, int] = {}
    for line in text.splitlines():
        if not line.startswith("pagoda:"):
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0:
            continue
        field_name = ENGINE_GAUGES.get(line[:name_end])
        if field_name is None:
            continue
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest[rest.rfind("}") + 1:]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        out[field_name] = out.get(field_name, 0.0) + value
        series[field_name] = series.get(field_name, 0) + 1
    for field_name in _MEAN_GAUGES:
        if series.get(field_name, 0) > 1:
            out[field_name] /= series[field_name]
    return out


@dataclass
class Backend:
    url: str
    ready: bool = False
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    models: list[dict] = field(default_factory=list)
    lora: LoRAInfo | None = None
    last_error: str | None = None
    last_ok: float = 0.0
    timed_out_polls: int = 0  # consecutive polls that timed out while it was ready

    def view(self) -> BackendView:
        return BackendView(self.url, self.in_flight, self.running, self.waiting, self.kv_usage)

    def serves(self, model: str) -> bool:
        # Before its model list is known, assume it serves the model: the engine answers 404 itself.
        return not self.models or any(m.get("id") == model for m in self.models)

    def lists(self, model: str) -> bool:
        return any(m.get("id") == model for m in self.models)


def is_adapter(backends: list[Backend], model: str | None) -> bool:
    """Is `model` a LoRA adapter (a card with a `parent`) on any of these replicas?"""
    return model is not None and any(m.get("id") == model and m.get("parent") for b in backends for m in b.models)


def adapter_affinity(candidates: list[Backend], model: str) -> list[Backend]:
    """The replicas a request of the LoRA adapter `model` should go to first, of `candidates`
    (ready, serving it): those where it runs or waits already (its weights in a device slot, or
    about to be) and no request queues; else those with a free adapter slot (running fewer
    adapters than max_lora: no running adapter is evicted for it); else all of them, where it
    takes a slot when one frees up."""
    listed = [b for b in candidates if b.lists(model)]
    if not listed:
        return candidates
    resident = [b for b in listed if b.lora is not None and model in (b.lora.running | b.lora.waiting) and not b.waiting]
    if resident:
        return resident
    room = [b for b in listed if b.lora is not None and len(b.lora.running) < b.lora.max_lora]
    return room or listed


class BackendPool:
    def __init__(self, client: httpx.AsyncClient, metrics: RouterMetrics, poll_interval: float = 2.0,
                 poll_timeout: float = 2.0, api_key: str | None = None, timeouts_to_unready: int = 1):
        self.client = client
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        # A ready replica whose polls time out stays ready for this many in a row less one (a
        # loaded replica answers late); a refused connection or an answer other than 200 takes it
        # out at once.
        self.timeouts_to_unready = timeouts_to_unready
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.backends: dict[str, Backend] = {}
        self.known_models: dict[str, dict] = {}  # survives the last replica leaving (scale to zero)
        self._ready_event = asyncio.Event()
        self._changed = asyncio.Event()
        self._on_remove: list = []

    # ---- membership (discovery calls this) ----
    def set_urls(self, urls: list[str]) -> None:
        new = set(urls)
        for url in list(self.backends):
            if url not in new:
                log.info("backend %s removed", url)
                del self.backends[url]
                self.metrics.backend_up.remove(url)
                for callback in self._on_remove:
                    callback(url)
        for url in urls:
            if url not in self.backends:
                log.info("backend %s added", url)
                self.backends[url] = Backend(url)
                self.metrics.backend_up.labels(url).set(0)
        self._update_ready()
        self._changed.set()  # poll the newcomers now instead of a poll interval later

    def on_remove(self, callback) -> None:
        self._on_remove.append(callback)

    # ---- readiness ----
    def ready(self, model: str | None = None) -> list[Backend]:
        return [b for b in self.backends.values() if b.ready and (model is None or b.serves(model))]

    def _update_ready(self) -> None:
        n = sum(1 for b in self.backends.values() if b.ready)
        self.metrics.backends_ready.set(n)
        if n:
            self._ready_event.set()
        else:
            self._ready_event.clear()

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def mark_failed(self, backend: Backend, error: str) -> None:
        """Passive health check: a connection failure while proxying takes the replica out now."""
        if backend.ready:
            log.warning("backend %s marked unready: %s", backend.url, error)
        backend.ready = False
        backend.last_error = error
        self.metrics.backend_up.labels(backend.url).set(0)
        self._update_ready()
        self._changed.set()

    # ---- polling ----
    async def poll_one(self, backend: Backend) -> None:
        try:
            health = await self.client.get(f"{backend.url}/health", timeout=self.poll_timeout, headers=self.headers)
            ok = health.status_code == 200
            error = None if ok else f"/health answered {health.status_code}"
            if ok:
                metrics = await self.client.get(f"{backend.url}/metrics", timeout=self.poll_timeout,
                                                headers=self.headers)
                if metrics.status_code == 200:
                    for name, value in parse_engine_metrics(metrics.text).items():
                        setattr(backend, name, value)
                    backend.lora = parse_lora_info(metrics.text)
                models = await self.client.get(f"{backend.url}/v1/models", timeout=self.poll_timeout,
                                               headers=self.headers)
                if models.status_code == 200:
                    backend.models = list(models.json().get("data", []))
                    for m in backend.models:
                        self.known_models[m.get("id")] = m
        except (httpx.HTTPError, ValueError) as e:
            ok, error = False, f"{type(e).__name__}: {e}"
            if isinstance(e, httpx.TimeoutException) and backend.ready:
                backend.timed_out_polls += 1
                if backend.timed_out_polls < self.timeouts_to_unready:
                    log.info("backend %s: poll %d in a row timed out (%s); still ready", backend.url,
                             backend.timed_out_polls, error)
                    backend.last_error = error
                    return
        if backend.url not in self.backends:  # removed while we polled
            return
        backend.timed_out_polls = 0
        if ok != backend.ready:
            log.info("backend %s %s", backend.url, "ready" if ok else f"unready ({error})")
        backend.ready = ok
        backend.last_error = error
        if ok:
            backend.last_ok = time.monotonic()
        self.metrics.backend_up.labels(backend.url).set(1 if ok else 0)
        self._update_ready()

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll_one(b) for b in list(self.backends.values())))

    async def run(self, fast_interval: float = 0.25) -> None:
        """Poll forever. While nothing is ready, poll at `fast_interval` so held requests are
        released soon after a replica comes up (scale from zero)."""
        while True:
            self._changed.clear()
            await self.poll_all()
            interval = self.poll_interval if self._ready_event.is_set() else min(fast_interval, self.poll_interval)
            try:
                await asyncio.wait_for(self._changed.wait(), interval)
            except asyncio.TimeoutError:
                pass

    def merged_models(self) -> list[dict]:
        """The union of the replicas' models (LoRA adapters with their `parent`); while no replica
        has answered (scale to zero), the models last seen."""
        seen: dict[str, dict] = {}
        for b in self.backends.values():
            for m in b.models:
                seen.setdefault(m.get("id"), m)
        if not seen:
            return list(self.known_models.values())
        return list(seen.values())

    def describe(self) -> list[dict]:
        return [{"url": b.url, "ready": b.ready, "in_flight": b.in_flight, "running": b.running,
                 "waiting": b.waiting, "kv_usage": b.kv_usage, "models": [m.get("id") for m in b.models],
                 **({"lora_running": sorted(b.lora.running), "lora_waiting": sorted(b.lora.waiting),
                     "max_lora": b.lora.max_lora} if b.lora is not None else {}),
                 "last_error": b.last_error} for b in self.backends.values()]

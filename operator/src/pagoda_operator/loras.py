"""spec.loras at run time: every ready engine pod serves the spec's adapters, changed without a restart.

Adapters an init container downloads (hf://, s3://) are in the pod template (`--lora-modules`):
adding or removing one rolls the pods, which download it. Adapters the pod reads where they lie
(pvc:// on a claim the pods mount, file://) are not: a kopf timer per InferenceService with
adapters (every LORA_SYNC_INTERVAL_S, the first at once) lists the ready engine pods
and, over each one's HTTP port with the service's internal key (Secret <name>-internal-key, the
router's), asks `GET /v1/models` which adapters it serves (cards with a `parent`, `root` their
path), loads with `POST /v1/load_lora_adapter` what it lacks or serves from another path, and
unloads with `POST /v1/unload_lora_adapter` what the spec no longer names (the engine serves these
with PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1, which `render` sets). The outcome is applied as
`status.loras` by its own field manager, `pagoda-lora-status`: per adapter the ready pods that
serve it and, where one refused it, the engine's reason. `sync_engine` is the one place that
speaks the engine's API; `lora_status` is pure.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import httpx
import kopf

from pagoda_operator import kube
from pagoda_operator import render as r
from pagoda_operator.schema import SpecProblems
from pagoda_operator.spec import GROUP, PLURAL, VERSION, InferenceServiceSpec, parse_spec

FIELD_MANAGER = "pagoda-lora-status"
LORA_SYNC_INTERVAL_S = 15.0
REQUEST_TIMEOUT_S = 30.0  # a load reads the adapter's files and checks them against the model
REASON_CHARS = 300

log = logging.getLogger(__name__)


def wanted_adapters(spec: InferenceServiceSpec) -> dict[str, str]:
    """name → the path the engine reads it from, for every adapter of the spec."""
    return {a.name: r.lora_path(a.uri) for a in spec.loras}


async def sync_engine(http: httpx.AsyncClient, base_url: str, key: str | None,
                      wanted: dict[str, str]) -> dict[str, str | None]:
    """Make the engine at `base_url` serve exactly `wanted` (name → path): per adapter None when it
    serves it now, else why not. Raises httpx.HTTPError when the engine cannot be asked at all."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    listed = await http.get(f"{base_url}/v1/models", headers=headers)
    listed.raise_for_status()
    served = {card["id"]: card.get("root") for card in listed.json().get("data") or [] if card.get("parent")}
    outcome: dict[str, str | None] = {}
    for name in sorted(served.keys() - wanted.keys()) + sorted(n for n in wanted if n in served and served[n] != wanted[n]):
        # Running requests of an unloaded adapter finish under it (the engine's rule).
        answer = await http.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers)
        if answer.status_code != 200 and name in wanted:
            outcome[name] = _reason(answer)
    for name, path in wanted.items():
        if name in outcome:
            continue
        if served.get(name) == path:
            outcome[name] = None
            continue
        answer = await http.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                                 headers=headers)
        outcome[name] = None if answer.status_code == 200 else _reason(answer)
    return outcome


def _reason(answer: httpx.Response) -> str:
    try:
        text = answer.json().get("error", {}).get("message") or answer.text
    except (ValueError, AttributeError):
        text = answer.text
    text = " ".join(str(text).split())
    return f"{answer.status_code}: {text[:REASON_CHARS]}"


def lora_status(spec: InferenceServiceSpec, outcomes: dict[str, dict[str, str | None]]) -> list[dict[str, Any]]:
    """status.loras from each ready pod's outcome (pod name → `sync_engine`'s answer, or a
    {"": why} for a pod that could not be asked): per adapter the pods serving it and the first
    refusal, by pod name."""
    out = []
    for adapter in spec.loras:
        entry: dict[str, Any] = {"name": adapter.name, "uri": adapter.uri,
                                 "readyReplicas": sum(1 for o in outcomes.values() if adapter.name in o and o[adapter.name] is None)}
        for pod, outcome in sorted(outcomes.items()):
            why = outcome.get(adapter.name, outcome.get(""))
            if why is not None:
                entry["message"] = f"pod {pod}: {why}"
                break
        out.append(entry)
    return out


def _ready_engines(pods: list[dict[str, Any]]) -> dict[str, str]:
    """pod name → base URL of each ready engine pod (its container port named http)."""
    out = {}
    for pod in pods:
        status, spec = pod.get("status") or {}, pod.get("spec") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        if not ready or not status.get("podIP"):
            continue
        ports = [p for c in spec.get("containers") or [] if c.get("name") == "engine" for p in c.get("ports") or []]
        port = next((p["containerPort"] for p in ports if p.get("name") == "http"), r.ENGINE_PORT)
        out[pod["metadata"]["name"]] = f"http://{status['podIP']}:{port}"
    return out


async def internal_key(client: Any, namespace: str, name: str) -> str | None:
    secret = await kube.get(client, "v1", "Secret", namespace, r.internal_key_secret_name(name))
    data = (secret or {}).get("data") or {}
    value = data.get(r.INTERNAL_KEY_SECRET_KEY)
    return base64.b64decode(value).decode() if value else None


async def sync_service(client: Any, body: dict[str, Any], http: httpx.AsyncClient | None = None) -> list[dict[str, Any]] | None:
    """Sync every ready engine pod of the InferenceService `body`; its status.loras (None: no
    adapters, or a spec that does not parse)."""
    try:
        spec = parse_spec(body.get("spec"))
    except SpecProblems:
        return None
    if not spec.loras:
        return None
    meta = body["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    labels = r.engine_selector_labels(name)
    pods = await kube.list_labelled(client, "v1", "Pod", namespace, labels)
    engines = _ready_engines([p for p in pods if labels.items() <= ((p.get("metadata") or {}).get("labels") or {}).items()])
    key = await internal_key(client, namespace, name)
    wanted = wanted_adapters(spec)
    outcomes: dict[str, dict[str, str | None]] = {}
    own = http is None
    http = http or httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S)
    try:
        for pod, url in engines.items():
            try:
                outcomes[pod] = await sync_engine(http, url, key, wanted)
            except httpx.HTTPError as e:
                log.warning("LoRA sync of %s/%s pod %s failed: %s", namespace, name, pod, e)
                outcomes[pod] = {"": f"not reachable: {type(e).__name__}: {e}"[:REASON_CHARS]}
    finally:
        if own:
            await http.aclose()
    return lora_status(spec, outcomes)


async def refresh_lora_status(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """The timer: sync the pods, apply status.loras when it changed (with no adapters left,
    apply nothing, which removes what this manager wrote before)."""
    meta = body.get("metadata") or {}
    current = (body.get("status") or {}).get("loras")
    new = await sync_service(memo.kube, dict(body))
    if new == current or (new is None and current is None):
        return
    await kube.apply_status(memo.kube, meta.get("namespace") or "default", meta["name"],
                            {} if new is None else {"loras": new}, FIELD_MANAGER)


def _has_loras_or_their_status(spec: Any, status: Any, **_: Any) -> bool:
    return bool((spec or {}).get("loras")) or bool((status or {}).get("loras"))


def register(registry: kopf.OperatorRegistry, *, interval_s: float = LORA_SYNC_INTERVAL_S) -> None:
    """Attach the timer to a kopf registry (`handlers.register` does, for the operator)."""
    kopf.timer(GROUP, VERSION, PLURAL, registry=registry, id="lora-sync", interval=interval_s,
               when=_has_loras_or_their_status)(refresh_lora_status)

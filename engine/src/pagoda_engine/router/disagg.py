"""`pagoda route --prefill-backends URLS --decode-backends URLS`: disaggregated prefill and decode.

A completion or chat request first goes to a prefill engine (`kv_producer`), chosen by prefix
affinity and load (`PrefixAware`), as vLLM's P/D proxies send it: `max_tokens: 1`, not streamed,
`kv_transfer_params: {"do_remote_decode": true}`. Its answer's `kv_transfer_params` say where the
prompt's pages are held; the original request then goes to a decode engine (`kv_consumer`), chosen
by KV usage and running requests (`DecodeLoad`), with those params added, and the decode engine's
answer (streamed or not) is the client's response, relayed by the decode side's `Router` (mid-stream
migration included). With no prefill engine ready, a prefill that fails or answers without params,
or a request that cannot be split (`n > 1`, prompt logprobs, or params of its own), the whole request goes to a
decode engine, which computes the prompt itself: the client never sees the difference but in time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import httpx
from starlette.responses import Response

from pagoda_engine.router.metrics import RouterMetrics
from pagoda_engine.router.policy import BackendView, PrefixKey
from pagoda_engine.router.proxy import Router

log = logging.getLogger("pagoda.router")


class DecodeLoad:
    """A decode engine: the least KV usage (its pages hold every running request's context, and a
    pulled prompt needs room), then the fewest running and queued requests."""

    def choose(self, candidates: Sequence[BackendView], key: PrefixKey | None = None) -> str:
        return min(candidates, key=lambda b: (round(b.kv_usage, 2), b.load, b.url)).url


def prefill_body(parsed: dict) -> dict:
    """The request as a prefill engine gets it: one token, not streamed, its pages held."""
    body = dict(parsed, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    for key in ("stream_options", "min_tokens"):
        body.pop(key, None)
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    return body


class DisaggRouter:
    def __init__(self, prefill: Router, decode: Router, metrics: RouterMetrics):
        self.prefill = prefill
        self.decode = decode
        self.metrics = metrics

    async def forward(self, method: str, path: str, headers, body: bytes, parsed: dict, model: str | None,
                      key: PrefixKey | None, migratable: bool) -> Response:
        """The client's response: the decode engine's, after a prefill engine ran the prompt."""
        params = None
        # Prompt logprobs need every prompt position's logits where the answer comes from: the
        # decode engine computes the prompt anyway, so a prefill would be wasted.
        # (A client's own kv_transfer_params never get here: the router refuses them.)
        splittable = (parsed.get("n", 1) == 1 and parsed.get("prompt_logprobs") is None
                      and not (parsed.get("echo") and parsed.get("logprobs")))
        if splittable and self.prefill.pool.ready(model):
            params = await self._prefill(method, path, headers, parsed, model, key)
        self.metrics.pd_requests.labels("disaggregated" if params else "decode_only").inc()
        if params:
            parsed = dict(parsed, kv_transfer_params=params)
            body = json.dumps(parsed).encode()
        return await self.decode.forward(method, path, headers, body, model, None, parsed if migratable else None)

    async def _prefill(self, method: str, path: str, headers, parsed: dict, model: str | None,
                       key: PrefixKey | None) -> dict | None:
        """The prefill engine's `kv_transfer_params`, or None (then the decode engine computes)."""
        upstream, backend = await self.prefill._connect(method, path, headers, json.dumps(prefill_body(parsed)).encode(),
                                                        model, key)
        if isinstance(upstream, Response):
            return None
        try:
            data = await upstream.aread()
            status = upstream.status_code
        except httpx.HTTPError as e:
            self.prefill.pool.mark_failed(backend, f"{type(e).__name__}: {e}")
            return None
        finally:
            await upstream.aclose()
            backend.in_flight -= 1
        self.metrics.requests.labels(backend.url, str(status)).inc()
        if status != 200:
            log.warning("prefill on %s answered %d; the decode engine computes the prompt", backend.url, status)
            return None
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        return params if isinstance(params, dict) and params.get("do_remote_prefill") else None

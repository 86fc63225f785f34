"""The API process's warm-up before its port listens: requests through its own app, in process
(no socket), that take once the one-time costs of a first request's path: routing and body
validation, the tokenizer's first encode and decode, the chat template's compile and a render
with tools, the models list. A fresh engine's first streamed request cost its API process about
25 ms more CPU than a later one (40 ms against 15 on the tiny model; after this warm-up about
half of that excess is left), which a rollout's new replica would charge its first clients,
several at once (the router's least-load choice sends a new, empty replica the next requests). Nothing reaches the
engine core: no request is counted, no page cached, no KV event sent."""

from __future__ import annotations

import logging
import time

import httpx

logger = logging.getLogger("pagoda_engine.api.server")

_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
_MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
REQUESTS = (("GET", "/v1/models", None),
            ("POST", "/tokenize", {"prompt": "Once upon a time, a fox"}),
            ("POST", "/tokenize", {"messages": _MESSAGES}),
            ("POST", "/tokenize", {"messages": _MESSAGES, "tools": [_TOOL]}),
            ("POST", "/detokenize", {"tokens": [1, 2, 3]}))


async def warm_up_routes(app, api_key: str | None) -> list[tuple[str, int]]:
    """Send `REQUESTS` through `app` (`api_key`: the key its routes ask for, if any); each
    path and the status it answered. A request the model cannot serve (a chat template it has
    not) is answered with its error like any other; nothing here stops the server from starting."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answered = []
    started = time.monotonic()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://warm-up",
                                     headers=headers) as client:
            for method, path, body in REQUESTS:
                answered.append((path, (await client.request(method, path, json=body)).status_code))
    except Exception as e:  # noqa: BLE001 - a failed warm-up costs the first requests time, nothing more
        logger.warning("the HTTP warm-up failed: %s", e)
    logger.info("HTTP warm-up in %.2fs: %s", time.monotonic() - started,
                ", ".join(f"{path} {status}" for path, status in answered))
    return answered

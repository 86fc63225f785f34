"""Which paths of Pagoda's HTTP servers (the engine server and the router) need an API key, and
how a request without a valid one is refused: 401 in OpenAI's error shape.

The API needs the key; /health, /metrics and /version stay open for probes and Prometheus (vLLM
does the same). Each server decides which keys it accepts: the engine one fixed key (--api-key
or PAGODA_API_KEY), the router the keys of its --api-key-file (`router.client_keys`).
"""

from __future__ import annotations

import secrets
from typing import Callable

from fastapi import FastAPI, Request

from pagoda_engine.api.server.errors import error_response

# "/router/" is the router's own view of its replicas (their addresses): not for anonymous clients.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/start_profile", "/stop_profile", "/router/")


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme in any case), else None."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_matches(key: str) -> Callable[[str | None], bool]:
    """A check that accepts the `Authorization` header `Bearer <key>`, in constant time."""
    expected = key.encode()
    return lambda authorization: secrets.compare_digest((bearer_token(authorization) or "").encode(), expected)


def require_api_key(app: FastAPI, accepts: Callable[[str | None], bool]) -> None:
    """Refuse requests to `app`'s protected paths whose `Authorization` header `accepts` rejects."""

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if request.url.path.startswith(PROTECTED_PREFIXES) and request.method != "OPTIONS" \
                and not accepts(request.headers.get("authorization")):
            return error_response(401, "Missing or invalid API key: send `Authorization: Bearer <key>`.",
                                  code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

"""OpenAI-shaped errors for every HTTP surface Pagoda serves (the engine server and the router).

One shape, `{"error": {"message", "type", "param", "code"}}`, for:
  - request bodies that fail to parse or validate (pydantic / FastAPI) -> 400,
  - typed errors raised by handlers (`APIError` and its subclasses, and the engine's
    `InvalidRequestError` / `EngineDeadError`),
  - Starlette's own HTTP errors (unknown route 404, wrong method 405) and the route class's
    (`bodies.py`: a body too large 400, not JSON 415),
  - anything unexpected -> 500 (logged; the message does not leak internals),
and the same object as one SSE frame when a stream fails after its headers went out.

Use `install_exception_handlers(app)` once per FastAPI app; raise `APIError`s from handlers.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda_engine.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body."""

    error: ErrorInfo


# The error statuses an OpenAI route documents in its OpenAPI schema (502-504: the router's).
ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 401, 404, 415, 502, 503, 504)}


class APIError(Exception):
    """An error with its HTTP status, in OpenAI's vocabulary. Raise it (or a subclass) from a
    handler; the installed exception handler renders it."""

    status_code: int = HTTPStatus.BAD_REQUEST
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status_code: int | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status_code is not None:
            self.status_code = status_code
        if type is not None:
            self.type = type

    def to_body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class BadRequestError(APIError):
    status_code = HTTPStatus.BAD_REQUEST


class AuthenticationError(APIError):
    status_code = HTTPStatus.UNAUTHORIZED
    code = "invalid_api_key"


class ModelNotFoundError(APIError):
    status_code = HTTPStatus.NOT_FOUND
    code = "model_not_found"

    def __init__(self, model: str, available: list[str] | None = None):
        hint = f" (served: {', '.join(available)})" if available else ""
        super().__init__(f"The model `{model}` does not exist{hint}.", param="model")


class TooManyRequestsError(APIError):
    """The server's waiting queue is full (--max-waiting-requests): retry after `retry_after_s`,
    or elsewhere. OpenAI's rate-limit error shape."""

    status_code = HTTPStatus.TOO_MANY_REQUESTS
    type = "rate_limit_error"
    code = "too_many_requests"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


class ServiceUnavailableError(APIError):
    """The engine is dead, not ready yet, or shutting down."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    type = "server_error"
    code = "service_unavailable"


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status_code: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if type is None:
        type = "invalid_request_error" if status_code < 500 else "server_error"
    return JSONResponse(error_body(message, type, param, code), status_code=status_code, headers=headers)


def sse_error_frame(message: str, type: str = "server_error", param: str | None = None,
                    code: str | int | None = None) -> str:
    """The frame a stream sends instead of its remaining chunks when it fails mid-way
    (the status line, 200, has already gone out)."""
    return f"data: {json.dumps(error_body(message, type, param, code))}\n\n"


def exception_to_body(exc: BaseException) -> tuple[int, dict]:
    """Status and OpenAI body for any exception a handler or a stream may raise."""
    if isinstance(exc, APIError):
        return int(exc.status_code), exc.to_body()
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(exc.message, "invalid_request_error", exc.param)
    if isinstance(exc, EngineDeadError):
        return 503, error_body(str(exc) or "The engine core is dead.", "server_error", None, "engine_dead")
    logger.exception("unhandled error", exc_info=exc)
    return 500, error_body("Internal server error.", "server_error", None, "internal_error")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance"}


def _is_union_tag(part: str) -> bool:
    # pydantic names the union member it tried ("str", "list[str]", "ChatContentPartText",
    # "function-after[...]") in the error location; a client only cares about field names.
    return part in _TYPE_TAGS or "[" in part or "(" in part or "-" in part or part[:1].isupper()


def _param_from_loc(loc: tuple) -> str | None:
    # ("body", "messages", 0, "content") -> "messages[0].content"
    out = ""
    for i, p in enumerate(loc):
        if isinstance(p, int):
            out += f"[{p}]"
        elif (i == 0 and p == "body") or _is_union_tag(p):
            continue
        else:
            out += f".{p}" if out else p
    return out or None


def _most_telling(errors: list[dict]) -> dict:
    # For a union field pydantic reports one error per member; a constraint violation
    # ("must be >= 0") says more than "not a string", and the deepest location went furthest.
    first_field = _param_from_loc(tuple(errors[0].get("loc", ())[:2]))
    same = [e for e in errors if _param_from_loc(tuple(e.get("loc", ())[:2])) == first_field]
    return max(same, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))))


def validation_error_body(exc: RequestValidationError) -> dict:
    errors = list(exc.errors())
    if not errors:
        return error_body("Invalid request body.")
    if errors[0].get("type") == "json_invalid":
        reason = (errors[0].get("ctx") or {}).get("error") or errors[0].get("msg", "cannot parse")
        return error_body(f"Malformed JSON body: {reason}.", code="invalid_json")
    err = _most_telling(errors)
    param = _param_from_loc(tuple(err.get("loc", ())))
    msg = err.get("msg", "invalid value")
    if param is None:
        message = ("The request body is missing or is not a JSON object." if err.get("type") in
                   ("missing", "model_type", "model_attributes_type", "dict_type") else msg)
    else:
        message = f"{param}: {msg}"
    return error_body(message, "invalid_request_error", param, None)


def install_exception_handlers(app: FastAPI) -> None:
    """Make every error `app` can return take the OpenAI shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large",
                415: "unsupported_media_type"}.get(exc.status_code)
        return JSONResponse(error_body(str(exc.detail), type, None, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(APIError)
    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(Exception)
    async def _typed(_: Request, exc: Exception) -> JSONResponse:
        status, body = exception_to_body(exc)
        return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

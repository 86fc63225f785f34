"""The FastAPI application of one engine server: routes, API-key check, error shape.

POST /start_profile and /stop_profile exist only when the engine has a profiler config
(`pagoda_engine.profiler`), as in vLLM; elsewhere they are unknown routes (404).

Routes stay thin: parse with the protocol models, delegate to `OpenAIServing`, return. The app
is built around an `AsyncEngine` that is already running, so it never serves a request before
the core is ready.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagoda_engine import __version__, envs
from pagoda_engine.api.server.api_keys import bearer_matches, require_api_key
from pagoda_engine.api.server.async_engine import AsyncEngine
from pagoda_engine.api.server.bodies import bounded_json_route
from pagoda_engine.api.server.errors import ERROR_RESPONSES, error_response, install_exception_handlers
from pagoda_engine.api.server.metrics import CONTENT_TYPE
from pagoda_engine.api.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    streamed_or,
)
from pagoda_engine.api.server.serving_chat import OpenAIServingChat
from pagoda_engine.api.server.serving_completion import OpenAIServingCompletion
from pagoda_engine.api.server.serving_engine import ClientDisconnected, OpenAIServing
from pagoda_engine.api.server.serving_tokenization import OpenAIServingTokenization
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.profiler import ProfilerStateError


def create_app(engine: AsyncEngine, api_key: str | None = None) -> FastAPI:
    """The app over a running `engine`; `api_key` (--api-key, else PAGODA_API_KEY, else none)
    guards the API (`api_keys.PROTECTED_PREFIXES`)."""
    app = FastAPI(title="Pagoda engine server", version=__version__, responses=ERROR_RESPONSES)
    app.router.route_class = bounded_json_route(engine.config.server.max_request_body_bytes)
    app.state.engine = engine
    serving = OpenAIServing(engine)
    tokenization = OpenAIServingTokenization(engine)
    completion = OpenAIServingCompletion(engine)
    chat = OpenAIServingChat(engine)
    install_exception_handlers(app)

    api_key = api_key or envs.api_key()
    if api_key:
        require_api_key(app, bearer_matches(api_key))

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_reason is not None:
            return error_response(503, f"The engine is dead: {engine.dead_reason}", code="engine_dead")
        if not engine.accepting:
            return error_response(503, "The server is draining (SIGTERM): it finishes what it runs and takes "
                                       "no new requests.", code="draining")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return serving.models()

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await tokenization.tokenize(req)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await tokenization.detokenize(req)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={200: streamed_or(CompletionResponse)})
    async def completions(req: CompletionRequest, raw: Request):
        try:
            return await completion.create_completion(req, raw)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening; the request was aborted
        except InvalidRequestError as e:
            raise req.as_sent(e) from None

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: streamed_or(ChatCompletionResponse)})
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        try:
            return await chat.create_chat_completion(req, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        except InvalidRequestError as e:
            raise req.as_sent(e) from None

    if engine.config.profiler_config.enabled:
        _add_profile_routes(app, engine)
    if engine.config.model.enable_lora and envs.allow_runtime_lora_updating():
        _add_lora_routes(app, engine)
    app.add_middleware(_CloseWhileDraining, engine=engine)
    return app


class _CloseWhileDraining:
    """While the server drains, every response says `Connection: close`, so that clients and
    routers drop their kept-alive connections instead of sending it more work. Costs one check
    per request (none per streamed chunk) otherwise."""

    def __init__(self, app, engine: AsyncEngine):
        self.app = app
        self.engine = engine

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.engine.accepting:
            return await self.app(scope, receive, send)

        async def send_closing(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"connection", b"close")]
            await send(message)

        await self.app(scope, receive, send_closing)


def _add_lora_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """vLLM's runtime adapter routes (only under PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1, as vLLM
    serves them only under VLLM_ALLOW_RUNTIME_LORA_UPDATING): their bodies and plain-text answers."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        await engine.load_lora(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        await engine.unload_lora(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _add_profile_routes(app: FastAPI, engine: AsyncEngine) -> None:
    """/start_profile starts torch.profiler on every rank of every engine core; /stop_profile
    stops it, once every rank has written its trace, and lists the files."""

    async def profile(start: bool) -> Response:
        try:
            paths = await engine.profile(start)
        except ProfilerStateError as e:
            return error_response(400, str(e), code="profiler_state")
        return JSONResponse({"traces": [p for p in paths if ".pt.trace.json" in p],
                             "summaries": [p for p in paths if p.endswith(".summary.txt")]})

    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await profile(start=True)

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await profile(start=False)


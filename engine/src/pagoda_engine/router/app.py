"""`pagoda route`: the OpenAI-compatible router in front of engine replicas.

Owns the HTTP surface (the engine server's endpoints, /v1/models merged over replicas, the
router's own /health and /metrics) and the command line. Requests are read and validated as the
engine server reads them (the same route class and protocol models), so a malformed body gets
the same 400 here as from an engine and never costs a replica anything; forwarding lives in `proxy.py`, replica state in `backends.py`,
discovery in `discovery.py`, the choice of replica in `policy.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time

import httpx
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagoda_engine import __version__, envs
from pagoda_engine.api.server.api_keys import require_api_key
from pagoda_engine.api.server.bodies import bounded_json_route
from pagoda_engine.api.server.errors import (ERROR_RESPONSES, BadRequestError, ModelNotFoundError,
                                             install_exception_handlers)
from pagoda_engine.api.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                               CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                               TokenizeRequest, TokenizeResponse, streamed_or)
from pagoda_engine.config import ServerConfig
from pagoda_engine.errors import InvalidEnvironmentError
from pagoda_engine.router import entry
from pagoda_engine.router.backends import BackendConfigError, BackendPool, is_adapter, parse_backend_list
from pagoda_engine.router.client_keys import ClientKeyError, ClientKeys
from pagoda_engine.router.disagg import DecodeLoad, DisaggRouter
from pagoda_engine.router.discovery import EndpointSliceWatcher, parse_k8s_service
from pagoda_engine.router.kv_index import add_kv_event_arguments, check_kv_event_arguments, request_prompt, \
    start_prefix_source
from pagoda_engine.router.metrics import RouterMetrics
from pagoda_engine.router.migration import migratable
from pagoda_engine.router.policy import POLICIES, PrefixKey, make_policy, prefix_key
from pagoda_engine.router.proxy import QueueConfig, Router
from pagoda_engine.router.scorer import PrecisePrefix, TokenKey

log = logging.getLogger("pagoda.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--backends", help="comma-separated engine URLs, e.g. http://10.0.0.5:8000,http://10.0.0.6:8000")
    src.add_argument("--k8s-service", metavar="NAMESPACE/NAME",
                     help="discover engines from this Service's EndpointSlices (watched)")
    src.add_argument("--decode-backends", metavar="URLS",
                     help="disaggregated prefill/decode (`router/disagg.py`): the decode engines' URLs "
                          "(--kv-transfer-config kv_consumer); each request's answer comes from one of them")
    src.add_argument("--decode-k8s-service", metavar="NAMESPACE/NAME",
                     help="disaggregated prefill/decode in a cluster: the decode engines are this Service's "
                          "EndpointSlices (watched), e.g. the Service selecting llm-d.ai/role=decode")
    parser.add_argument("--prefill-backends", metavar="URLS",
                        help="with --decode-backends: the prefill engines' URLs (kv_producer), which run each "
                             "prompt first and hold its pages for the decode engine")
    parser.add_argument("--prefill-k8s-service", metavar="NAMESPACE/NAME",
                        help="with --decode-k8s-service: the prefill engines are this Service's EndpointSlices "
                             "(watched), e.g. the Service selecting llm-d.ai/role=prefill")
    parser.add_argument("--policy", default="prefix-aware", choices=POLICIES)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--backend-port-name", default="http",
                        help="EndpointSlice port name of the engine (default: http; else the first port)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig for --k8s-service outside a cluster")
    parser.add_argument("--health-interval", type=float, default=2.0, help="seconds between /health polls")
    parser.add_argument("--health-timeouts", type=int, default=2,
                        help="polls in a row that time out before a ready replica is taken out (a loaded replica "
                             "answers late; a refused connection or a /health other than 200 takes it out at once)")
    parser.add_argument("--queue-size", type=int, default=1024,
                        help="requests held at most while no replica is ready (scale from zero)")
    parser.add_argument("--queue-timeout", type=float, default=60.0, help="seconds one request is held at most")
    parser.add_argument("--retry-after", type=int, default=5, help="Retry-After seconds on a 503")
    parser.add_argument("--max-waiting-per-model", type=int, default=None,
                        help="requests of one model waiting for a replica's answer (held, connecting, queued) past "
                             "which a new one gets 429 with Retry-After (default: no bound)")
    parser.add_argument("--max-migrations", type=int, default=3,
                        help="times one request may move to another replica when its replica fails: before the "
                             "first byte, or mid-stream as a continuation of the tokens already sent (0: never)")
    parser.add_argument("--prefix-load-factor", type=float, default=1.25,
                        help="prefix-aware: a replica takes new prefixes only while under this x mean load")
    parser.add_argument("--prefix-page-chars", type=int, default=64,
                        help="prefix-aware: characters per hashed prompt page (about 16 tokens)")
    parser.add_argument("--backend-api-key", default=None,
                        help="the engines' key (their --api-key or PAGODA_API_KEY), sent as `Authorization: Bearer` "
                             "on every request and poll instead of the client's (default: PAGODA_BACKEND_API_KEY)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="require `Authorization: Bearer <key>` on /v1/* with a key from PATH: a file of keys, "
                             "one per line, or a directory (a mounted Secret) whose files hold them; re-read when "
                             "it changes (default: no key)")
    max_body = ServerConfig.max_request_body_bytes
    parser.add_argument("--max-request-body-bytes", type=int, default=max_body,
                        help=f"largest request body accepted, as `pagoda serve` (default {max_body})")
    add_kv_event_arguments(parser)  # prefix-aware: precise, from the engines' KV events (scorer.PrecisePrefix)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _validate_args(args: argparse.Namespace) -> None:
    """Refuse, with a message naming the flag, anything the router cannot run with."""
    args.prefill_urls, args.prefill_k8s = None, None
    if args.prefill_backends is not None and args.decode_backends is None:
        raise BackendConfigError("--prefill-backends needs --decode-backends (the engines that decode)")
    if args.prefill_k8s_service is not None and args.decode_k8s_service is None:
        raise BackendConfigError("--prefill-k8s-service needs --decode-k8s-service (the engines that decode)")
    if args.decode_k8s_service is not None:
        args.backend_urls, args.prefill_urls = None, []
        args.k8s_namespace, args.k8s_name = parse_k8s_service(args.decode_k8s_service)
        args.k8s_service = args.decode_k8s_service
        if args.prefill_k8s_service is not None:
            args.prefill_k8s = parse_k8s_service(args.prefill_k8s_service)
        if args.model is not None:
            raise BackendConfigError("--kv-events-port / --kv-events-bind are not supported with --decode-k8s-service "
                                     "yet")
    elif args.decode_backends is not None:
        args.backend_urls = parse_backend_list(args.decode_backends)
        args.prefill_urls = parse_backend_list(args.prefill_backends) if args.prefill_backends else []
        if args.model is not None:
            raise BackendConfigError("--kv-events-port / --kv-events-bind are not supported with --decode-backends yet")
    elif args.backends is not None:
        args.backend_urls = parse_backend_list(args.backends)
    else:
        args.backend_urls = None
        args.k8s_namespace, args.k8s_name = parse_k8s_service(args.k8s_service)
    if args.queue_size < 0:
        raise BackendConfigError("--queue-size must be >= 0")
    if args.queue_timeout < 0:
        raise BackendConfigError("--queue-timeout must be >= 0")
    if args.max_waiting_per_model is not None and args.max_waiting_per_model < 1:
        raise BackendConfigError("--max-waiting-per-model must be >= 1")
    if args.max_migrations < 0:
        raise BackendConfigError("--max-migrations must be >= 0")
    if args.health_interval <= 0:
        raise BackendConfigError("--health-interval must be > 0")
    if args.health_timeouts < 1:
        raise BackendConfigError("--health-timeouts must be >= 1")
    if args.prefix_load_factor < 1:
        raise BackendConfigError("--prefix-load-factor must be >= 1")
    if args.prefix_page_chars < 1:
        raise BackendConfigError("--prefix-page-chars must be >= 1")
    if args.max_request_body_bytes < 1:
        raise BackendConfigError("--max-request-body-bytes must be >= 1")
    problem = check_kv_event_arguments(args)
    if problem is not None:
        raise BackendConfigError(problem)
    if args.model is not None and args.policy != "prefix-aware":
        raise BackendConfigError(f"--kv-events-port / --kv-events-bind feed the prefix-aware policy, not --policy "
                                 f"{args.policy}")
    if args.backend_api_key is None:
        args.backend_api_key = envs.backend_api_key()
    elif not args.backend_api_key.strip():
        raise BackendConfigError("--backend-api-key is empty: give the engines' key, or leave the flag out")
    args.client_keys = ClientKeys(args.api_key_file) if args.api_key_file is not None else None


def _prompt_text(req: BaseModel) -> str | None:
    """The text whose leading pages decide prefix affinity (token ids are spelled out, which
    keeps equal id prefixes equal)."""
    if isinstance(req, ChatCompletionRequest):
        return "".join(f"<{m.role}>{m.text()}" for m in req.messages)
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):  # a batch of prompts: the first one decides
            return first
        if isinstance(first, list):
            return " ".join(map(str, first))
        return " ".join(map(str, prompt))
    return None


def build_app(args: argparse.Namespace) -> FastAPI:
    """The router app for validated `args` (see `_validate_args`)."""
    metrics = RouterMetrics()
    state: dict = {}
    wants_prefix = args.policy == "prefix-aware"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=None, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512),
        )
        pool = BackendPool(client, metrics, poll_interval=args.health_interval,
                           poll_timeout=min(2.0, args.health_interval * 2), api_key=args.backend_api_key,
                           timeouts_to_unready=args.health_timeouts)
        prefixes = start_prefix_source(args)
        state["prefixes"] = prefixes
        if prefixes is not None:
            policy = PrecisePrefix(prefixes, load_factor=args.prefix_load_factor)
        elif wants_prefix:
            policy = make_policy(args.policy, load_factor=args.prefix_load_factor)
        else:
            policy = make_policy(args.policy)
        if args.prefill_urls is not None:
            policy = DecodeLoad()  # the decode engines: least KV usage, then load
        router = Router(pool, policy, metrics, client,
                        QueueConfig(args.queue_size, args.queue_timeout, args.retry_after),
                        backend_api_key=args.backend_api_key, forward_client_key=args.client_keys is None,
                        max_migrations=args.max_migrations, max_waiting_per_model=args.max_waiting_per_model)
        state["router"], state["pool"] = router, pool
        tasks, prefill_watcher = [], None
        if args.prefill_urls is not None:
            # Prefill/decode: the pool above holds the decode engines (least KV usage); the prefill
            # engines are a pool of their own, chosen by prefix affinity.
            prefill_pool = BackendPool(client, metrics, poll_interval=args.health_interval,
                                       poll_timeout=min(2.0, args.health_interval * 2), api_key=args.backend_api_key,
                                       timeouts_to_unready=args.health_timeouts)
            if args.prefill_k8s is not None:
                namespace, name = args.prefill_k8s
                prefill_watcher = EndpointSliceWatcher(namespace, name, prefill_pool.set_urls,
                                                       asyncio.get_running_loop(), port_name=args.backend_port_name,
                                                       kubeconfig=args.kubeconfig)
                prefill_watcher.start()
            else:
                prefill_pool.set_urls(args.prefill_urls)
                await prefill_pool.poll_all()
            state["prefill_pool"] = prefill_pool
            tasks.append(asyncio.create_task(prefill_pool.run()))
            prefill = Router(prefill_pool, make_policy("prefix-aware", load_factor=args.prefix_load_factor), metrics,
                             client, QueueConfig(0, 0.0, args.retry_after), backend_api_key=args.backend_api_key,
                             forward_client_key=args.client_keys is None, max_migrations=args.max_migrations)
            state["disagg"] = DisaggRouter(prefill, router, metrics)
        watcher = None
        def set_urls(urls: list[str]) -> None:
            pool.set_urls(urls)
            if prefixes is not None:
                prefixes.follow(urls)

        if args.backend_urls is not None:
            set_urls(args.backend_urls)
            await pool.poll_all()  # serve with a known ready set from the first request
        else:
            watcher = EndpointSliceWatcher(args.k8s_namespace, args.k8s_name, set_urls,
                                           asyncio.get_running_loop(), port_name=args.backend_port_name,
                                           kubeconfig=args.kubeconfig)
            watcher.start()
        poller = asyncio.create_task(pool.run())
        try:
            yield
        finally:
            poller.cancel()
            for task in tasks:
                task.cancel()
            if prefill_watcher is not None:
                prefill_watcher.stop()
            if watcher is not None:
                watcher.stop()
            if prefixes is not None:
                prefixes.close()
            await client.aclose()

    app = FastAPI(title="Pagoda router", version=__version__, lifespan=lifespan, responses=ERROR_RESPONSES)
    app.router.route_class = bounded_json_route(args.max_request_body_bytes)
    install_exception_handlers(app)
    if args.client_keys is not None:
        require_api_key(app, args.client_keys.accepts)
    page_chars = args.prefix_page_chars

    def check_model(model: str | None) -> None:
        known = state["pool"].merged_models()
        if model is not None and known and not any(m.get("id") == model for m in known):
            raise ModelNotFoundError(model, [m.get("id") for m in known])

    async def forward(request: Request, parsed: BaseModel, routed: bool) -> Response:
        # FastAPI validated the body with the engine's own models (same route class, same
        # errors), so a malformed request never costs a replica anything; the bytes go on as sent.
        body = await request.body()
        model = getattr(parsed, "model", None)
        check_model(model)
        if getattr(parsed, "kv_transfer_params", None) is not None:
            # It names a host and port a decode engine would connect to: only the router's own
            # prefill/decode mode writes it, never a client through the router.
            raise BadRequestError("kv_transfer_params is set by the router (--prefill-backends/--decode-backends), "
                                  "not by clients", param="kv_transfer_params")
        key: PrefixKey | None = None
        if routed and wants_prefix:
            text = _prompt_text(parsed)
            key = prefix_key(text, page_chars) if text else None
            prefixes = state["prefixes"]
            if key is not None and prefixes is not None:
                try:
                    prompt = await asyncio.to_thread(request_prompt, prefixes.tokenizer, json.loads(body))
                    adapter = model if is_adapter(list(state["pool"].backends.values()), model) else None
                    key = TokenKey(key.page_hashes, prompt, adapter)
                except Exception as e:  # e.g. a chat the template refuses: the engine will say so; route approximately
                    log.debug("no token ids for precise routing: %s", e)
        if routed and "disagg" in state:
            return await state["disagg"].forward(request.method, request.url.path, request.headers, body,
                                                 await request.json(), model, key,
                                                 bool(args.max_migrations and migratable(parsed)))
        migrate = await request.json() if routed and args.max_migrations and migratable(parsed) else None
        return await state["router"].forward(request.method, request.url.path, request.headers, body, model, key,
                                             migrate)

    @app.post("/v1/completions", response_model=None, responses={200: streamed_or(CompletionResponse)})
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await forward(request, req, routed=True)

    @app.post("/v1/chat/completions", response_model=None, responses={200: streamed_or(ChatCompletionResponse)})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await forward(request, req, routed=True)

    @app.post("/tokenize", response_model=None, responses={200: {"model": TokenizeResponse}})
    async def tokenize(req: TokenizeRequest, request: Request) -> Response:
        return await forward(request, req, routed=False)

    @app.post("/detokenize", response_model=None, responses={200: {"model": DetokenizeResponse}})
    async def detokenize(req: DetokenizeRequest, request: Request) -> Response:
        return await forward(request, req, routed=False)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": state["pool"].merged_models()}

    @app.get("/health")
    async def health() -> dict:
        # Always 200 while the router runs: with zero replicas it still has to accept and hold
        # requests (scale from zero), so its own readiness must not depend on theirs.
        pool = state["pool"]
        return {"status": "ok", "backends": len(pool.backends), "ready_backends": len(pool.ready()),
                "queue_length": state["router"].held}

    @app.get("/router/backends")
    async def backends() -> dict:
        described = {"policy": args.policy, "backends": state["pool"].describe()}
        if "prefill_pool" in state:  # prefill/decode: `backends` are the decode engines
            described.update(policy="decode-load", prefill_policy="prefix-aware",
                             prefill_backends=state["prefill_pool"].describe())
        return described

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        prefixes = state["prefixes"]
        if prefixes is not None:
            for pod, pages in prefixes.index.sizes().items():
                metrics.kv_index_pages.labels(pod).set(pages)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def run(args: argparse.Namespace) -> int:
    entry.start_logging(args.log_level)
    prometheus_client.disable_created_metrics()  # *_created series are noise on every scrape
    if entry.refused("pagoda route", _validate_args, args, (BackendConfigError, ClientKeyError, InvalidEnvironmentError)):
        return 2
    import uvicorn

    app = build_app(args)
    source = ",".join(args.backend_urls) if args.backend_urls else f"EndpointSlices of {args.k8s_service}"
    if args.prefill_urls is not None:
        prefill = f"EndpointSlices of {args.prefill_k8s_service}" if args.prefill_k8s else ",".join(args.prefill_urls)
        source = f"prefill {prefill or 'none'} / decode {source}"
    log.info("routing %s over %s on %s:%d", args.policy, source, args.host, args.port)
    if args.client_keys is not None:
        log.info("clients need one of the %d key(s) of --api-key-file %s", len(args.client_keys), args.api_key_file)
    started = time.monotonic()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=30)
    log.info("router stopped after %.0fs", time.monotonic() - started)
    return 0


def main(argv: list[str] | None = None) -> int:
    return entry.main("pagoda route", "OpenAI-compatible router", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())

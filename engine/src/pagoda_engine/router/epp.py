"""`pagoda epp`: the Endpoint Picker of the Gateway API inference extension, so a cluster's own
gateway (Envoy Gateway, kgateway, Istio, GKE) routes to Pagoda pods through an `InferencePool`.

It serves Envoy's `ext_proc` v3 over gRPC, as the protocol (GAIE proposal 004) asks:
  - reads the request's headers and body (model, prompt or messages), in Envoy's BUFFERED mode
    (headers answered at once, the pick rides on the body's answer) or FULL_DUPLEX_STREAMED
    (GAIE's: nothing is answered until the body has ended, then the headers with the pick and
    the body streamed back);
  - honours the subset hint (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`);
  - picks with `scorer.rank` (precise prefix match from the pods' KV events, queue depth, KV
    usage) and answers with the `x-gateway-destination-endpoint` header and the same value,
    an ordered fallback list `ip:port,ip:port,...`, in `envoy.lb` dynamic metadata;
  - answers 503 (ImmediateResponse) when no endpoint is ready or none of the subset is, 400 in
    OpenAI's error shape for a body that is not a JSON object;
  - serves gRPC health for `liveness`, `readiness` (after the first poll of the pods) and the
    ext_proc service.
Pods come from `--backends` or a Service's EndpointSlices (`discovery.py`), their health and load
from their `/health` and `/metrics` (`backends.py`), their prefix caches from their KV events
(`kv_index.py`). The EPP counts the requests it sent to each pod until their responses end, so
picks between two scrapes do not all land on one pod.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import sys

import httpx

from pagoda_engine import envs
from pagoda_engine.errors import InvalidEnvironmentError
from pagoda_engine.router import entry
from pagoda_engine.router.backends import (BackendConfigError, BackendPool, adapter_affinity, is_adapter,
                                           parse_backend_list)
from pagoda_engine.router.discovery import EndpointSliceWatcher, parse_k8s_service
from pagoda_engine.router.flow_control import GO, FlowControl
from pagoda_engine.router.kv_index import (BadRequest, PrefixSource, add_kv_event_arguments, check_kv_event_arguments,
                                           endpoint_of, request_prompt, start_prefix_source)
from pagoda_engine.router.metrics import RouterMetrics
from pagoda_engine.router.objectives import Objectives, ObjectivesError, parse_flags
from pagoda_engine.router.scorer import Candidate, Weights, rank

log = logging.getLogger("pagoda.epp")

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SERVED = "x-gateway-destination-endpoint-served"  # the endpoint that answered, in the response's metadata
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--backends", help="comma-separated engine URLs, e.g. http://10.0.0.5:8000,http://10.0.0.6:8000")
    src.add_argument("--k8s-service", metavar="NAMESPACE/NAME",
                     help="discover engines from this Service's EndpointSlices (watched)")
    parser.add_argument("--backend-port-name", default="http",
                        help="EndpointSlice port name of the engine (default: http; else the first port)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig for --k8s-service outside a cluster")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9002, help="gRPC port of ext_proc and health (default 9002)")
    add_kv_event_arguments(parser)
    parser.add_argument("--metrics-interval", type=float, default=0.1,
                        help="seconds between polls of each engine's /health and /metrics (default 0.1)")
    parser.add_argument("--queue-limit", type=float, default=128,
                        help="an engine with this many waiting requests is passed over while another has fewer")
    parser.add_argument("--flow-control-queue", type=int, default=0,
                        help="flow control: hold up to this many requests while every pod they may go to has "
                             "--queue-limit waiting, released by priority, fair between fairness ids; beyond it, "
                             "shed the lowest priority with 429 (default 0: off, a saturated pool still gets them)")
    parser.add_argument("--flow-control-timeout", type=float, default=30.0,
                        help="seconds a request is held at most before it is shed with 429 (default 30)")
    objectives = parser.add_mutually_exclusive_group()
    objectives.add_argument("--objective", action="append", default=[], metavar="NAME=PRIORITY",
                            help="an InferenceObjective's priority, for requests naming it in "
                                 "x-llm-d-inference-objective (repeatable; unnamed or unknown objectives: priority 0)")
    objectives.add_argument("--objectives-file", default=None, metavar="PATH",
                            help="the objectives' priorities as a JSON object {name: priority}, re-read when it "
                                 "changes (the operator's ConfigMap of the pool's InferenceObjectives)")
    parser.add_argument("--prefix-weight", type=float, default=Weights.prefix)
    parser.add_argument("--queue-weight", type=float, default=Weights.queue)
    parser.add_argument("--kv-usage-weight", type=float, default=Weights.kv_usage)
    parser.add_argument("--backend-api-key", default=None,
                        help="the engines' key (their --api-key or PAGODA_API_KEY): sent on every poll, and set as "
                             "`Authorization: Bearer` on every request routed to them (default: PAGODA_BACKEND_API_KEY)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _validate_args(args: argparse.Namespace) -> None:
    if args.backends is not None:
        args.backend_urls = parse_backend_list(args.backends)
    else:
        args.backend_urls = None
        args.k8s_namespace, args.k8s_name = parse_k8s_service(args.k8s_service)
    if args.backend_api_key is None:
        args.backend_api_key = envs.backend_api_key()
    elif not args.backend_api_key.strip():
        raise BackendConfigError("--backend-api-key is empty: give the engines' key, or leave the flag out")
    if not 0 <= args.port < 65536:
        raise BackendConfigError(f"--port must be a TCP port, got {args.port}")
    problem = check_kv_event_arguments(args)
    if problem is not None:
        raise BackendConfigError(problem)
    if args.flow_control_queue < 0:
        raise BackendConfigError("--flow-control-queue must be >= 0")
    if args.flow_control_timeout <= 0:
        raise BackendConfigError("--flow-control-timeout must be > 0")
    args.objectives = Objectives(parse_flags(args.objective), args.objectives_file)
    if args.objective and not args.flow_control_queue:
        raise ObjectivesError("--objective orders held requests: it needs --flow-control-queue > 0")
    if args.metrics_interval <= 0:
        raise BackendConfigError("--metrics-interval must be > 0")
    if args.queue_limit < 1:
        raise BackendConfigError("--queue-limit must be >= 1")
    for flag in ("prefix_weight", "queue_weight", "kv_usage_weight"):
        if getattr(args, flag) < 0:
            raise BackendConfigError(f"--{flag.replace('_', '-')} must be >= 0")


def read_body(raw: bytes) -> dict:
    """The request's JSON body (BadRequest unless it is an object; no body: {})."""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


class Picker:
    """The decision, apart from gRPC: ready pods, subset, scores."""

    def __init__(self, pool: BackendPool, prefixes: PrefixSource | None, weights: Weights, queue_limit: float,
                 backend_api_key: str | None = None):
        self.pool, self.prefixes, self.backend_api_key = pool, prefixes, backend_api_key
        self.weights, self.queue_limit = weights, queue_limit
        self.sent: dict[str, int] = {}  # requests placed on each pod since its last scrape

    def _eligible(self, body: dict, subset: list[str] | None) -> dict:
        model = body.get("model")
        ready = {endpoint_of(b.url): b for b in self.pool.ready(model if isinstance(model, str) else None)}
        if subset is not None:
            ready = {e: b for e, b in ready.items() if e in subset}
        return ready

    def has_room(self, body: dict, subset: list[str] | None) -> bool:
        """Whether some pod the request may go to is under --queue-limit, counting what was placed
        on it since its last scrape (no pod at all: not a wait, the request gets its 503)."""
        ready = self._eligible(body, subset)
        return not ready or any(b.waiting + self.sent.get(e, 0) < self.queue_limit for e, b in ready.items())

    def polled(self) -> None:
        self.sent.clear()

    def pick(self, body: dict, subset: list[str] | None) -> list[str]:
        """Ready endpoints (`ip:port`) best first; [] when none is eligible."""
        ready = self._eligible(body, subset)
        if not ready:
            return []
        prompt = request_prompt(self.prefixes.tokenizer, body) if self.prefixes is not None else None
        num_tokens = prompt.num_tokens if prompt is not None else 0
        model = body.get("model")
        adapter = model if is_adapter(list(ready.values()), model) else None
        matched = self.prefixes.matched(prompt, ready, adapter) if num_tokens else {}
        candidates = [Candidate(e, waiting=b.waiting, running=max(b.running, b.in_flight), kv_usage=b.kv_usage,
                                matched_tokens=matched.get(e, 0)) for e, b in ready.items()]
        ranked = rank(candidates, num_tokens, self.weights, self.queue_limit)
        if adapter is not None:
            # A LoRA adapter's request: the pods where it runs (or has a free slot) lead the
            # fallback list, as `pagoda route` chooses (`adapter_affinity`).
            first = {endpoint_of(b.url) for b in adapter_affinity(list(ready.values()), model)}
            ranked = [e for e in ranked if e in first] + [e for e in ranked if e not in first]
        return ranked

    def started(self, endpoint: str) -> None:
        self.sent[endpoint] = self.sent.get(endpoint, 0) + 1
        backend = self._backend(endpoint)
        if backend is not None:
            backend.in_flight += 1

    def ended(self, endpoint: str) -> None:
        backend = self._backend(endpoint)
        if backend is not None and backend.in_flight > 0:
            backend.in_flight -= 1

    def _backend(self, endpoint: str):
        return next((b for b in self.pool.backends.values() if endpoint_of(b.url) == endpoint), None)


OBJECTIVE_HEADER, FAIRNESS_HEADER = "x-llm-d-inference-objective", "x-llm-d-inference-fairness-id"


def build_servicer(picker: Picker, flow: FlowControl | None = None, objectives: Objectives | None = None):
    """The ext_proc servicer (imports Envoy's generated API here: only `pagoda epp` needs it)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from envoy.type.v3 import http_status_pb2
    from google.protobuf import json_format, struct_pb2

    duplex_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED

    def immediate(code: int, message: str, kind: str) -> pb.ProcessingResponse:
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=code), body=body, details=message,
            headers=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))])))

    # The engines' key, presented on every request routed to them (their --api-key / PAGODA_API_KEY):
    # the gateway holds none. The client's own Authorization header is replaced, never passed on.
    key_headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(
        key="authorization", raw_value=f"Bearer {picker.backend_api_key}".encode()))] if picker.backend_api_key else []

    def common(endpoints: list[str]) -> pb.CommonResponse:
        value = ",".join(endpoints)
        return pb.CommonResponse(clear_route_cache=True, header_mutation=pb.HeaderMutation(set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DESTINATION, raw_value=value.encode())),
            *key_headers]))

    def metadata(endpoints: list[str]) -> struct_pb2.Struct:
        out = struct_pb2.Struct()
        out.update({LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}})
        return out

    def subset_of(request: pb.ProcessingRequest) -> list[str] | None:
        namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if namespace is None or SUBSET_KEY not in namespace.fields:
            return None
        value = json_format.MessageToDict(namespace)[SUBSET_KEY]
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]

    class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
        async def Process(self, requests, context):
            subset, body, duplex, endpoint, headers = None, bytearray(), False, None, {}
            try:
                async for request in requests:
                    which = request.WhichOneof("request")
                    if which == "request_headers":
                        subset = subset_of(request)
                        headers = {h.key.lower(): (h.raw_value.decode(errors="replace") if h.raw_value else h.value)
                                   for h in request.request_headers.headers.headers}
                        duplex = request.protocol_config.request_body_mode == duplex_mode
                        if request.request_headers.end_of_stream:  # no body: pick on load alone
                            answer, endpoint = await decide(b"", subset, headers)
                            if answer.HasField("immediate_response"):
                                yield answer
                                return
                            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common(endpoint)),
                                                        dynamic_metadata=metadata(endpoint))
                        elif not duplex:
                            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                    elif which == "request_body":
                        body += request.request_body.body
                        if not request.request_body.end_of_stream:
                            continue
                        answer, endpoint = await decide(bytes(body), subset, headers)
                        if answer.HasField("immediate_response"):
                            yield answer
                            return
                        if duplex:
                            yield pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common(endpoint)),
                                                        dynamic_metadata=metadata(endpoint))
                            yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                                    body=bytes(body), end_of_stream=True)))))
                        else:
                            yield pb.ProcessingResponse(request_body=pb.BodyResponse(response=common(endpoint)),
                                                        dynamic_metadata=metadata(endpoint))
                    elif which == "response_headers":
                        served = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
                        if endpoint and served is not None and SERVED in served.fields:
                            # The gateway fell back down the list: count the request where it runs.
                            answered = served.fields[SERVED].string_value
                            if answered and answered != endpoint[0]:
                                picker.ended(endpoint[0])
                                picker.started(answered)
                                endpoint = [answered]
                        yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
                    elif which == "response_body":
                        chunk = request.response_body
                        if duplex:
                            yield pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                                    body=chunk.body, end_of_stream=chunk.end_of_stream)))))
                        else:
                            yield pb.ProcessingResponse(response_body=pb.BodyResponse())
                    elif which == "request_trailers":
                        yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
                    elif which == "response_trailers":
                        yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
            finally:
                if endpoint:
                    picker.ended(endpoint[0])

    async def decide(raw: bytes, subset: list[str] | None,
                     headers: dict[str, str]) -> tuple[pb.ProcessingResponse, list[str] | None]:
        try:
            body = read_body(raw)
        except BadRequest as e:
            return immediate(400, f"invalid request: {e}", "invalid_request_error"), None
        if flow is not None and (len(flow) or not picker.has_room(body, subset)):
            priority = objectives.priority(headers.get(OBJECTIVE_HEADER)) if objectives is not None else 0
            outcome = await flow.admit(priority, headers.get(FAIRNESS_HEADER, ""),
                                       lambda: picker.has_room(body, subset))
            if outcome != GO:
                return immediate(429, f"every endpoint is saturated; the request was {outcome} (priority {priority})",
                                 "rate_limit_exceeded"), None
        try:
            endpoints = picker.pick(body, subset)
        except (ValueError, BadRequest) as e:
            if flow is not None:
                flow.wake()
            return immediate(400, f"invalid request: {e}", "invalid_request_error"), None
        if endpoints:
            picker.started(endpoints[0])
        if flow is not None:
            flow.wake()  # this one is placed (or refused): the next held one may go
        if not endpoints:
            where = "of the gateway's subset " if subset is not None else ""
            return immediate(503, f"no ready endpoint {where}to serve the request", "service_unavailable"), None
        log.debug("picked %s", endpoints)
        return pb.ProcessingResponse(), endpoints

    return ExternalProcessor(), pb_grpc.add_ExternalProcessorServicer_to_server


async def serve(args: argparse.Namespace, ready: asyncio.Event | None = None) -> None:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    metrics = RouterMetrics()
    client = httpx.AsyncClient(timeout=httpx.Timeout(2.0))
    pool = BackendPool(client, metrics, poll_interval=args.metrics_interval,
                       poll_timeout=max(0.5, args.metrics_interval * 5), api_key=args.backend_api_key)
    prefixes = start_prefix_source(args)
    follow = prefixes.follow if prefixes is not None else (lambda urls: None)

    def set_urls(urls: list[str]) -> None:
        pool.set_urls(urls)
        follow(urls)

    picker = Picker(pool, prefixes, Weights(args.prefix_weight, args.queue_weight, args.kv_usage_weight),
                    args.queue_limit, args.backend_api_key)
    flow = FlowControl(args.flow_control_queue, args.flow_control_timeout) if args.flow_control_queue else None
    if flow is None and args.objectives_file is not None:
        log.warning("--objectives-file without --flow-control-queue: no request is held, so no priority orders any")
    servicer, add = build_servicer(picker, flow, args.objectives)
    server = grpc.aio.server()
    add(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in ("readiness", EXT_PROC_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if server.add_insecure_port(f"{args.host}:{args.port}") == 0:
        raise OSError(f"cannot listen on {args.host}:{args.port}")
    watcher = None
    if args.backend_urls is not None:
        set_urls(args.backend_urls)
    else:
        watcher = EndpointSliceWatcher(args.k8s_namespace, args.k8s_name, set_urls, asyncio.get_running_loop(),
                                       port_name=args.backend_port_name, kubeconfig=args.kubeconfig)
        watcher.start()
    await server.start()
    await pool.poll_all()
    # Synced: the pods' state is known (the datastore of the protocol's readiness).
    for name in ("readiness", EXT_PROC_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    async def poll() -> None:
        # Each scrape replaces what was counted since the last one; held requests may then fit.
        while True:
            await asyncio.sleep(args.metrics_interval)
            await pool.poll_all()
            picker.polled()
            if flow is not None:
                flow.wake()

    poller = asyncio.create_task(poll())
    # The libraries, the tokenizer and the pods' state loaded so far are long-lived: out of the
    # collector's reach, a full collection walks only what the picker made since (as `pagoda serve`).
    gc.freeze()
    log.info("endpoint picker on %s:%d over %s", args.host, args.port,
             ",".join(args.backend_urls) if args.backend_urls else f"EndpointSlices of {args.k8s_service}")
    if ready is not None:
        ready.set()
    try:
        await server.wait_for_termination()
    finally:
        poller.cancel()
        if watcher is not None:
            watcher.stop()
        if prefixes is not None:
            prefixes.close()
        await server.stop(grace=5)
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    entry.start_logging(args.log_level)
    if entry.refused("pagoda epp", _validate_args, args, (BackendConfigError, InvalidEnvironmentError, ObjectivesError)):
        return 2
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"pagoda epp: error: {e}", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    return entry.main("pagoda epp", "Gateway API inference extension Endpoint Picker", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())

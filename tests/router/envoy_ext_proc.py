"""A client that speaks Envoy's ext_proc v3 to an Endpoint Picker as Envoy's ext_proc filter
does (Envoy's generated API from xds-protos): one bidirectional stream per HTTP request, the
request headers with the protocol configuration and the gateway's subset hint in the metadata
context, then the body; in BUFFERED mode it waits for the answer to the headers before sending the
body, in FULL_DUPLEX_STREAMED mode it sends both and waits for the answers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2

BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


@dataclass
class Pick:
    status: int | None = None  # an ImmediateResponse's HTTP status
    immediate_body: dict | None = None
    header: str | None = None  # x-gateway-destination-endpoint as set
    metadata: str | None = None  # envoy.lb / x-gateway-destination-endpoint
    body_back: bytes | None = None  # the body streamed back (FULL_DUPLEX_STREAMED)
    responses: list = field(default_factory=list)

    @property
    def endpoints(self) -> list[str]:
        assert self.header is not None and self.header == self.metadata, (self.header, self.metadata)
        return self.header.split(",")


def _headers(path: str, extra: dict[str, str]) -> pb.HttpHeaders:
    values = {":method": "POST", ":path": path, ":authority": "gateway", "content-type": "application/json", **extra}
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]))


def _read(pick: Pick, response: pb.ProcessingResponse) -> None:
    pick.responses.append(response)
    which = response.WhichOneof("response")
    if which == "immediate_response":
        pick.status = response.immediate_response.status.code
        pick.immediate_body = json.loads(response.immediate_response.body or b"{}")
        return
    common = getattr(response, which).response
    for option in common.header_mutation.set_headers:
        if option.header.key == "x-gateway-destination-endpoint":
            pick.header = (option.header.raw_value or option.header.value.encode()).decode()
    if response.HasField("dynamic_metadata"):
        lb = json_format.MessageToDict(response.dynamic_metadata).get("envoy.lb", {})
        pick.metadata = lb.get("x-gateway-destination-endpoint", pick.metadata)
    if common.body_mutation.HasField("streamed_response"):
        pick.body_back = (pick.body_back or b"") + common.body_mutation.streamed_response.body


def ext_proc(channel: grpc.Channel, body: dict | bytes, *, mode=BUFFERED, subset: list[str] | None = None,
             path: str = "/v1/completions", headers: dict[str, str] | None = None, timeout: float = 10.0) -> Pick:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    metadata = base_pb2.Metadata()
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        metadata.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    first = pb.ProcessingRequest(request_headers=_headers(path, headers or {}), metadata_context=metadata,
                                 protocol_config=pb.ProtocolConfiguration(request_body_mode=mode))
    second = pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))
    stub = pb_grpc.ExternalProcessorStub(channel)
    pick = Pick()
    if mode == DUPLEX:
        for response in stub.Process(iter([first, second]), timeout=timeout):
            _read(pick, response)
            if pick.status is not None or pick.body_back is not None:
                break
        return pick
    # BUFFERED: the body goes only after the headers' answer, as Envoy buffers it meanwhile.
    import queue

    outbox: queue.Queue = queue.Queue()
    outbox.put(first)

    def requests():
        while True:
            item = outbox.get()
            if item is None:
                return
            yield item

    stream = stub.Process(requests(), timeout=timeout)
    try:
        for response in stream:
            _read(pick, response)
            which = response.WhichOneof("response")
            if which == "request_headers":
                outbox.put(second)
            elif which in ("request_body", "immediate_response"):
                break
    finally:
        outbox.put(None)
        stream.cancel()
    return pick

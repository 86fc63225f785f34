"""The API ↔ core wire: every message is one tagged msgspec struct that survives the round trip
(token ids packed as int32 bytes), and the core loop dispatches on the message's type."""

import time

import msgspec
import pytest

from pagoda_engine.config import EngineConfig
from pagoda_engine.core.engine_core import EngineCore
from pagoda_engine.messages import (
    AbortRequest,
    CoreFailed,
    CoreReady,
    EngineCoreError,
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    Logprob,
    SchedulerStats,
    ShutdownRequest,
    ToCore,
    TokenLogprobs,
    make_decoder,
    make_encoder,
)
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.tiny import build_tiny_model

from core_loop_sockets import core_loop_sockets

TO_CORE = [
    EngineCoreRequest(request_id="r-1", prompt_token_ids=[1, 2, 3, 2**31 - 1],
                      sampling_params=SamplingParams(temperature=0.5, seed=9, stop=["x"], max_tokens=4),
                      arrival_time=1700000000.25, priority=-2),
    AbortRequest(request_ids=["r-1", "r-2"]),
    ShutdownRequest(),
]
FROM_CORE = [
    CoreReady(kv_capacity_tokens=4096, max_model_len=2048, vocab_size=512, model_dir="m", served_model_name="tiny",
              num_kv_pages=257, block_size=16),
    CoreFailed(error_type="ModelLoadError", message="no such model"),
    EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id="r-1", new_token_ids=[7],
                         new_logprobs=[TokenLogprobs(chosen=Logprob(7, -0.5, 1), top=[Logprob(7, -0.5, 1)])],
                         prompt_logprobs=[None, TokenLogprobs(chosen=Logprob(2, -3.0, 9), top=[])],
                         finish_reason="stop", stop_reason=7, num_cached_tokens=16,
                         events=[EngineCoreEvent(EngineCoreEventType.QUEUED, 1700000000.5),
                                 EngineCoreEvent(EngineCoreEventType.SCHEDULED, 1700000000.75)]),
        EngineCoreOutput(request_id="r-2", new_token_ids=[])],
        stats=SchedulerStats(num_running=1, kv_cache_usage=0.5, num_preemptions=3)),
    EngineCoreError(request_id="r-3", message="request id 'r-3' is already in use", param="request_id"),
]


@pytest.mark.parametrize("message, union", [(m, ToCore) for m in TO_CORE] + [(m, FromCore) for m in FROM_CORE],
                         ids=lambda v: type(v).__name__ if not isinstance(v, type(ToCore)) else "")
def test_every_message_round_trips_as_its_own_type(message, union):
    decoded = make_decoder(union).decode(make_encoder().encode(message))
    assert type(decoded) is type(message) and decoded == message


def test_token_ids_travel_as_packed_int32_bytes():
    ids = list(range(1000, 1512))
    request = EngineCoreRequest(request_id="r", prompt_token_ids=ids, sampling_params=SamplingParams())
    frame = make_encoder().encode(request)
    # One raw buffer of exactly 4 bytes per id, not a msgpack array of integers.
    assert bytes(request.prompt_token_ids) in frame
    one = make_encoder().encode(EngineCoreRequest(request_id="r", prompt_token_ids=ids[:1],
                                                  sampling_params=SamplingParams()))
    assert len(frame) - len(one) == 4 * (len(ids) - 1) + 1  # (+1: a 2-byte length header instead of 1)
    assert make_decoder(ToCore).decode(frame).prompt_token_ids.tolist() == ids


def test_a_message_sent_the_wrong_way_is_refused():
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'CoreReady'"):
        make_decoder(ToCore).decode(make_encoder().encode(CoreReady(
            kv_capacity_tokens=1, max_model_len=2, vocab_size=3, model_dir="", served_model_name="",
            num_kv_pages=1, block_size=1)))


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")
    core = EngineCore(EngineConfig.from_kwargs(model=str(model_dir), num_kv_pages=64))
    yield core
    core.close()


def test_the_core_loop_dispatches_on_the_message_type(core):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with core_loop_sockets(core, "dispatch") as sockets:
        thread = sockets.thread
        # All three wait in the socket before the loop starts, so "a" is still running when its
        # duplicate is read (a loaded machine could otherwise finish "a" in between).
        sockets.send(EngineCoreRequest(request_id="a", prompt_token_ids=[5, 6, 7], sampling_params=params,
                                       arrival_time=1.0))
        sockets.send_request("a", [5], params)  # a duplicate id: refused
        sockets.send_request("b", [5, 6, 7, 8], SamplingParams(ignore_eos=True, max_tokens=1500))
        thread.start()
        tokens, events, refused, finished, b_finish, aborted = [], [], [], None, [], False
        idle = False
        while not idle:
            match sockets.receive():
                case EngineCoreOutputs(outputs=outputs, stats=stats):
                    for out in outputs:
                        if out.request_id == "b":
                            b_finish.append(out.finish_reason)
                            if not aborted:
                                sockets.send(AbortRequest(request_ids=["b"]))
                                aborted = True
                            continue
                        tokens += out.new_token_ids.tolist()
                        events += out.events or []
                        finished = out.finish_reason
                    idle = aborted and finished and stats.num_running == stats.num_waiting == 0
                case EngineCoreError() as err:
                    refused.append((err.request_id, err.param))
        assert len(tokens) == 3 and finished == "length"
        assert refused == [("a", "request_id")]
        assert [e.type for e in events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED,
                                            EngineCoreEventType.FIRST_TOKEN]
        assert set(b_finish) == {None}  # aborted long before its 1,500 tokens
        sockets.send(ShutdownRequest())
        thread.join(10)
        assert not thread.is_alive() and not core.has_unfinished_requests()


def test_the_core_loop_sends_each_clients_outputs_to_it_alone_and_stats_to_all(core):
    """Two API server processes (`--api-server-count 2`): outputs and refusals go back to the
    client that sent the request, every client gets the stats, and a client's abort never stops
    another client's request."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def request(request_id: str, client: int) -> EngineCoreRequest:
        return EngineCoreRequest(request_id=request_id, prompt_token_ids=[5, 6, 7], sampling_params=params,
                                 client_index=client)

    with core_loop_sockets(core, "two-clients", clients=2) as sockets:
        clients, loop, thread = sockets.clients, sockets.loop, sockets.thread
        sockets.send(request("zero", 0))
        sockets.send(request("one", 1))
        sockets.send(request("one", 0))  # an id client 1 holds: refused, to client 0
        sockets.send(AbortRequest(request_ids=["zero"], client_index=1))  # not client 1's: ignored
        thread.start()
        seen: list[dict] = [{"tokens": {}, "refused": [], "stats": 0, "finished": set()} for _ in range(2)]
        deadline = time.monotonic() + 60
        while not (seen[0]["finished"] == {"zero"} and seen[1]["finished"] == {"one"}):
            assert time.monotonic() < deadline, seen  # e.g. "zero" stopped by client 1's abort
            for i, client in enumerate(clients):
                if not client.poll(50):
                    continue
                match sockets.decoder.decode(client.recv()):
                    case EngineCoreOutputs(outputs=outputs, stats=stats):
                        seen[i]["stats"] += stats is not None
                        for out in outputs:
                            seen[i]["tokens"].setdefault(out.request_id, []).extend(out.new_token_ids.tolist())
                            if out.finish_reason is not None:
                                assert out.finish_reason == "length"
                                seen[i]["finished"].add(out.request_id)
                    case EngineCoreError() as err:
                        seen[i]["refused"].append((err.request_id, err.param))
        assert set(seen[0]["tokens"]) == {"zero"} and set(seen[1]["tokens"]) == {"one"}
        assert len(seen[0]["tokens"]["zero"]) == len(seen[1]["tokens"]["one"]) == 4
        assert seen[0]["refused"] == [("one", "request_id")] and seen[1]["refused"] == []
        assert seen[0]["stats"] >= 1 and seen[1]["stats"] >= 1
        sockets.send(ShutdownRequest())
        thread.join(10)
        assert not thread.is_alive() and not loop._client_of

"""Disaggregated prefill/decode inside the engine core (`core/kv_transfer.py`, `worker/kv_transfer.py`):
two real cores in one process, a producer and a consumer, with the real endpoint, handshake and
gloo pairs between them. Greedy tokens equal an aggregated core's; hundreds of requests with
injected faults (a dead producer, a producer that never answers, a hold already gone, a refused
handshake, a request aborted mid-pull) each end with the consumer computing the prompt, and both
pools come back to idle: no page leaked either side. `--kv-transfer-config` itself is checked
where it enters (exit 2 naming the flag)."""

from __future__ import annotations

import importlib.util
import json
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from pagoda_engine.config import EngineConfig
from pagoda_engine.core.engine_core import EngineCore
from pagoda_engine.kv_event_wire import BlockStored, block_hash_int
from pagoda_engine.kv_transfer import check_request_params, parse_kv_transfer_config
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.tiny import build_tiny_model

BLOCK = 4
PAGES = 96
TIMEOUT_S = 3.0


NIXL_INSTALLED = any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu13"))


@pytest.fixture(scope="module", params=[
    "PagodaTorchConnector",
    pytest.param("NixlConnector", marks=pytest.mark.skipif(not NIXL_INSTALLED, reason="the nixl wheel is not installed")),
])
def cores(request, tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")

    def core(transfer: dict | None) -> EngineCore:
        kwargs = {"kv_transfer_config": json.dumps(transfer)} if transfer else {}
        return EngineCore(EngineConfig.from_kwargs(model=str(model), num_kv_pages=PAGES, block_size=BLOCK, **kwargs))

    extra = {"hold_timeout_s": 1, "transfer_timeout_s": TIMEOUT_S}
    connector = request.param
    made = [core({"kv_role": "kv_producer", "kv_port": 0, "kv_connector": connector,
                  "kv_connector_extra_config": extra}),
            core({"kv_role": "kv_consumer", "kv_connector": connector, "kv_connector_extra_config": extra}), core(None)]
    assert made[0].kv_transfer.connector == made[1].kv_transfer.connector == connector
    yield made
    for c in made:
        c.close()


def _run(core: EngineCore, rid: str, prompt: list[int], max_tokens: int, params: dict | None = None,
         abort_after_steps: int | None = None, lora_request=None) -> tuple[list[int], dict | None]:
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, lora_request=lora_request,
                                       sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True, kv_transfer_params=params)))
    tokens, answer, steps = [], None, 0
    while core.has_unfinished_requests():
        if abort_after_steps is not None and steps == abort_after_steps:
            core.abort_requests([rid])
        for out in core.step().outputs:
            tokens += list(out.new_token_ids)
            answer = out.kv_transfer_params or answer
        steps += 1
    return tokens, answer


def _idle(core: EngineCore, timeout: float = 10.0) -> None:
    """Until every page is free again (pulls still in their threads, holds before their bound)."""
    deadline = time.monotonic() + timeout
    while core.kv.num_free_pages != PAGES - 1:
        assert time.monotonic() < deadline, (core.kv.num_free_pages, core.kv_transfer and core.kv_transfer.pages_held)
        core.release_expired()
        time.sleep(0.05)


def _silent_producer(hang_up: bool = False) -> tuple[int, threading.Event]:
    """A listener that accepts a pull and never answers (a producer hung mid-handshake), or with
    `hang_up` closes the connection at once (one that died mid-handshake)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop, held = threading.Event(), []

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = server.accept()[0]
            except OSError:
                continue
            if hang_up:
                conn.close()
            else:
                held.append(conn)
        for conn in held:
            conn.close()
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1], stop


def test_greedy_tokens_equal_an_aggregated_core_and_only_missing_pages_move(cores):
    producer, consumer, aggregated = cores
    shared = list(range(20, 40))
    for i, prompt in enumerate([list(range(10, 40)), shared + list(range(100, 117)), shared + list(range(200, 212)),
                                list(range(60, 63))]):
        expected, _ = _run(aggregated, f"a{i}", prompt, 6)
        _, params = _run(producer, f"p{i}", prompt, 1, {"do_remote_decode": True})
        assert params["remote_block_ids"] == params["remote_block_ids"][:(len(prompt) - 1) // BLOCK]
        received = consumer.kv_transfer.counters.external_hits
        local = consumer.kv.prefix_hits
        got, _ = _run(consumer, f"c{i}", prompt, 6, params)
        assert got == expected
        usable = (len(prompt) - 1) // BLOCK * BLOCK
        pulled = consumer.kv_transfer.counters.external_hits - received
        # What the consumer held already was not pulled again; the rest was.
        assert consumer.kv.prefix_hits - local == usable
        assert pulled == [28, 36, 8, 0][i]  # the third shares 5 pages with the second: they stay local
    assert consumer.kv_transfer.counters.failures == 0
    _idle(producer)
    _idle(consumer)


def test_faults_over_many_requests_fall_back_and_leak_no_page(cores):
    producer, consumer, aggregated = cores
    rng = random.Random(0)
    silent_port, stop_silent = _silent_producer(hang_up=True)
    before = consumer.kv_transfer.counters.fallbacks
    expected_fallbacks = 0
    try:
        for i in range(150):
            prompt = [rng.randrange(10, 500) for _ in range(rng.randrange(9, 40))]
            _, params = _run(producer, f"fp{i}", prompt, 1, {"do_remote_decode": True})
            kind = i % 6
            if kind == 0:
                params = dict(params, remote_port=1)  # a dead producer: nothing listens
            elif kind == 1:
                params = dict(params, remote_port=silent_port)  # a producer that hangs up mid-handshake
            elif kind == 2:
                params = dict(params, remote_request_id="gone")  # its hold expired or never was
            elif kind == 3:
                params = dict(params, remote_fingerprint="0" * 32)  # another model's pages
            if kind == 4:  # the client goes away while the pull runs
                _run(consumer, f"fc{i}", prompt, 4, params, abort_after_steps=0)
                continue
            expected_fallbacks += kind < 4
            got, _ = _run(consumer, f"fc{i}", prompt, 2, params)
            if kind < 4 and i < 24:  # the tokens are right whatever failed (checked on a sample: it is slow)
                assert got == _run(aggregated, f"fa{i}", prompt, 2)[0]
    finally:
        stop_silent.set()
    assert consumer.kv_transfer.counters.fallbacks - before == expected_fallbacks
    _idle(consumer)
    _idle(producer)
    assert producer.kv_transfer.pages_held == 0


def test_a_request_waiting_for_its_pages_holds_up_no_other(cores):
    """A producer that never answers: the request waits, passed over, while another runs to its
    end (3 steps of the tiny model, far inside the 3 s bound), then computes its prompt itself."""
    producer, consumer, _ = cores
    silent_port, stop_silent = _silent_producer()
    try:
        _, params = _run(producer, "w-p", list(range(30, 60)), 1, {"do_remote_decode": True})
        consumer.add_request(EngineCoreRequest(request_id="w-slow", prompt_token_ids=list(range(30, 60)),
                                               sampling_params=SamplingParams(max_tokens=2, temperature=0.0,
                                               kv_transfer_params=dict(params, remote_port=silent_port))))
        tokens = []
        consumer.add_request(EngineCoreRequest(request_id="w-other", prompt_token_ids=[5, 6, 7, 8, 9],
                                               sampling_params=SamplingParams(max_tokens=3, temperature=0.0,
                                                                              ignore_eos=True)))
        while len(tokens) < 3:
            tokens += [t for out in consumer.step().outputs if out.request_id == "w-other" for t in out.new_token_ids]
        assert consumer.scheduler.requests["w-slow"].waits_for_remote_kv  # still waiting, passed over
        fallbacks = consumer.kv_transfer.counters.fallbacks
        while consumer.has_unfinished_requests():  # then the pull times out and it computes the prompt
            consumer.step()
        assert consumer.kv_transfer.counters.fallbacks == fallbacks + 1
    finally:
        stop_silent.set()
    _idle(consumer)
    _idle(producer)


def test_the_producer_refuses_a_mismatched_consumer_at_the_handshake(cores):
    """The producer's own check (a consumer checks the params first, so only a consumer that
    lies or was configured otherwise gets here): model, page size, connector, pages not held."""
    from pagoda_engine.core.kv_transfer import _recv_message, _send_message

    producer, consumer, _ = cores
    _, params = _run(producer, "hs-p", list(range(70, 90)), 1, {"do_remote_decode": True})
    honest = {"op": "pull", "request_id": params["remote_request_id"], "block_ids": params["remote_block_ids"],
              "fingerprint": consumer.kv_transfer.fingerprint, "description": "the consumer", "block_size": BLOCK,
              "connector": consumer.kv_transfer.connector}
    for change, error in [({"fingerprint": "1" * 32}, "KV mismatch"), ({"block_size": 8}, "page size mismatch"),
                          ({"connector": "SomethingElse"}, "connector mismatch"),
                          ({"block_ids": [PAGES + 5]}, "not held"), ({"request_id": "nope"}, "no pages held")]:
        with socket.create_connection(("127.0.0.1", producer.kv_transfer.port), timeout=10) as sock:
            _send_message(sock, {**honest, **change})
            reply = _recv_message(sock)
        assert reply["ok"] is False and error in reply["error"], (change, reply)
        if change.get("request_id") != "nope":  # a refused pull releases the hold: make it again
            _, params = _run(producer, f"hs-p{len(error)}", list(range(70, 90)), 1, {"do_remote_decode": True})
            honest.update(request_id=params["remote_request_id"], block_ids=params["remote_block_ids"])
    _idle(producer)


def test_the_config_is_checked_where_it_enters():
    assert not parse_kv_transfer_config(None).enabled
    config = parse_kv_transfer_config('{"kv_role": "kv_both", "kv_connector": "PagodaTorchConnector"}')
    assert config.is_producer and config.is_consumer and config.transfer_timeout_s == 10.0
    for bad, named in [('{"kv_role": "kv_decoder"}', "kv_role"), ('{"kv_connector": "LMCacheConnectorV1", '
                       '"kv_role": "kv_producer"}', "LMCacheConnectorV1"), ('{"kv_role": "kv_producer", "kv_rank": 0}',
                       "kv_rank"), ('{"kv_role": "kv_producer", "colour": 1}', "colour"),
                       ('{"kv_role": "kv_producer", "kv_connector_extra_config": {"hold_timeout_s": 0}}',
                        "hold_timeout_s"), ('{"kv_port": 5}', "kv_role"), ("[1]", "JSON object")]:
        with pytest.raises(ValueError, match=named):
            parse_kv_transfer_config(bad)
    with pytest.raises(ValueError, match="enable-prefix-caching"):
        EngineConfig.from_kwargs(kv_transfer_config='{"kv_role": "kv_producer"}', enable_prefix_caching=False)
    consumer = parse_kv_transfer_config('{"kv_role": "kv_consumer"}')
    assert "kv_producer" in check_request_params({"do_remote_decode": True}, consumer)
    assert "remote_block_ids" in check_request_params({"do_remote_prefill": True, "remote_block_ids": "1"}, consumer)
    done = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", "pagoda-tiny",
                           "--kv-transfer-config", '{"kv_role": "kv_prefill"}'], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "kv_role" in done.stderr


def pages_of(core: EngineCore, hashes: list[str]) -> list:
    """The bytes of the cached pages under these hashes, every layer's (a test's look into rank 0)."""
    import torch

    caches = core.executor.worker.attn.kv_caches
    ids = [core.kv.pool.cached[bytes.fromhex(h)].page_id for h in hashes]
    return [torch.stack([c[i] for c in caches]) for i in ids]


def test_pulled_pages_are_bit_identical_to_the_producers(cores):
    import torch

    producer, consumer, _ = cores
    prompt = list(range(300, 341))
    _, params = _run(producer, "bits-p", prompt, 1, {"do_remote_decode": True})
    received = consumer.kv_transfer.counters.external_hits
    consumer.kv.pool.record_events()  # KV events on: pulled pages are reported as stored, as computed ones are
    try:
        _run(consumer, "bits-c", prompt, 1, params)
        stored = [h for e in consumer.kv.pool.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    finally:
        consumer.kv.pool.events = None
    assert consumer.kv_transfer.counters.external_hits - received == 40  # pulled, not computed here
    hashes = params["remote_block_hashes"]
    assert stored[:10] == [block_hash_int(bytes.fromhex(h)) for h in hashes]
    assert len(hashes) == 10
    for mine, theirs in zip(pages_of(consumer, hashes), pages_of(producer, hashes)):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))


def test_a_lora_requests_pages_move_under_its_adapter_never_the_base_models(tmp_path):
    """The same prompt under the base model and under an adapter on both sides: the producer holds
    the adapter's pages for the adapter's request (not the base model's, which it caches too), the
    consumer counts none of its base pages as the adapter's, and the adapter's greedy tokens are
    an aggregated core's (PEFT's KV and the base model's differ for the same tokens)."""
    pytest.importorskip("peft")
    from lora_adapters import write_adapter

    from pagoda_engine.lora import LoRARequest

    model = build_tiny_model(tmp_path / "m")
    adapter = write_adapter(model, tmp_path / "a", 8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=1)
    lora = LoRARequest("a", 1, adapter)
    extra = {"hold_timeout_s": 5, "transfer_timeout_s": TIMEOUT_S}

    def core(transfer: dict | None) -> EngineCore:
        kwargs = {"kv_transfer_config": json.dumps(transfer)} if transfer else {}
        return EngineCore(EngineConfig.from_kwargs(model=str(model), num_kv_pages=PAGES, block_size=BLOCK,
                                                   enable_lora=True, max_lora_rank=8, lora_modules=[f"a={adapter}"],
                                                   **kwargs))

    def run(c: EngineCore, rid: str, prompt: list[int], lora_request, params=None):
        return _run(c, rid, prompt, 6, params, lora_request=lora_request)

    cores = [core({"kv_role": "kv_producer", "kv_port": 0, "kv_connector": "PagodaTorchConnector",
                   "kv_connector_extra_config": extra}),
             core({"kv_role": "kv_consumer", "kv_connector": "PagodaTorchConnector", "kv_connector_extra_config": extra}),
             core(None)]
    producer, consumer, aggregated = cores
    try:
        prompt = list(range(10, 40))
        want_base, _ = run(aggregated, "base", prompt, None)
        want_lora, _ = run(aggregated, "lora", prompt, lora)
        assert want_lora != want_base
        _, base_params = run(producer, "p-base", prompt, None, {"do_remote_decode": True})
        _, lora_params = run(producer, "p-lora", prompt, lora, {"do_remote_decode": True})
        assert set(lora_params["remote_block_ids"]).isdisjoint(base_params["remote_block_ids"])
        assert run(consumer, "c-base", prompt, None, base_params)[0] == want_base  # the base's pages, here now
        received = consumer.kv_transfer.counters.external_hits
        assert run(consumer, "c-lora", prompt, lora, lora_params)[0] == want_lora
        assert consumer.kv_transfer.counters.external_hits - received == (len(prompt) - 1) // BLOCK * BLOCK
        assert consumer.kv_transfer.counters.failures == 0
        _idle(producer)
        _idle(consumer)
    finally:
        for c in cores:
            c.close()

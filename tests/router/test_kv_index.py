"""The KV-event index and the scorer, driven directly: pages keyed by their tokens whatever the
engine's hashes (and by their LoRA adapter), removals and clears, both wire layouts of vLLM's
events, a store whose parent is unknown, and the ranking's three parts."""

from __future__ import annotations

import msgspec

from pagoda_engine.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from pagoda_engine.router.kv_index import KVIndex, pod_of_topic
from pagoda_engine.router.scorer import Candidate, rank

BS = 4


def _stored(hashes, parent, tokens):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, lora_id=None,
                       medium="GPU", lora_name=None)


def _wire(*events) -> list:
    """What a subscriber decodes off the wire (untyped), as the index gets it."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=list(events))))


def test_pages_are_keyed_by_their_tokens_not_the_engines_hashes():
    index = KVIndex()
    tokens = list(range(1, 13))
    index.apply("a", _wire(_stored([11, 12], None, tokens[:8]), _stored([13], 12, tokens[8:])))
    index.apply("b", _wire(_stored([901, 902], None, tokens[:8])))  # other hashes, same tokens
    assert index.matched_tokens(tokens + [99], ["a", "b", "c"]) == {"a": 12, "b": 8, "c": 0}
    assert index.matched_tokens([0] + tokens, ["a", "b"]) == {"a": 0, "b": 0}  # a prefix, not a substring
    index.apply("a", _wire(BlockRemoved(block_hashes=[12], medium="GPU")))
    assert index.matched_tokens(tokens, ["a"]) == {"a": 4}  # the chain breaks at the removed page
    index.apply("b", _wire(AllBlocksCleared()))
    assert index.matched_tokens(tokens, ["b"]) == {"b": 0}


def test_an_adapters_pages_match_its_requests_only_and_the_base_models_its_own():
    index = KVIndex()
    tokens = list(range(1, 13))
    index.apply("base", _wire(_stored([11, 12], None, tokens[:8])))
    sql = BlockStored(block_hashes=[21, 22], parent_block_hash=None, token_ids=tokens[:8], block_size=BS, lora_id=1,
                      medium="GPU", lora_name="sql")
    more = BlockStored(block_hashes=[23], parent_block_hash=22, token_ids=tokens[8:], block_size=BS, lora_id=1,
                       medium="GPU", lora_name="sql")
    index.apply("lora", _wire(sql, more))  # the same tokens under an adapter: other K/V
    pods = ["base", "lora"]
    assert index.matched_tokens(tokens, pods) == {"base": 8, "lora": 0}
    assert index.matched_tokens(tokens, pods, adapter="sql") == {"base": 0, "lora": 12}
    assert index.matched_tokens(tokens, pods, adapter="chat") == {"base": 0, "lora": 0}


def test_the_older_array_layout_and_other_media_and_unknown_parents():
    index = KVIndex()
    legacy = [1.0, [["BlockStored", [5], None, [1, 2, 3, 4], BS, None, "GPU", None]], 0]
    index.apply("a", legacy)
    assert index.matched_tokens([1, 2, 3, 4], ["a"]) == {"a": 4}
    index.apply("a", _wire(BlockStored(block_hashes=[6], parent_block_hash=5, token_ids=[5, 6, 7, 8], block_size=BS,
                                       lora_id=None, medium="CPU", lora_name=None)))
    assert index.matched_tokens(list(range(1, 9)), ["a"]) == {"a": 4}  # an offload tier's copy is no device hit
    index.apply("b", _wire(_stored([7], 999, [5, 6, 7, 8])))  # its parent never seen: cannot be placed
    assert index.num_keys("b") == 0
    assert pod_of_topic(b"kv@10.0.0.5@llama") == "10.0.0.5" and pod_of_topic(b"other") is None


def test_rank_weighs_prefix_queue_and_kv_usage_and_puts_a_full_queue_last():
    holder = Candidate("a", waiting=1, matched_tokens=96)
    idle = Candidate("b", waiting=0)
    assert rank([idle, holder], 100) == ["a", "b"]  # the prefix outweighs one waiting request
    assert rank([Candidate("a", waiting=200, matched_tokens=100), idle], 100) == ["b", "a"]
    assert rank([Candidate("a", kv_usage=0.9), Candidate("b", kv_usage=0.1)], 0) == ["b", "a"]
    assert rank([Candidate("b"), Candidate("a")], 0) == ["a", "b"]  # ties: stable by name
    assert rank([], 10) == []


def test_the_cached_tokenizer_gives_the_whole_texts_ids():
    """Cut where the pre-tokenizer cuts anyway, the pieces' ids are the whole text's: checked on the
    built-in tiny model's tokenizer and on the default model's (SmolLM2), over texts of many kinds."""
    import numpy as np
    import pytest

    from pagoda_engine.model_path import resolve_model_path
    from pagoda_engine.router.prompt_pages import CachedTokenizer
    from pagoda_engine.tokenizer_files import load_tokenizer

    for model in ("pagoda-tiny", None):
        try:
            tokenizer = load_tokenizer(resolve_model_path(model))
        except Exception as e:  # the default model's package is not installed here
            pytest.skip(f"no tokenizer for {model}: {e}")
        cached = CachedTokenizer(tokenizer, chunk_chars=64)
        rng = np.random.default_rng(1)
        texts = [tokenizer.decode(rng.integers(50, min(len(tokenizer), 30000), size=600).tolist()) for _ in range(5)]
        texts += [" ".join(["Hello, world! It's 2026: ünïcode, 東京, \n\ttabs and  spaces."] * 40)]
        for text in texts:
            for special in (True, False):
                whole = list(tokenizer.encode(text, add_special_tokens=special))
                assert cached.encode(text, add_special_tokens=special) == whole
                assert cached.encode(text, add_special_tokens=special) == whole  # from the cache
        if model is None:
            assert cached.exact  # a byte-level BPE: the pieces are cached


def test_the_served_endpoint_moves_the_in_flight_count():
    """The gateway reports the endpoint that answered (x-gateway-destination-endpoint-served in the
    response's metadata): after a fallback, the picker counts the request on that pod."""
    import asyncio
    import json

    import httpx
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from google.protobuf import struct_pb2

    from pagoda_engine.router.backends import Backend, BackendPool
    from pagoda_engine.router.epp import Picker, build_servicer
    from pagoda_engine.router.metrics import RouterMetrics
    from pagoda_engine.router.scorer import Weights

    async def scenario():
        pool = BackendPool(httpx.AsyncClient(), RouterMetrics())
        for host in ("10.0.0.1", "10.0.0.2"):
            pool.backends[f"http://{host}:8000"] = Backend(f"http://{host}:8000", ready=True)
        picker = Picker(pool, None, Weights(), 128.0)
        servicer, _ = build_servicer(picker)
        served = struct_pb2.Struct()
        served.update({"x-gateway-destination-endpoint-served": "10.0.0.2:8000"})
        metadata = base_pb2.Metadata()
        metadata.filter_metadata["envoy.lb"].CopyFrom(served)
        counts = []

        async def requests():
            yield pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=False))
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps({"prompt": "x"}).encode(),
                                                                 end_of_stream=True))
            counts.append({b.url: b.in_flight for b in pool.backends.values()})
            yield pb.ProcessingRequest(response_headers=pb.HttpHeaders(), metadata_context=metadata)
            counts.append({b.url: b.in_flight for b in pool.backends.values()})

        answers = [a async for a in servicer.Process(requests(), None)]
        counts.append({b.url: b.in_flight for b in pool.backends.values()})
        return answers, counts

    answers, counts = asyncio.run(scenario())
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body", "response_headers"]
    assert counts[0] == {"http://10.0.0.1:8000": 1, "http://10.0.0.2:8000": 0}  # picked: ties go by name
    assert counts[1] == {"http://10.0.0.1:8000": 0, "http://10.0.0.2:8000": 1}  # the fallback answered
    assert counts[2] == {"http://10.0.0.1:8000": 0, "http://10.0.0.2:8000": 0}  # the stream ended


def test_prompts_sharing_a_prefix_give_the_whole_texts_ids_and_page_keys():
    """A tenant's prefix is found by comparing the text with the pieces that last followed its
    first piece (not cut and looked up again): whatever follows it (a question, a truncation mid
    piece, a character that moves the next cut), the ids and the page keys are those of the whole
    text, with a cache too small to hold a prefix as well."""
    import numpy as np
    import pytest

    from pagoda_engine.model_path import resolve_model_path
    from pagoda_engine.router.prompt_pages import ROOT, CachedTokenizer, chain, token_bytes
    from pagoda_engine.tokenizer_files import load_tokenizer

    class Counting(CachedTokenizer):
        looked_up = 0

        def _piece(self, *args):
            self.looked_up += 1
            return super()._piece(*args)

    for model in ("pagoda-tiny", None):
        try:
            tokenizer = load_tokenizer(resolve_model_path(model))
        except Exception as e:  # the default model's package is not installed here
            pytest.skip(f"no tokenizer for {model}: {e}")
        cached = Counting(tokenizer, chunk_chars=48)
        small = CachedTokenizer(tokenizer, chunk_chars=48, cache_size=120)  # runs and pieces evicted all along
        if not cached.exact:
            continue
        rng, held = np.random.default_rng(2), 0
        prefixes = [tokenizer.decode(rng.integers(50, min(len(tokenizer), 30000), size=300).tolist()) for _ in range(2)]
        prefixes.append(" ".join(f"tenant line {i}, with words." for i in range(40)))
        for prefix in prefixes:
            texts = [prefix + " what is it?", prefix + " why", prefix, prefix + " what is it? A test. And then?"]
            for cut in rng.integers(len(prefix) // 3, len(prefix), size=6):
                texts += [prefix[:cut] + tail for tail in (" question here", "x and more", "!", " 7 up")]
            for special in (True, False):
                for text in texts:
                    whole = list(tokenizer.encode(text, add_special_tokens=special))
                    prompt = cached.prompt(text, add_special_tokens=special)
                    assert prompt.tokens() == whole and prompt.num_tokens == len(whole)
                    assert small.prompt(text, add_special_tokens=special).tokens() == whole
                    assert len(small._cache) + small._held <= 120  # what the runs hold counts too
                    held = max(held, small._held)
                    for size in (4, 16):
                        assert prompt.keys(size) == chain(ROOT, b"", token_bytes(whole), size)[0]
                looked_up = cached.looked_up
                prompt = cached.prompt(prefix + " one more question", add_special_tokens=special)
                # The first piece, the one where the prefix ends and perhaps one after: the rest is the run.
                assert cached.looked_up - looked_up <= 3 and len(prompt.pieces) > 5
        assert held > 0  # the small cache remembered runs too
        # Questions after a prefix: the prefix's text up to the first question's start is kept as
        # a piece, so the next question is about all that is tokenized (whole pieces of the prefix
        # would be up to 48 characters more).
        questions = (" Where is the first one?", " How many lines are there?", " Which tenant is this?")
        for extra in range(12):  # a prefix whose last whole piece ends 32 characters or more before it does
            prefix = prefixes[-1] + " and one more" * extra
            cuts, j = [], 0
            while (j := cached._cut(prefix + questions[0], j + 48)) >= 0:
                cuts.append(j)
            if len(prefix) - max(j for j in cuts if j <= len(prefix)) >= 32:
                break
        tokenized = []
        cached._whole = lambda text, special: tokenized.append(text) or CachedTokenizer._whole(cached, text, special)
        for question in questions:
            tokenized.clear()
            assert cached.prompt(prefix + question).tokens() == list(tokenizer.encode(prefix + question))
        # (a piece under 16 characters is not kept: the tail takes it along)
        assert len(tokenized) == 1 and len(tokenized[0]) < len(questions[-1]) + 16

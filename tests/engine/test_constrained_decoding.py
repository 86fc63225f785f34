"""Structured outputs and logit_bias inside the engine: the compile cache, a request waiting for
its grammar while others run, the bitmask applied to constrained rows only, and the offline `LLM`
under synchronous, async and pipeline-parallel scheduling and with speculative decoding (drafts
verified under the grammar's masks after the drafts before them)."""

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest
import torch

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.bench.spec_replay import ReplayProposer
from pagoda_engine.config import SchedulerConfig
from pagoda_engine.core.kv.manager import KVCacheManager
from pagoda_engine.core.request import Request
from pagoda_engine.core.sampling_batch import sampling_batch
from pagoda_engine.core.scheduler import Scheduler
from pagoda_engine.core.spec_decode import SpecDecoder
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.sampling_params import StructuredOutputsParams
from pagoda_engine.structured_outputs import CompileCache, GrammarCompiler, RequestGrammar, check
from pagoda_engine.worker.sampling import Sampler, apply_token_bitmask

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 100, "maximum": 999},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    "name": {"type": "string", "maxLength": 5}}, "required": ["id", "tags", "name"], "additionalProperties": False}
JSON = StructuredOutputsParams(json=SCHEMA)


# --- the compile cache ------------------------------------------------------------------------------

def test_the_cache_makes_each_spec_once_and_equal_schemas_share_an_entry():
    made = []
    cache = CompileCache(lambda p: made.append(p.spec) or len(made))
    reordered = StructuredOutputsParams(json=json.dumps(dict(reversed(list(SCHEMA.items())))))
    assert cache.get(JSON) == cache.get(reordered) == 1  # key order and dict vs text do not matter
    assert cache.get(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=False)) == 2
    assert cache.get(StructuredOutputsParams(regex="a+")) == 3
    assert (cache.hits, cache.misses, len(made)) == (1, 3, 3)


def test_concurrent_requests_for_one_spec_compile_it_once():
    started, release = threading.Event(), threading.Event()
    calls = []

    def make(p):
        calls.append(p)
        started.set()
        release.wait(10)
        return object()

    cache = CompileCache(make)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(cache.get, JSON) for _ in range(4)]
        started.wait(10)
        release.set()
        results = {id(f.result()) for f in futures}
    assert len(calls) == 1 and len(results) == 1


def test_the_cache_keeps_errors_and_drops_the_least_recently_used():
    calls = []

    def make(p):
        calls.append(p.regex)
        if p.regex == "bad":
            raise InvalidRequestError("bad regex")
        return p.regex

    cache = CompileCache(make, size=2)
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            cache.get(StructuredOutputsParams(regex="bad"))
    assert calls == ["bad"]
    cache.get(StructuredOutputsParams(regex="a"))
    cache.get(StructuredOutputsParams(regex="b"))  # evicts "bad", the least recently used
    cache.get(StructuredOutputsParams(regex="a"))
    assert len(cache) == 2 and calls == ["bad", "a", "b"]
    with pytest.raises(InvalidRequestError):
        cache.get(StructuredOutputsParams(regex="bad"))
    assert calls == ["bad", "a", "b", "bad"]


@pytest.mark.parametrize("params,param,words", [
    (StructuredOutputsParams(json={"type": "frobnicate"}), "structured_outputs.json", "frobnicate"),
    (StructuredOutputsParams(json={"type": "string", "minLength": 5, "maxLength": 2}), "structured_outputs.json",
     ""),
    (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex", "regex"),
    (StructuredOutputsParams(grammar="start: nowhere"), "structured_outputs.grammar", "nowhere"),
])
def test_check_names_the_problem(params, param, words):
    with pytest.raises(InvalidRequestError) as e:
        check(params)
    assert e.value.param == param and words in e.value.message


def test_exactly_one_constraint_kind():
    for kwargs in ({}, {"regex": "a", "choice": ["a"]}, {"json": {}, "json_object": True}):
        with pytest.raises(InvalidRequestError, match="exactly one"):
            StructuredOutputsParams(**kwargs)
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})


# --- waiting for a compile ---------------------------------------------------------------------------

def test_a_request_waits_unscheduled_until_its_grammar_is_compiled_while_others_run():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(64, 4), 256)
    compiled = Future()
    waiting = Request(request_id="constrained", prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(),
                      grammar=RequestGrammar(compiled, compiler=None))
    free = Request(request_id="free", prompt_token_ids=[4, 5, 6], sampling_params=SamplingParams())
    scheduler.add_request(waiting)
    scheduler.add_request(free)  # arrived later, runs first
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["free"]
    scheduler.update_from_output(out, {"free": 9})
    compiled.set_result(object())
    out = scheduler.schedule()
    assert {s.request.request_id for s in out.scheduled} == {"free", "constrained"}


# --- the mask ----------------------------------------------------------------------------------------

def test_the_bitmask_masks_only_its_rows_and_the_padded_vocabulary_tail():
    logits = torch.arange(2 * 70, dtype=torch.float32).view(2, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[0, 2] = -1  # tokens 64..95: only 64..69 exist
    masked = apply_token_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.equal(masked[0], logits[0])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed == [0, 2, 64, 65, 66, 67, 68, 69]


def test_fill_bitmask_leaves_ids_past_the_tokenizer_clear(tmp_path):
    from pagoda_engine.api.tokenizer import load_tokenizer
    from pagoda_engine.tiny import default_model_dir
    import llguidance.hf

    tokenizer = load_tokenizer(default_model_dir())
    padded = len(tokenizer) + 45  # an LM head padded past the tokenizer's vocabulary
    compiler = GrammarCompiler(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=padded))
    grammar = compiler.submit(StructuredOutputsParams(regex="[a-z]+"))
    grammar.future.result(timeout=30)
    bitmask = compiler.fill_bitmask([grammar], padded)
    assert bitmask.shape == (1, (padded + 31) // 32)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:padded]
    assert bits.sum() > 0 and not bits[len(tokenizer):].any()
    compiler.close()


def test_prepare_builds_the_tokenizer_once_before_the_first_request_and_a_failure_waits_for_it(caplog):
    from pagoda_engine.api.tokenizer import load_tokenizer
    from pagoda_engine.tiny import default_model_dir
    import llguidance.hf

    tokenizer = load_tokenizer(default_model_dir())
    built = []
    compiler = GrammarCompiler(lambda: built.append(1) or llguidance.hf.from_tokenizer(tokenizer))
    compiler.prepare().result(timeout=30)
    assert built == [1] and compiler.cache.misses == 0  # built with no request's grammar asked for
    compiler.submit(StructuredOutputsParams(regex="[a-z]+")).future.result(timeout=30)
    assert built == [1]
    compiler.close()

    def broken():
        raise RuntimeError("no vocabulary here")

    compiler = GrammarCompiler(broken)
    with caplog.at_level("WARNING", logger="pagoda_engine.structured_outputs"):
        compiler.prepare().result(timeout=30)  # logged, not raised: the engine starts
    assert "no vocabulary here" in caplog.text
    grammar = compiler.submit(StructuredOutputsParams(regex="[a-z]+"))
    grammar.future.exception(timeout=30)
    assert "no vocabulary here" in str(grammar.error())  # the request hears of it
    compiler.close()


# --- the engine --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    with LLM("pagoda-tiny", num_kv_pages=256, max_model_len=512) as engine:
        yield engine


def _texts(outputs):
    return [o.outputs[0].text for o in outputs]


def test_a_started_core_has_its_grammar_tokenizer_before_any_constrained_request(llm):
    """(First of the engine's tests: no constrained request has reached the core yet.)"""
    assert llm.core.grammars.cache.misses == 0
    assert llm.core.grammars._tokenizer is not None


def test_offline_constrained_outputs_follow_the_schema_and_free_ones_are_untouched(llm):
    free_prompts = ["The cat", "Once upon a time", "1 2 3"]
    greedy = SamplingParams(temperature=0, max_tokens=20)
    alone = _texts(llm.generate(free_prompts, greedy))
    constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=200, structured_outputs=JSON)
    mixed = llm.generate(free_prompts + ["a", "b"], [greedy] * 3 + [constrained] * 2)
    assert _texts(mixed[:3]) == alone
    for out in mixed[3:]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_logit_bias_forces_and_bans_tokens_offline(llm):
    forced = llm.generate(["x"], SamplingParams(temperature=1.0, seed=0, max_tokens=5, logit_bias={42: 100}))
    assert forced[0].outputs[0].token_ids == [42] * 5
    first = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    banned = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100}))
    assert banned[0].outputs[0].token_ids[0] != first
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate(["x"], SamplingParams(logit_bias={10**6: 1.0}))


def test_an_invalid_grammar_is_refused_before_it_is_queued(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert e.value.param == "structured_outputs.regex"
    assert not llm.core.has_unfinished_requests()
    # Every request of a call is checked before any is queued: the good one beside it is not left behind.
    with pytest.raises(InvalidRequestError):
        llm.generate(["x", "y"], [SamplingParams(max_tokens=2),
                                  SamplingParams(structured_outputs=StructuredOutputsParams(regex="("))])
    assert not llm.core.has_unfinished_requests()


def _constrained_batch():
    params = [SamplingParams(temperature=0, max_tokens=20),
              SamplingParams(temperature=0, max_tokens=200, structured_outputs=JSON),
              SamplingParams(temperature=0.7, seed=5, max_tokens=60,
                             structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma"])),
              SamplingParams(temperature=0, max_tokens=20, logit_bias={7: 5.0, 9: -3.0})]
    return ["p one", "p two", "p three", "p four"], params


def test_async_scheduling_gives_the_synchronous_tokens_with_grammars(llm):
    prompts, params = _constrained_batch()
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM("pagoda-tiny", num_kv_pages=256, max_model_len=512, async_scheduling=True) as overlapped:
        got = [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)]
    assert got == want
    jsonschema.validate(json.loads(llm.get_tokenizer().decode(want[1], skip_special_tokens=True)), SCHEMA)


def test_pipeline_parallel_samples_with_the_grammar_on_the_last_stage(llm):
    prompts, params = _constrained_batch()
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with LLM("pagoda-tiny", num_kv_pages=256, max_model_len=512, pipeline_parallel_size=2) as pp:
        got = [o.outputs[0].token_ids for o in pp.generate(prompts, params)]
    assert got == want


def _allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


def test_verification_rows_mask_after_the_drafts_before_them_and_leave_the_matcher_as_it_was(llm):
    compiler, vocab = llm.core.grammars, llm.core.vocab_size
    grammar = compiler.submit(JSON)
    grammar.future.result(timeout=60)
    before = compiler.fill_bitmask([grammar], vocab)[0]
    first = int(_allowed(before, vocab)[0])  # '{'
    after_first = grammar.matcher.deep_copy()
    assert after_first.consume_token(first)
    second = compiler.fill_bitmask([grammar], vocab)  # (the request's own matcher did not move)
    reference = np.zeros_like(second)
    after_first.unsafe_compute_mask_ptr(reference.ctypes.data, reference.shape[1] * 4)
    refused = int(np.setdiff1d(np.arange(vocab), _allowed(reference[0], vocab))[0])
    rows = compiler.fill_bitmask([grammar] * 4, vocab, [[], [first], [first, refused], [first, refused, first]])
    assert (rows[0] == before).all() and (second[0] == before).all()
    assert (rows[1] == reference[0]).all() and not (rows[1] == before).all()
    # Past a refused draft the rows repeat the mask at it, which excludes it: verification stops there.
    assert (rows[2] == rows[1]).all() and (rows[3] == rows[1]).all() and refused not in _allowed(rows[2], vocab)
    assert (compiler.fill_bitmask([grammar], vocab)[0] == before).all()  # rolled back


def test_speculation_keeps_the_tokens_of_decoding_without_it_under_grammars(llm):
    """Greedy and seeded constrained rows (and free ones beside them) verify drafts that are all
    kept, partly refused (random replacements the grammar mostly refuses) or all refused: the
    tokens written without speculation every time."""
    prompts, params = _constrained_batch()
    plain = llm.generate(prompts, params)
    want = [o.outputs[0].token_ids for o in plain]
    continuations = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in plain}
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM("pagoda-tiny", num_kv_pages=256, max_model_len=512, speculative_config=ngram) as spec:
        config = spec.core.scheduler.spec.config
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want  # prompt lookup's drafts
        for acceptance in (1.0, 0.5, 0.0):
            spec.core.scheduler.spec = SpecDecoder(config, ReplayProposer(continuations, acceptance, spec.core.vocab_size))
            assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want, acceptance
            stats = spec.core.scheduler.spec.stats
            kept, drafted = stats.num_accepted_tokens, stats.num_draft_tokens
            assert drafted > 0 and {1.0: kept == drafted, 0.5: 0 < kept < drafted, 0.0: kept == 0}[acceptance]
    jsonschema.validate(json.loads(llm.get_tokenizer().decode(want[1], skip_special_tokens=True)), SCHEMA)


def test_sampler_applies_bias_after_the_mask_and_before_greedy():
    vocab = 64
    req = Request(request_id="r", prompt_token_ids=[1], sampling_params=SamplingParams(
        temperature=0, logit_bias={5: 50.0, 6: 60.0}))
    batch = sampling_batch([req], vocab, torch.device("cpu"))
    logits = torch.zeros(1, vocab)
    assert Sampler().sample(logits, batch).token_ids == [6]
    batch.grammar_rows = torch.tensor([0])
    batch.grammar_bitmask = torch.tensor([[1 << 5, 0]], dtype=torch.int32)  # only token 5
    assert Sampler().sample(logits, batch).token_ids == [5]


def test_a_grammar_that_fails_to_compile_in_the_core_is_refused_and_the_core_moves_on(llm):
    """The API process checks grammars first; should one still fail in the core, the request is
    dropped with an EngineCoreError while the others are served."""
    from pagoda_engine.messages import EngineCoreRequest

    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(grammar="start: nowhere"))
    llm.core.add_request(EngineCoreRequest(request_id="bad", prompt_token_ids=[5, 6], sampling_params=bad))
    llm.core.add_request(EngineCoreRequest(request_id="good", prompt_token_ids=[5, 6],
                                           sampling_params=SamplingParams(max_tokens=2, temperature=0)))
    refused, finished = [], set()
    for _ in range(50):
        outputs = llm.core.step().outputs
        refused += llm.core.take_refused()
        finished |= {o.request_id for o in outputs if o.finish_reason}
        if not llm.core.has_unfinished_requests():
            break
    assert [(r.request_id, r.param) for r in refused] == [("bad", "structured_outputs.grammar")]
    assert finished == {"good"}

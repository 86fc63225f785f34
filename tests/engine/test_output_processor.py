"""The output processor: n fan-out with derived seeds, text deltas, stop-string aborts, finish flags, logprobs."""

import dataclasses

import msgspec
import pytest

from pagoda_engine.api.output_processor import OutputProcessor
from pagoda_engine.api.outputs import Logprob
from pagoda_engine.api.tokenizer import load_tokenizer
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.messages import EngineCoreOutput, EngineCoreRequest, Logprob as CoreLogprob, TokenLogprobs
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture
def processor(tokenizer):
    return OutputProcessor(tokenizer)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def add(processor, request_id="req", prompt="Hello", **params):
    ids = processor.tokenizer.encode(prompt)
    return processor.add_request(request_id, prompt, ids, SamplingParams(**params), arrival_time=12.5, priority=3)


def test_n_fans_out_into_children_with_derived_seeds(processor):
    params = SamplingParams(n=3, seed=7, temperature=0.8, stop=["x"], max_tokens=9)
    prompt_ids = processor.tokenizer.encode("Hello")
    children = processor.add_request("req", "Hello", prompt_ids, params, arrival_time=12.5, priority=3)
    assert [c.request_id for c in children] == ["req-0", "req-1", "req-2"]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9]
    for child in children:
        assert child.sampling_params == dataclasses.replace(params, n=1, seed=child.sampling_params.seed)
        assert child.prompt_token_ids == prompt_ids
        assert (child.arrival_time, child.priority) == (12.5, 3)
        # What crosses the ZMQ boundary comes back intact.
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(child), type=EngineCoreRequest)
        assert wire == child
    assert params.n == 3 and params.seed == 7  # the caller's params are not mutated

    [single] = add(processor, "solo", seed=5)
    assert single.request_id == "solo" and single.sampling_params.seed == 5
    unseeded = add(processor, "free", n=2)
    assert [c.sampling_params.seed for c in unseeded] == [None, None]


def test_invalid_requests_are_rejected(processor):
    add(processor, "dup")
    with pytest.raises(InvalidRequestError, match="already in use"):
        add(processor, "dup")
    with pytest.raises(InvalidRequestError) as excinfo:
        processor.add_request("empty", "", [], SamplingParams())
    assert excinfo.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        processor.add_request("", "x", [1], SamplingParams())


def test_children_aggregate_into_one_output_finished_when_all_are(processor, tokenizer):
    add(processor, n=3, max_tokens=4)
    texts = [" red fox", " blue sky", " 日本語"]
    ids = [encode(tokenizer, t) for t in texts]
    outputs_seen = []
    for step in range(max(len(i) for i in ids)):
        core_outputs = [
            EngineCoreOutput(
                request_id=f"req-{c}",
                new_token_ids=[ids[c][step]],
                finish_reason="length" if step == len(ids[c]) - 1 else None,
            )
            for c in range(3)
            if step < len(ids[c])
        ]
        result = processor.process_outputs(core_outputs)
        assert result.abort_child_ids == []
        [out] = result.request_outputs
        assert out.request_id == "req" and out.prompt == "Hello"
        assert [c.index for c in out.outputs] == [0, 1, 2]
        outputs_seen.append(out)
        # Only the children that got tokens this step are marked as updated.
        assert [c.updated for c in out.outputs] == [step < len(i) for i in ids]
        assert out.finished == (step == max(len(i) for i in ids) - 1)

    final = outputs_seen[-1]
    assert [c.text for c in final.outputs] == texts
    assert [c.token_ids for c in final.outputs] == ids
    assert [c.finish_reason for c in final.outputs] == ["length"] * 3
    for c in range(3):
        assert "".join(o.outputs[c].delta_text for o in outputs_seen) == texts[c]
        assert sum((o.outputs[c].delta_token_ids for o in outputs_seen), []) == ids[c]
    # Finished requests are forgotten; late outputs for them are ignored.
    assert processor.get_num_unfinished_requests() == 0
    assert processor.process_outputs([EngineCoreOutput(request_id="req-0", new_token_ids=[5])]).request_outputs == []


def test_stop_string_finishes_a_child_and_asks_for_its_abort(processor, tokenizer):
    add(processor, n=2, stop=["brown fox"])
    text = " the quick brown fox jumps"
    ids = encode(tokenizer, text)
    aborted, outs = [], []
    for token in ids:
        result = processor.process_outputs(
            [EngineCoreOutput(request_id=f"req-{c}", new_token_ids=[token]) for c in range(2)]
        )
        aborted.extend(result.abort_child_ids)
        outs.extend(result.request_outputs)
    assert aborted == ["req-0", "req-1"]  # once each, on the step that completed the stop string
    final = outs[-1]
    assert final.finished
    for child in final.outputs:
        assert (child.text, child.finish_reason, child.stop_reason) == (" the quick ", "stop", "brown fox")
        assert "".join(o.outputs[child.index].delta_text for o in outs) == " the quick "

    # The core finishing on the same step (e.g. max_tokens) is not aborted; the stop string still wins.
    add(processor, "late", stop=["fox"])
    result = processor.process_outputs(
        [EngineCoreOutput(request_id="late", new_token_ids=encode(tokenizer, " a fox"), finish_reason="length")]
    )
    assert result.abort_child_ids == []
    [child] = result.request_outputs[0].outputs
    assert (child.text, child.finish_reason, child.stop_reason) == (" a ", "stop", "fox")


def test_eos_and_length_finishes(processor, tokenizer):
    add(processor, "eos", skip_special_tokens=False)
    ids = encode(tokenizer, " Done.") + [tokenizer.eos_token_id]
    [out] = processor.process_outputs(
        [EngineCoreOutput(request_id="eos", new_token_ids=ids, finish_reason="stop", stop_reason=None)]
    ).request_outputs
    [child] = out.outputs
    assert (child.text, child.token_ids, child.finish_reason, child.stop_reason) == (" Done.", ids, "stop", None)

    # At max_tokens, text held back as a possible stop-string start is released.
    add(processor, "len", stop=["xyz"])
    [out] = processor.process_outputs(
        [EngineCoreOutput(request_id="len", new_token_ids=encode(tokenizer, " ab xy"), finish_reason="length")]
    ).request_outputs
    assert (out.outputs[0].text, out.outputs[0].finish_reason, out.finished) == (" ab xy", "length", True)


def test_logprobs_become_vllm_shaped_dicts(processor, tokenizer):
    add(processor, "lp", logprobs=1, prompt_logprobs=1)
    prompt_ids = tokenizer.encode("Hello")
    ids = encode(tokenizer, " the end")
    prompt_lps = [None] + [
        TokenLogprobs(chosen=CoreLogprob(t, -1.5, 4), top=[CoreLogprob(9, -0.1, 1)]) for t in prompt_ids[1:]
    ]
    deltas = []
    for k, token in enumerate(ids):
        lp = TokenLogprobs(chosen=CoreLogprob(token, -0.5 * (k + 1), 1), top=[CoreLogprob(token, -0.5 * (k + 1), 1)])
        [out] = processor.process_outputs(
            [EngineCoreOutput(request_id="lp", new_token_ids=[token], new_logprobs=[lp],
                              prompt_logprobs=prompt_lps if k == 0 else None)]
        ).request_outputs
        deltas.append(out.outputs[0].delta_logprobs)
    child = out.outputs[0]
    assert [list(d) for d in child.logprobs] == [[t] for t in ids]  # chosen token listed once
    assert child.logprobs[1][ids[1]] == Logprob(-1.0, 1, tokenizer.decode([ids[1]]))
    assert child.cumulative_logprob == pytest.approx(sum(-0.5 * (k + 1) for k in range(len(ids))))
    assert sum(deltas, []) == child.logprobs
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt_ids)
    assert out.prompt_logprobs[1] == {
        prompt_ids[1]: Logprob(-1.5, 4, tokenizer.decode([prompt_ids[1]])),
        9: Logprob(-0.1, 1, tokenizer.decode([9])),
    }

    add(processor, "nolp")
    [out] = processor.process_outputs([EngineCoreOutput(request_id="nolp", new_token_ids=ids[:1])]).request_outputs
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_abort_returns_the_running_children(processor, tokenizer):
    add(processor, n=3)
    processor.process_outputs([EngineCoreOutput(request_id="req-1", new_token_ids=[50], finish_reason="length")])
    assert processor.abort_request("req") == ["req-0", "req-2"]
    assert processor.abort_request("req") == []
    assert not processor.has_unfinished_requests()
    assert processor.process_outputs([EngineCoreOutput(request_id="req-0", new_token_ids=[50])]).request_outputs == []


def test_one_output_per_changed_user_request(processor, tokenizer):
    add(processor, "a")
    add(processor, "b")
    add(processor, "c")
    result = processor.process_outputs(
        [EngineCoreOutput(request_id=r, new_token_ids=encode(tokenizer, " hi")) for r in ("b", "a")]
    )
    assert [o.request_id for o in result.request_outputs] == ["b", "a"]
    assert all(o.outputs[0].delta_text == " hi" for o in result.request_outputs)

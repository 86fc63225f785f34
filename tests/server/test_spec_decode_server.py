"""`pagoda serve --speculative-config` (ngram, and a draft model: the tiny model drafting for itself)
through the official `openai` client: greedy text as the offline engine writes it without
speculation, streamed or not, with structured outputs too, and vLLM's spec_decode_* counters under
`pagoda:`."""

import json

import openai
import pytest

from conftest import DEFAULT_ARGS, launch, scrape

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "model": "pagoda-tiny", "num_speculative_tokens": 3}
PROMPTS = ["one two three one two three one two three one two", "the cat sat on the mat and the cat sat on the"]


@pytest.fixture(scope="module", params=[SPEC, DRAFT], ids=["ngram", "draft_model"])
def server(tmp_path_factory, request):
    srv = launch(tmp_path_factory.mktemp("serve"), *DEFAULT_ARGS, "--speculative-config", json.dumps(request.param))
    yield srv
    srv.proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_greedy_text_equals_the_engine_without_speculation_and_counters_move(client, server):
    from pagoda_engine import LLM, SamplingParams

    llm = LLM("pagoda-tiny", num_kv_pages=128, max_model_len=512)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40,
                                                                                 ignore_eos=True))]
    before = scrape(server.url)
    model = client.models.list().data[0].id
    for prompt, text in zip(PROMPTS, expected):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == text
        assert got.usage.completion_tokens == 40
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == text
    after = scrape(server.url)
    drafts = after["pagoda:spec_decode_num_drafts_total"] - before.get("pagoda:spec_decode_num_drafts_total", 0)
    drafted = after["pagoda:spec_decode_num_draft_tokens_total"]
    accepted = after["pagoda:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= drafted <= 3 * after["pagoda:spec_decode_num_drafts_total"]
    per_pos = [after.get(f"pagoda:spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}") for p in range(3)]
    assert None not in per_pos and sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 100, "maximum": 999},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4}},
          "required": ["id", "tags"], "additionalProperties": False}


def test_a_constrained_request_speculates_and_writes_what_it_writes_without(client, server):
    from pagoda_engine import LLM, SamplingParams
    from pagoda_engine.sampling_params import StructuredOutputsParams

    prompt = "tags tags tags x y x y x y"
    with LLM("pagoda-tiny", num_kv_pages=128, max_model_len=512) as llm:
        [expected] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=200,
                                                           structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    before = scrape(server.url).get("pagoda:spec_decode_num_drafts_total", 0)
    model = client.models.list().data[0].id
    got = client.completions.create(model=model, prompt=prompt, max_tokens=200, temperature=0,
                                    extra_body={"structured_outputs": {"json": SCHEMA}})
    assert got.choices[0].text == expected.outputs[0].text and got.choices[0].finish_reason == "stop"
    assert set(json.loads(got.choices[0].text)) == {"id", "tags"}
    assert scrape(server.url)["pagoda:spec_decode_num_drafts_total"] > before  # it drafted

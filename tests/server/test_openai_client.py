"""The official `openai` client, sync and async, against a real `pagoda serve` process."""

import asyncio

import httpx
import openai
import pytest

from pagoda_engine.tiny import corpus_text

from conftest import scrape

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == ["pagoda-tiny"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_completion_greedy_equals_offline_llm(client, model):
    from pagoda_engine import LLM, SamplingParams

    prompts = [PROMPT, corpus_text()[:200]]
    llm = LLM("pagoda-tiny", num_kv_pages=128, max_model_len=512)
    offline = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    for prompt, expected in zip(prompts, offline):
        got = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == expected.outputs[0].text
        assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert got.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_completion_prompt_forms_agree(client, model, server):
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    batch = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 2
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert PROMPT in back


def test_chat_completion_and_max_completion_tokens(client, model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    a = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=6, temperature=0)
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 6 and a.usage.prompt_tokens > 5


def test_streaming_with_usage_matches_non_streaming(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason

    messages = [{"role": "user", "content": "Tell me"}]
    chat_full = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    chat_chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == \
        chat_full.choices[0].message.content
    assert chat_chunks[-1].usage.total_tokens == chat_full.usage.total_tokens


def test_n_greater_than_one(client, model):
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=5)
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert 3 <= got.usage.completion_tokens <= 3 * 8  # usage counts all n sequences
    assert len({c.text for c in got.choices}) > 1, "n samples with different seeds should differ"
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=5, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same


def test_logprobs(client, model):
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == got.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(chosen, abs=1e-5)  # greedy picks the most likely
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]

    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True)
    lp = echoed.choices[0].logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 3
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])  # prompt logprobs too
    assert lp.text_offset[num_prompt] == len(PROMPT)  # generated text starts right after the echoed prompt
    # Prompt offsets point into the echoed prompt: <s> is not in the text, so it takes no room.
    assert lp.tokens[0] == "<s>" and lp.text_offset[:2] == [0, 0]
    assert lp.text_offset[:num_prompt] == sorted(lp.text_offset[:num_prompt])
    for token, offset in zip(lp.tokens[1:num_prompt], lp.text_offset[1:num_prompt]):
        assert PROMPT[offset:offset + len(token)] == token
    assert lp.text_offset[num_prompt - 1] + len(lp.tokens[num_prompt - 1]) == len(PROMPT)

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def _hf_prompt_logprobs(ids: list[int]):
    """transformers' log-softmax at each prompt position of the same tiny model, float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagoda_engine.model_path import TINY_MODEL_NAME, resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(resolve_model_path(TINY_MODEL_NAME), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_transformers(client, model, server):
    """vLLM's `prompt_logprobs` field: per prompt token (None for the first) its own logprob and the
    top N there, each with rank and text; on completions per choice, on chat at the top level."""
    ids = [5, 17, 99, 3, 250, 42]
    got = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    body = got.choices[0].model_extra["prompt_logprobs"]
    reference = _hf_prompt_logprobs(ids)
    assert len(body) == len(ids) and body[0] is None
    for i, position in enumerate(body[1:], start=1):
        expected = reference[i - 1]
        top2 = expected.topk(2).indices.tolist()
        assert set(map(int, position)) == {ids[i], *top2}
        for tid, entry in position.items():
            assert entry["logprob"] == pytest.approx(expected[int(tid)].item(), abs=2e-3)
            assert entry["rank"] == int((expected > expected[int(tid)]).sum()) + 1
            text = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": [int(tid)]}).json()["prompt"]
            assert entry["decoded_token"] == text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    body = chat.model_extra["prompt_logprobs"]
    assert body[0] is None and len(body) == chat.usage.prompt_tokens
    assert all(len(position) == 1 and next(iter(position.values()))["logprob"] <= 0 for position in body[1:])
    plain = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0)
    assert "prompt_logprobs" not in plain.choices[0].model_extra
    # Echo with logprobs 1 beside prompt_logprobs 3: each gets its own count (the prompt token, and 1 or 3 more).
    both = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0, echo=True, logprobs=1,
                                     extra_body={"prompt_logprobs": 3})
    echoed = both.choices[0].logprobs.top_logprobs[1:len(ids)]
    assert all(1 <= len(top) <= 2 for top in echoed)
    assert all(3 <= len(position) <= 4 for position in both.choices[0].model_extra["prompt_logprobs"][1:])


@pytest.mark.parametrize("value", [-1, 21, "two"])
def test_bad_prompt_logprobs_are_400(client, model, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"prompt_logprobs": value})
    assert err.value.body["param"] == "prompt_logprobs"


def test_prompt_logprobs_are_refused_with_stream(client, model):
    with pytest.raises(openai.BadRequestError, match="not available when `stream=True`"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       stream=True, extra_body={"prompt_logprobs": 1})


def test_seeded_sampling_is_reproducible(client, model):
    def sample(seed):
        return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_stop_string_is_cut(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[5:8]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_errors_have_openai_shape(client, model):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[1] * 600, max_tokens=2)
    assert "maximum context length" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[], max_tokens=2)


async def test_async_client_concurrent_requests(server, model):
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as aclient:
        prompts = [f"{PROMPT} {i}" for i in range(8)]
        results = await asyncio.gather(*(aclient.completions.create(model=model, prompt=p, max_tokens=10,
                                                                    temperature=0) for p in prompts))
        single = await aclient.completions.create(model=model, prompt=prompts[3], max_tokens=10, temperature=0)
        assert results[3].choices[0].text == single.choices[0].text
        stream = await aclient.chat.completions.create(model=model, messages=[{"role": "user", "content": "yo"}],
                                                       max_tokens=6, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
        assert pieces


def test_metrics_exposed_and_counters_move(client, model, server):
    names = ["pagoda:num_requests_running", "pagoda:num_requests_waiting", "pagoda:kv_cache_usage_perc",
             "pagoda:prefix_cache_queries_total", "pagoda:prefix_cache_hits_total", "pagoda:num_preemptions_total",
             "pagoda:prompt_tokens_total", "pagoda:generation_tokens_total",
             "pagoda:request_success_total{finished_reason=length}",
             "pagoda:time_to_first_token_seconds_count", "pagoda:inter_token_latency_seconds_count",
             "pagoda:e2e_request_latency_seconds_count", "pagoda:request_queue_time_seconds_count"]
    before = scrape(server.url)
    missing = [n for n in names if n not in before]
    assert not missing, f"missing metrics: {missing}"
    long_prompt = corpus_text()[300:700]  # several full KV pages, so the second run hits the prefix cache
    for _ in range(2):
        client.completions.create(model=model, prompt=long_prompt, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = scrape(server.url)
    assert after["pagoda:generation_tokens_total"] - before["pagoda:generation_tokens_total"] == 14
    assert after["pagoda:request_success_total{finished_reason=length}"] - \
        before["pagoda:request_success_total{finished_reason=length}"] == 2
    for n in ("pagoda:prompt_tokens_total", "pagoda:time_to_first_token_seconds_count",
              "pagoda:e2e_request_latency_seconds_count", "pagoda:request_queue_time_seconds_count",
              "pagoda:prefix_cache_queries_total"):
        assert after[n] > before[n], n
    assert after["pagoda:inter_token_latency_seconds_count"] - before["pagoda:inter_token_latency_seconds_count"] == 12
    assert after["pagoda:prefix_cache_hits_total"] > before["pagoda:prefix_cache_hits_total"]  # same prompt twice
    assert after["pagoda:num_requests_running"] == after["pagoda:num_requests_waiting"] == 0


def test_metrics_have_no_created_series(client, model, server):
    client.completions.create(model=model, prompt="hi", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert "pagoda:time_to_first_token_seconds_count" in text
    assert "_created" not in text


def test_truncate_prompt_tokens_keeps_the_prompt_s_end(client, model, server):
    """vLLM's `truncate_prompt_tokens`: the last N tokens, from the left, for text and token-id
    prompts and chat; -1 keeps as many as leave room for one output token."""
    ids = [(7 * i) % 400 + 5 for i in range(40)]
    cut = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 10})
    alone = client.completions.create(model=model, prompt=ids[-10:], max_tokens=4, temperature=0, echo=True)
    assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == alone.choices[0].text
    text = " ".join(["word"] * 600)  # past the server's 512-token context
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=model, prompt=text, max_tokens=2)
    fitted = client.completions.create(model=model, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert fitted.usage.prompt_tokens == 511
    kept = client.completions.create(model=model, prompt=text, max_tokens=2, temperature=0, echo=True,
                                     extra_body={"truncate_prompt_tokens": 5})
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": model, "prompt": text}).json()["tokens"]
    tail = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": tokens[-5:]}).json()["prompt"]
    assert kept.usage.prompt_tokens == 5 and kept.choices[0].text.startswith(tail) and tail.endswith("word")
    short = client.completions.create(model=model, prompt="The quick", max_tokens=2, temperature=0, echo=True,
                                      extra_body={"truncate_prompt_tokens": 100})
    assert short.choices[0].text.startswith("The quick")  # nothing cut: the prompt echoed as sent
    messages = [{"role": "user", "content": " ".join(["word"] * 600)}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 50})
    assert chat.usage.prompt_tokens == 50


@pytest.mark.parametrize("value", [0, 512, 10_000, -2])
def test_truncate_prompt_tokens_beyond_the_context_is_400(client, model, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="hi there", max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": value})
    assert err.value.body["param"] == "truncate_prompt_tokens"


def test_continue_final_message_leaves_the_assistant_s_start_open(client, model, server):
    """vLLM's `continue_final_message`: the last (assistant) message is rendered without its end of
    turn, and the model continues it; with add_generation_prompt it is a 400."""
    messages = [{"role": "user", "content": "Count with me."}, {"role": "assistant", "content": "One, two,"}]
    body = {"model": model, "messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    rendered = httpx.post(f"{server.url}/detokenize", json={"model": model, "tokens": tokens}).json()["prompt"]
    assert rendered.endswith("One, two,") and rendered.count("One, two,") == 1
    closed = httpx.post(f"{server.url}/tokenize", json={**body, "continue_final_message": False}).json()["tokens"]
    assert len(closed) > len(tokens)  # the end of turn the open message leaves out
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"add_generation_prompt": False, "continue_final_message": True})
    completion = client.completions.create(model=model, prompt=tokens, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == completion.choices[0].text
    assert chat.usage.prompt_tokens == len(tokens)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert err.value.body["param"] == "continue_final_message"

"""`pagoda serve --async-scheduling` through the official openai client: same greedy text as the
offline (synchronous) engine, streaming and finish reasons intact."""

import pytest

from pagoda_engine.tiny import corpus_text

from conftest import DEFAULT_ARGS, served_client

PROMPTS = ["The quick brown fox", corpus_text()[:200]]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with served_client(tmp_path_factory.mktemp("serve-async"), *DEFAULT_ARGS, "--async-scheduling") as c:
        yield c


def test_completions_equal_the_synchronous_offline_engine(client):
    from pagoda_engine import LLM, SamplingParams

    llm = LLM("pagoda-tiny", num_kv_pages=128, max_model_len=512)
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24))
    for prompt, expected in zip(PROMPTS, offline):
        got = client.completions.create(model="pagoda-tiny", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == expected.outputs[0].text
        assert got.choices[0].finish_reason == expected.outputs[0].finish_reason
        assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)
    stream = client.completions.create(model="pagoda-tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                       stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline[0].outputs[0].text


def test_concurrent_seeded_requests_are_reproducible(client):
    import concurrent.futures

    def ask(seed: int) -> str:
        return client.completions.create(model="pagoda-tiny", prompt=PROMPTS[1], max_tokens=16, temperature=1.0,
                                         seed=seed).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = list(pool.map(ask, [1, 2, 3, 1]))
    assert first[0] == first[3] == ask(1)

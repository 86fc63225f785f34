"""`--enable-prompt-tokens-details` (vLLM's flag): `usage.prompt_tokens_details.cached_tokens`
counts the prompt tokens the prefix cache served, in whole and streamed responses; without the
flag the field is absent."""

import httpx
import pytest

from conftest import DEFAULT_ARGS, served_client

PROMPT = [(5 * i) % 400 + 7 for i in range(100)]  # 100 tokens: 96 in full pages of 16


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with served_client(tmp_path_factory.mktemp("serve"), *DEFAULT_ARGS, "--enable-prompt-tokens-details") as c:
        yield c


def test_cached_prompt_tokens_are_reported(client):
    first = client.completions.create(model="pagoda-tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    again = client.completions.create(model="pagoda-tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 96  # every full page; the last token is computed
    stream = client.completions.create(model="pagoda-tiny", prompt=PROMPT, max_tokens=2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    assert [c.usage for c in stream][-1].prompt_tokens_details.cached_tokens == 96
    messages = [{"role": "user", "content": "tell me " * 40}]
    chat = client.chat.completions.create(model="pagoda-tiny", messages=messages, max_tokens=2)
    streamed = client.chat.completions.create(model="pagoda-tiny", messages=messages, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True})
    cached = [c.usage for c in streamed][-1].prompt_tokens_details.cached_tokens
    # The full pages before the prompt's last token, which is always computed.
    assert chat.usage.prompt_tokens_details.cached_tokens < cached == (chat.usage.prompt_tokens - 1) // 16 * 16


def test_without_the_flag_usage_has_no_details(server):
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert "prompt_tokens_details" not in body["usage"]

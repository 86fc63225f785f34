"""`--tool-call-parser qwen3_coder` against a real `pagoda serve` and the `openai` client: the tiny
model is made to write Qwen3-Coder's XML calls (a `structured_outputs` regex), and the parameters
come back typed by the request's tool schemas, whole and streamed."""

import json

import pytest

from conftest import served_client
from test_tool_calling import ARGS, ASK, MAX_TOKENS, TOOLS, _stream

CODER_CALL = (r"<tool_call>\n<function=get_weather>\n<parameter=city>\n[A-Z][a-z]{1,5}\n</parameter>\n"
              r"<parameter=days>\n[1-9]\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with served_client(tmp_path_factory.mktemp("serve"), *ARGS, "--enable-auto-tool-choice", "--tool-call-parser",
                       "qwen3_coder", timeout=120) as c:
        yield c


def test_qwen3_coder_calls_come_back_typed_by_the_tool_schema(client):
    regex = "[a-z]{1,6} " + CODER_CALL
    resp = client.chat.completions.create(model="pagoda-tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                                          extra_body={"structured_outputs": {"regex": regex}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and "<tool_call>" not in choice.message.content
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and isinstance(arguments["days"], int)  # schema: integer
    assert isinstance(arguments["city"], str) and arguments["city"][0].isupper()

    content, _, calls, finish = _stream(client, model="pagoda-tiny", messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                                        extra_body={"structured_outputs": {"regex": regex}})
    assert finish == "tool_calls" and "<tool_call>" not in content
    [streamed] = calls.values()
    arguments = json.loads(streamed["arguments"])
    assert streamed["name"] == "get_weather" and isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 9

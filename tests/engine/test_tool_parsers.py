"""The tool-call and reasoning parsers on recorded model outputs (Qwen2.5 / Hermes, Llama 3.1,
Mistral v3 and v11, Qwen3, DeepSeek-R1), fed whole and piece by piece as a stream feeds them:
well-formed calls give the same calls however the text is cut, and malformed or cut-off calls
come back as content text, never an exception."""

import json
import random

import pytest

from pagoda_engine.api.chat_output import ChatOutputSpec, merge_parsed

HERMES_QWEN25 = (
    "I'll look both up.\n<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01", '
    '"note": "braces } and \\"quotes\\" in a string"}}\n</tool_call>')
LLAMA31 = '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", "unit": "fahrenheit"}}'
LLAMA31_TAGGED = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                  '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}')
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
              '"format": "celsius"}}, {"name": "get_n_day_weather_forecast", "arguments": {"location": "Paris", '
              '"format": "celsius", "num_days": 3}}]')
MISTRAL_V11 = ('Let me check.[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris", "format": "celsius"}'
               '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}')
QWEN3 = ("<think>\nOkay, the user asks for the capital of France. That is Paris.\n</think>\n\n"
         "The capital of France is Paris.")
QWEN3_TOOL = ('<think>\nI should call the weather tool.\n</think>\n\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
R1 = "Okay, 2 + 2: adding two and two gives four.\n</think>\n\nThe answer is 4."
QWEN3_CODER = ("I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n"
               "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
               "<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
               "<function=write_file>\n<parameter=path>\n007.txt\n</parameter>\n<parameter=content>\n"
               "def f():\n    return '<tag> & </parameter'\n\n</parameter>\n</function>\n</tool_call>")
PYTHONIC = ('[get_weather(city="San Francisco, CA", days=3, hours=[9, 12], opts={"unit": "c", "x": None}), '
            "get_time(zone='UTC'), note(text='it\\'s (nested) [text], \"quoted\"')]")
CODER_TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}, "hours": {"type": "array"}}},
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}},
}

# (spec, output, content, reasoning, [(name, arguments)])
WELL_FORMED = [
    (ChatOutputSpec(tool_parser="hermes"), HERMES_QWEN25, "I'll look both up.\n", "", [
        ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
        ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01",
                                  "note": 'braces } and "quotes" in a string'})]),
    (ChatOutputSpec(tool_parser="hermes"), '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "", "",
     [("f", {"a": 1})]),  # arguments before the name: parsed whole at the end of the call
    (ChatOutputSpec(tool_parser="hermes"), '<tool_call>{"name": "f", "arguments": {}}', "", "", [("f", {})]),
    (ChatOutputSpec(tool_parser="hermes"), "No tools needed: 2 < 3.", "No tools needed: 2 < 3.", "", []),
    (ChatOutputSpec(tool_parser="llama3_json"), LLAMA31, "", "", [
        ("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
    (ChatOutputSpec(tool_parser="llama3_json"), LLAMA31_TAGGED, "", "", [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Europe/Paris"})]),
    (ChatOutputSpec(tool_parser="llama3_json"), "The weather is {unknown}.", "The weather is {unknown}.", "", []),
    (ChatOutputSpec(tool_parser="llama3_json"), '{"name": "f", "parameters": {}} and then text', "and then text", "",
     [("f", {})]),
    (ChatOutputSpec(tool_parser="mistral"), MISTRAL_V3, "", "", [
        ("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
        ("get_n_day_weather_forecast", {"location": "Paris", "format": "celsius", "num_days": 3})]),
    (ChatOutputSpec(tool_parser="mistral"), MISTRAL_V11, "Let me check.", "", [
        ("get_current_weather", {"location": "Paris", "format": "celsius"}), ("get_time", {"zone": "CET"})]),
    (ChatOutputSpec(tool_parser="mistral"), "Plain [TOOL answer.", "Plain [TOOL answer.", "", []),
    (ChatOutputSpec(reasoning_parser="qwen3"), QWEN3, "\n\nThe capital of France is Paris.",
     "\nOkay, the user asks for the capital of France. That is Paris.\n", []),
    (ChatOutputSpec(reasoning_parser="qwen3"), "No thinking here.", "No thinking here.", "", []),
    (ChatOutputSpec(reasoning_parser="qwen3", tool_parser="hermes"), QWEN3_TOOL, "\n\n",
     "\nI should call the weather tool.\n", [("get_weather", {"city": "Paris"})]),
    (ChatOutputSpec(reasoning_parser="deepseek_r1"), R1, "\n\nThe answer is 4.",
     "Okay, 2 + 2: adding two and two gives four.\n", []),
    (ChatOutputSpec(reasoning_parser="deepseek_r1"), "<think>hmm</think>ok", "ok", "hmm", []),
    (ChatOutputSpec(reasoning_parser="deepseek_r1"), "still thinking when cut off", "",
     "still thinking when cut off", []),
    (ChatOutputSpec(required=True), '[{"name":"get_time","parameters":{"zone":"UTC"}},'
     '{"name":"get_weather","parameters":{"city":"Oslo"}}]', "", "",
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo"})]),
    (ChatOutputSpec(named_function="get_time"), '{"zone":"UTC"}', "", "", [("get_time", {"zone": "UTC"})]),
    (ChatOutputSpec(tool_parser="qwen3_coder", tool_parameters=CODER_TOOLS), QWEN3_CODER, "I'll check both.\n", "", [
        ("get_weather", {"city": "San Francisco, CA", "days": 3, "metric": True, "hours": [9, 12]}),
        ("write_file", {"path": "007.txt", "content": "def f():\n    return '<tag> & </parameter'\n"})]),
    # A parameter the request's schema does not name stays text, as in vLLM.
    (ChatOutputSpec(tool_parser="qwen3_coder"), "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n"
     "<parameter=s>\nhello world\n</parameter>\n</function>\n</tool_call>", "", "", [("f", {"n": "7", "s": "hello world"})]),
    (ChatOutputSpec(tool_parser="qwen3_coder"), "<tool_call>\n<function=no_args>\n</function>\n</tool_call> done",
     "done", "", [("no_args", {})]),
    (ChatOutputSpec(tool_parser="qwen3_coder"), "Plain answer, a < b.", "Plain answer, a < b.", "", []),
    (ChatOutputSpec(tool_parser="pythonic"), PYTHONIC, "", "", [
        ("get_weather", {"city": "San Francisco, CA", "days": 3, "hours": [9, 12], "opts": {"unit": "c", "x": None}}),
        ("get_time", {"zone": "UTC"}), ("note", {"text": "it's (nested) [text], \"quoted\""})]),
    (ChatOutputSpec(tool_parser="pythonic"), "  [f()]  ", "", "", [("f", {})]),
    (ChatOutputSpec(tool_parser="pythonic"), "The answer is [1, 2].", "The answer is [1, 2].", "", []),
]

# (spec, output): whole, each is content text exactly as written (streamed: no exception).
MALFORMED = [
    (ChatOutputSpec(tool_parser="hermes"), 'Sure <tool_call>{"name": get_weather}</tool_call>'),
    (ChatOutputSpec(tool_parser="hermes"), '<tool_call>{"name": "f", "argu'),  # cut off
    (ChatOutputSpec(tool_parser="hermes"), "<tool_call>not json at all</tool_call> after"),
    (ChatOutputSpec(tool_parser="hermes"), "a <tool_ca"),
    (ChatOutputSpec(tool_parser="llama3_json"), '{"name": "f", "parameters": {"a": '),
    (ChatOutputSpec(tool_parser="llama3_json"), '{"no_name": 1}'),
    (ChatOutputSpec(tool_parser="mistral"), '[TOOL_CALLS][{"name": "f", "arguments": {"a": }}]'),
    (ChatOutputSpec(tool_parser="mistral"), '[TOOL_CALLS]f[ARGS]{"a": 1'),
    (ChatOutputSpec(required=True), '[{"name":"get_time","parameters":{"zone":"U'),
    (ChatOutputSpec(tool_parser="qwen3_coder"), "<tool_call>\nnot a function</tool_call> after"),
    (ChatOutputSpec(tool_parser="qwen3_coder"), "<tool_call>\n<function=f>\n<parameter=a>\n1"),  # cut off
    (ChatOutputSpec(tool_parser="qwen3_coder"), "x <tool_ca"),
    (ChatOutputSpec(tool_parser="pythonic"), "[1, 2]"),
    (ChatOutputSpec(tool_parser="pythonic"), "[]"),
    (ChatOutputSpec(tool_parser="pythonic"), "[f(a=x)]"),  # not a literal
    (ChatOutputSpec(tool_parser="pythonic"), "[f(a=1)] and more"),
    (ChatOutputSpec(tool_parser="pythonic"), '[f(a="1"), g(b='),  # cut off
    (ChatOutputSpec(tool_parser="pythonic"), "[f(1)]"),  # positional
]


def _run(spec, text, incremental, cuts):
    parser = spec.parser(incremental)
    parts, start = [], 0
    for end in cuts:
        parts.append(parser.feed(text[start:end]))
        start = end
    parts.append(parser.feed(text[start:]))
    parts.append(parser.finish())
    return merge_parsed(parts)


def _cuttings(text):
    rng = random.Random(0)
    yield "whole", []
    yield "by character", list(range(1, len(text)))
    for seed in range(5):
        cuts, at = [], 0
        while True:
            at += rng.randint(1, 7)
            if at >= len(text):
                break
            cuts.append(at)
        yield f"random {seed}", cuts


def _calls(parsed, mistral=False):
    assert [c.index for c in parsed.tool_calls] == list(range(len(parsed.tool_calls)))
    for call in parsed.tool_calls:
        if mistral:  # Mistral's templates accept only 9 alphanumeric characters
            assert len(call.id) == 9 and call.id.isalnum()
        else:
            assert call.id.startswith("chatcmpl-tool-") and len(call.id) > len("chatcmpl-tool-") + 16
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


@pytest.mark.parametrize("spec, text, content, reasoning, calls", WELL_FORMED)
@pytest.mark.parametrize("incremental", [False, True], ids=["whole", "stream"])
def test_recorded_outputs_parse_the_same_however_they_are_cut(spec, text, content, reasoning, calls, incremental):
    for name, cuts in _cuttings(text):
        parsed = _run(spec, text, incremental, cuts)
        assert (parsed.content, parsed.reasoning, _calls(parsed, spec.tool_parser == "mistral")) == (
            content, reasoning, calls), name


@pytest.mark.parametrize("spec, text", MALFORMED)
def test_malformed_or_cut_off_calls_come_back_as_content(spec, text):
    for name, cuts in _cuttings(text):
        whole = _run(spec, text, False, cuts)
        assert (whole.content, whole.tool_calls) == (text.replace("[TOOL_CALLS] ", "[TOOL_CALLS]"), []), name
        _run(spec, text, True, cuts)  # streamed: whatever was sent stays sent, and nothing raises


def test_a_streamed_call_sends_its_header_first_then_arguments_as_they_arrive():
    parser = ChatOutputSpec(tool_parser="hermes").parser(incremental=True)
    assert parser.feed("Hi <tool").content == "Hi "  # a tag's beginning is held back
    assert parser.feed('_call>{"name": "get_weather", "arg').tool_calls == []
    first = parser.feed('uments": {"city": "Pa').tool_calls
    assert [(c.index, c.name, c.arguments) for c in first] == [(0, "get_weather", '{"city": "Pa')]
    assert first[0].id.startswith("chatcmpl-tool-")
    more = parser.feed('ris"}}</tool_call>').tool_calls
    assert [(c.index, c.id, c.name, c.arguments) for c in more] == [(0, None, None, 'ris"}')]
    end = parser.finish()
    assert (end.content, end.tool_calls) == ("", [])


def test_reasoning_is_streamed_as_it_arrives():
    parser = ChatOutputSpec(reasoning_parser="qwen3").parser(incremental=True)
    pieces = [parser.feed(p) for p in ["<th", "ink>", "let me", " see</th", "ink>", "Answer"]]
    assert [(p.reasoning, p.content) for p in pieces] == [
        ("", ""), ("", ""), ("let me", ""), (" see", ""), ("", ""), ("", "Answer")]


def test_qwen3_output_that_opens_with_text_is_all_content():
    parsed = _run(ChatOutputSpec(reasoning_parser="qwen3"), "Hello</think>there", True, [2, 5])
    assert (parsed.reasoning, parsed.content) == ("", "Hello</think>there")


LONG = 60_000


@pytest.mark.parametrize("spec, text", [
    (ChatOutputSpec(tool_parser="hermes"), "word " * (LONG // 5)),
    (ChatOutputSpec(tool_parser="hermes"), '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * LONG + '"}}'),
    (ChatOutputSpec(tool_parser="hermes"), '<tool_call>{"arguments": {"a": "' + "x" * LONG + '"}, "name": "f"}'),
    (ChatOutputSpec(tool_parser="llama3_json"), '{"name": "f", "parameters": {"a": [' + "1," * (LONG // 2) + "1]}}"),
    (ChatOutputSpec(tool_parser="mistral"), "[TOOL_CALLS]f[ARGS]{\"a\": \"" + "y" * LONG + '"}'),
    (ChatOutputSpec(required=True), '[{"name":"f","parameters":{"a":"' + "z" * LONG + '"}}]'),
    (ChatOutputSpec(reasoning_parser="deepseek_r1", tool_parser="hermes"), "think " * (LONG // 6) + "</think>ok"),
    (ChatOutputSpec(tool_parser="llama3_json"), " " * LONG + "x"),
    (ChatOutputSpec(tool_parser="pythonic"), '[f(a="' + "p" * LONG + '"), g(b=[' + "1," * (LONG // 2) + "1])]"),
    (ChatOutputSpec(tool_parser="qwen3_coder"), "<tool_call>\n<function=f>\n<parameter=a>\n" + "q" * LONG
     + "\n</parameter>\n</function>\n</tool_call>"),
])
def test_parsing_costs_each_piece_its_own_length(spec, text):
    """Fed one character at a time (the worst case for a parser that rescans what it holds), a long
    output parses in well under a second per 100K characters: each piece costs O(its length)."""
    import time

    start = time.perf_counter()
    for incremental in (False, True):
        parsed = _run(spec, text, incremental, range(1, len(text)))
        assert len(parsed.content) + len(parsed.reasoning) + sum(len(c.arguments) for c in parsed.tool_calls) > 0
    assert time.perf_counter() - start < 10  # rescanning what is held at every piece takes minutes here


def test_deepseek_r1_output_shaped_by_a_grammar_needs_its_opening_tag():
    spec = ChatOutputSpec(reasoning_parser="deepseek_r1", constrained=True)
    parsed = _run(spec, '{"a": 1}', True, [3])
    assert (parsed.reasoning, parsed.content) == ("", '{"a": 1}')
    parsed = _run(spec, "<think>hm</think>{}", False, [])
    assert (parsed.reasoning, parsed.content) == ("hm", "{}")


@pytest.mark.parametrize("text, schema, value", [
    ("3", {"type": "integer"}, 3), ("x3", {"type": "integer"}, "x3"), ("2.5", {"type": "number"}, 2.5),
    ("4.0", {"type": "number"}, 4), ("True", {"type": "boolean"}, True), ("no", {"type": "boolean"}, False),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("{'a': 1}", {"type": "object"}, {"a": 1}),
    ("null", {"type": "integer"}, None), ("null", {"type": "string"}, "null"),
    ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None), ("7", {"type": "string"}, "7"),
    ("[1, 2", {"type": "array"}, "[1, 2"), ("7", None, "7"),
], ids=str)
def test_qwen3_coder_values_are_typed_by_the_schema_as_vllm_types_them(text, schema, value):
    from pagoda_engine.api.tool_parsers.qwen3_coder import convert_value

    assert convert_value(text, schema) == value

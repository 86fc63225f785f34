"""Incremental detokenization: whole characters only, text equal to a full decode, stop strings."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda_engine.api.detokenizer import IncrementalDetokenizer, StopStrings
from pagoda_engine.api.tokenizer import load_tokenizer
from pagoda_engine.sampling_params import SamplingParams
from pagoda_engine.tiny import build_tiny_model

MULTILINGUAL = (
    "Héllo wörld! Café crème brûlée. 日本語の文章です。東京は日本の首都です。 中文：你好，世界！ "
    "Привет, как дела? I love pizza 🍕 and rockets 🚀🌍 👍🏽 — π ≈ 3.14159, ∑ ∫ √. The End."
)
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama"))


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def stream(tokenizer, ids, prompt="Hello", chunk=1, **params):
    """Feed `ids` `chunk` at a time; return (update deltas, flush delta, detokenizer)."""
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), SamplingParams(**params))
    deltas = [detok.update(ids[k : k + chunk], min(k + chunk, len(ids))) for k in range(0, len(ids), chunk)]
    return deltas, detok.flush(), detok


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_deltas_are_whole_characters_and_add_up_to_the_full_decode(tokenizer, chunk):
    ids = encode(tokenizer, MULTILINGUAL)
    deltas, last, detok = stream(tokenizer, ids, chunk=chunk)
    assert "".join(deltas) + last == tokenizer.decode(ids) == MULTILINGUAL
    assert not any(REPLACEMENT in d for d in deltas + [last])
    assert detok.num_tokens == len(ids)
    if chunk == 1:
        # The text really has characters split across tokens, held back until complete.
        assert sum(1 for d in deltas if d == "") >= 10


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("abc xyz.,!\n") + list("éü日本語中文😀🚀🍕👍🏽€π")), max_size=40))
def test_any_text_streams_back_exactly(tokenizer, text):
    ids = encode(tokenizer, text)
    deltas, last, _ = stream(tokenizer, ids)
    assert "".join(deltas) + last == text
    assert not any(REPLACEMENT in d for d in deltas + [last])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=6, max_value=511), max_size=40), st.integers(min_value=1, max_value=4))
def test_arbitrary_token_ids_stream_back_as_their_decode(tokenizer, ids, chunk):
    # Random byte tokens make invalid UTF-8: the stream must still equal decode(ids) exactly.
    deltas, last, _ = stream(tokenizer, ids, chunk=chunk)
    assert "".join(deltas) + last == tokenizer.decode(ids)


def test_a_long_run_of_invalid_bytes_is_emitted_before_the_end(tokenizer):
    # A random model stuck on one lead byte: text must keep flowing, not wait for flush.
    lead_byte = next(i for i in range(6, 512) if tokenizer.decode([i]) == REPLACEMENT)
    ids = [lead_byte] * 40 + encode(tokenizer, "🚀 ok 日本")
    deltas, last, _ = stream(tokenizer, ids)
    assert "".join(deltas[:35]).count(REPLACEMENT) >= 20
    assert "".join(deltas) + last == tokenizer.decode(ids)


def byte_token_id(tokenizer, byte: int) -> int:
    """The id of the single-byte token for `byte` (GPT-2's byte-to-unicode mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char = chr(byte) if byte in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(byte))
    return tokenizer.convert_tokens_to_ids(char)


@pytest.mark.parametrize("before", range(0, 13))
def test_characters_inside_long_invalid_runs_are_not_split(tokenizer, before):
    # Split one byte per token, a character can straddle the point where a long window of
    # invalid bytes is cut short; the cut must move rather than break the character.
    lead = byte_token_id(tokenizer, 0xE6)
    rocket = [byte_token_id(tokenizer, b) for b in "🚀".encode()]
    assert tokenizer.decode(rocket) == "🚀"
    for after in range(5):
        ids = [lead] * before + rocket + [lead] * after + encode(tokenizer, " ok")
        deltas, last, _ = stream(tokenizer, ids)
        assert "".join(deltas) + last == tokenizer.decode(ids)


def test_prompt_ending_inside_a_character(tokenizer):
    rocket = encode(tokenizer, "🚀")
    assert len(rocket) > 1
    detok = IncrementalDetokenizer(tokenizer, [tokenizer.bos_token_id] + rocket[:1], SamplingParams())
    ids = rocket[1:] + encode(tokenizer, " fly")
    text = "".join(detok.update([i], k + 1) for k, i in enumerate(ids)) + detok.flush()
    assert text == tokenizer.decode(ids)


def test_flush_emits_an_incomplete_last_character_as_decode_does(tokenizer):
    ids = encode(tokenizer, "go 🚀")[:-1]
    deltas, last, _ = stream(tokenizer, ids)
    assert REPLACEMENT not in "".join(deltas)
    assert "".join(deltas) + last == tokenizer.decode(ids)
    assert last.endswith(REPLACEMENT)


def cumulative(deltas):
    out, texts = "", []
    for d in deltas:
        out += d
        texts.append(out)
    return texts


@pytest.mark.parametrize("stop", ["brown fox", "日本", "rockets 🚀"])
def test_stop_string_across_tokens_is_cut_and_never_partly_emitted(tokenizer, stop):
    text = "The quick brown fox jumps. 日本語の文章です。 I love pizza and rockets 🚀 too."
    ids = encode(tokenizer, text)
    assert len(encode(tokenizer, stop)) > 1  # the stop string spans several tokens
    deltas, last, detok = stream(tokenizer, ids, stop=[stop])
    expected = text[: text.index(stop)]
    assert "".join(deltas) + last == expected
    # Every intermediate output is a prefix of the cut text: no piece of the stop string leaked.
    assert all(expected.startswith(t) for t in cumulative(deltas))
    assert detok.finished and detok.stop_reason == stop
    # Tokens stop being consumed at the one that completed the stop string.
    completing = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    assert detok.num_tokens == completing
    assert detok.update(encode(tokenizer, " more"), completing + 2) == ""


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    deltas, last, detok = stream(tokenizer, encode(tokenizer, text), stop=["fox"], include_stop_str_in_output=True)
    assert "".join(deltas) + last == "The quick brown fox"
    assert detok.stop_reason == "fox"


def test_state_kept_between_updates_does_not_grow_with_the_output(tokenizer):
    # Only the decode window and the text not yet returned (plus a stop string's length of returned
    # text) are kept, so each update costs the same however long the output already is.
    ids = encode(tokenizer, MULTILINGUAL) * 20
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello"), SamplingParams(stop=["never seen"]))
    text = ""
    for k, token in enumerate(ids):
        text += detok.update([token], k + 1)
        assert len(detok._ids) <= 16 and len(detok._text) <= 2 * len("never seen") + 8
    assert text + detok.flush() == tokenizer.decode(ids)


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    deltas, last, detok = stream(tokenizer, encode(tokenizer, text), stop=["lazy", "brown", "jumps"])
    assert "".join(deltas) + last == "The quick "
    assert detok.stop_reason == "brown"


def test_min_tokens_delays_stop_string_checks(tokenizer):
    text = "one fish two fish red fish"
    ids = encode(tokenizer, text)
    head = encode(tokenizer, "one fish two")
    assert ids[: len(head)] == head
    deltas, last, _ = stream(tokenizer, ids, stop=["fish"])
    assert "".join(deltas) + last == "one "
    deltas, last, detok = stream(tokenizer, ids, stop=["fish"], min_tokens=len(head) + 1)
    assert "".join(deltas) + last == "one fish two "
    assert detok.stop_reason == "fish"


def test_text_that_only_looks_like_a_stop_string_is_released(tokenizer):
    text = "abc xy"
    deltas, last, detok = stream(tokenizer, encode(tokenizer, text), stop=["xyz"])
    assert "".join(deltas) == "abc "  # "xy" could still become "xyz"
    assert last == "xy" and not detok.finished
    text = "a xylophone"
    deltas, last, _ = stream(tokenizer, encode(tokenizer, text), stop=["xyz"])
    assert "".join(deltas) == text and last == ""  # released as soon as it cannot match


def test_skip_special_tokens(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tokenizer, "Hi 日本") + [im_end] + encode(tokenizer, " there")
    deltas, last, _ = stream(tokenizer, ids)
    assert "".join(deltas) + last == tokenizer.decode(ids, skip_special_tokens=True) == "Hi 日本 there"
    deltas, last, _ = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(deltas) + last == tokenizer.decode(ids) == "Hi 日本<|im_end|> there"


def test_a_final_stop_token_is_kept_in_ids_but_not_in_text(tokenizer):
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "Done.") + [eos]
    for include, expected in [(False, "Done."), (True, "Done.</s>")]:
        detok = IncrementalDetokenizer(
            tokenizer, [], SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        )
        text = detok.update(ids, len(ids), stop_terminated=True) + detok.flush()
        assert text == expected
        assert detok.num_tokens == len(ids)


def _first_match_by_search(stops, text, new_from):
    """The reference: among stop strings ending at or after `new_from`, the one starting first
    (ties: the one listed first), by plain string search."""
    best = None
    for index, stop in enumerate(stops):
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, index)
    return best


def _held_back_by_search(stops, text):
    return max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=6),
       st.lists(st.text("abcd", max_size=6), max_size=6))
def test_stop_automaton_finds_what_string_search_finds(stops, pieces):
    matcher, state, text = StopStrings(stops), 0, ""
    for piece in pieces:
        state, match = matcher.feed(state, piece, len(text), find=True)
        assert match == _first_match_by_search(stops, text + piece, len(text))
        text += piece
        if match is not None:
            break
        assert matcher.hold[state] == _held_back_by_search(stops, text)


def test_thousands_of_stop_strings_cost_the_same_per_character_as_one():
    import time

    stops = [f"stop-{i:05d}-marker" for i in range(5000)]
    text = "lorem ipsum dolor sit amet " * 2000
    timings = []
    for stop_list in (stops[:1], stops):
        matcher, start = StopStrings(stop_list), time.perf_counter()
        state = 0
        for i in range(0, len(text), 4):  # a few characters per step, as tokens arrive
            state, match = matcher.feed(state, text[i:i + 4], i, find=True)
            assert match is None
        timings.append(time.perf_counter() - start)
    assert timings[1] < 5 * timings[0] + 0.05, timings  # string search would be ~5000x

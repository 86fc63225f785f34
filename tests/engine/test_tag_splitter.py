"""`TagSplitter`, the one place the reasoning and tool-call parsers find their tags in streamed
text: a tag cut across deltas at any position is found once, with exactly the text around it;
text that only looks like a tag's beginning is held back no longer than it must be."""

import itertools

import pytest

from pagoda_engine.api.tool_parsers.base import MAX_OPENING_WHITESPACE, TagSplitter

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]"]


def _split_stream(pieces, tag):
    """Every piece through `split` until the tag is found: (what went out before it, what came
    after it, the pieces on which it was found), after which the rest of the stream is the caller's."""
    splitter, before, after, found_on = TagSplitter(), [], None, []
    for i, piece in enumerate(pieces):
        if after is not None:
            after += piece
            continue
        out, rest, found = splitter.split(piece, tag)
        assert len(splitter.held) < len(tag) and tag.startswith(splitter.held)
        before.append(out)
        if found:
            after, found_on = rest, [i]
    return "".join(before), after, found_on, splitter


@pytest.mark.parametrize("tag", TAGS)
def test_a_tag_cut_across_deltas_at_every_position_is_found_once(tag):
    # A false start of the tag (its beginning, then other text) comes before the real one.
    text = f"a {tag[:-1]}x b{tag}c d"
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        pieces = [text[:i], text[i:j], text[j:]]
        before, after, found_on, _ = _split_stream(pieces, tag)
        assert (before, after) == (f"a {tag[:-1]}x b", "c d"), pieces
        completes = text.index(tag, 3) + len(tag)  # the piece holding the tag's last character
        assert found_on == [0 if completes <= i else 1 if completes <= j else 2], pieces


@pytest.mark.parametrize("tag", TAGS)
def test_only_a_possible_beginning_of_the_tag_is_held_back(tag):
    for k in range(1, len(tag)):
        splitter = TagSplitter()
        assert splitter.split("text" + tag[:k], tag) == ("text", "", False)
        assert splitter.held == tag[:k]
        assert splitter.split("!", tag) == (tag[:k] + "!", "", False)  # not the tag after all: out, in order
        assert splitter.held == ""
    splitter = TagSplitter()
    assert splitter.split("cut off " + tag[:-1], tag) == ("cut off ", "", False)
    assert splitter.release() == tag[:-1] and splitter.held == ""  # the output's end gives it up


@pytest.mark.parametrize("tag", ["<think>", "<|python_tag|>"])
def test_an_opening_tag_cut_after_whitespace_at_every_position_is_told_once_complete(tag):
    text = f"\n  {tag}body"
    for i in range(len(text) + 1):
        splitter = TagSplitter()
        first = splitter.opening(text[:i], tag, final=False)
        if i < text.index(tag) + len(tag):
            assert first is None and splitter.held == text[:i]  # whitespace or the tag's beginning: undecided
            assert splitter.opening(text[i:], tag, final=False) == ("body", True)
        else:
            assert first == (text[text.index(tag) + len(tag):i], True)
        assert splitter.held == ""


def test_an_opening_that_is_not_the_tag_is_all_text():
    splitter = TagSplitter()
    assert splitter.opening(" <thi", "<think>", final=False) is None
    assert splitter.opening("s is text", "<think>", final=False) == (" <this is text", False)
    assert TagSplitter().opening(" <thi", "<think>", final=True) == (" <thi", False)  # the output ended there
    spaces = " " * (MAX_OPENING_WHITESPACE + 1)
    assert TagSplitter().opening(spaces, "<think>", final=False) == (spaces, False)  # too long to wait for

"""The picker's objective priorities (`router/objectives.py`): flags, and a file kept current as a
mounted ConfigMap is swapped (written beside, then renamed over, as kubelet does)."""

from __future__ import annotations

import json
import os

import pytest

from pagoda_engine.router.objectives import Objectives, ObjectivesError, parse_flags


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _swap(path, content: str) -> None:
    new = path.with_name(path.name + ".new")
    new.write_text(content)
    os.replace(new, path)


def test_flags_name_priorities_and_the_rest_is_zero():
    objectives = Objectives(parse_flags(["interactive=10", "batch=-5"]))
    assert [objectives.priority(n) for n in ("interactive", "batch", "other", None)] == [10, -5, 0, 0]


@pytest.mark.parametrize("flag, says", [("interactive", "NAME=PRIORITY"), ("=3", "NAME=PRIORITY"),
                                        ("a=high", "whole number")])
def test_bad_flags_are_refused(flag, says):
    with pytest.raises(ObjectivesError, match=says):
        parse_flags([flag])


def test_the_file_is_re_read_when_it_changes_and_a_bad_version_keeps_the_last(tmp_path):
    path = tmp_path / "objectives.json"
    path.write_text(json.dumps({"interactive": 10}))
    clock = Clock()
    objectives = Objectives(path=str(path), check_interval_s=1.0, clock=clock)
    assert objectives.priority("interactive") == 10 and objectives.priority("batch") == 0
    _swap(path, json.dumps({"interactive": 1, "batch": 7}))
    assert objectives.priority("batch") == 0  # not looked at again within the interval
    clock.now = 1.5
    assert objectives.priority("batch") == 7 and objectives.priority("interactive") == 1
    _swap(path, "{not json")
    clock.now = 3.0
    assert objectives.priority("batch") == 7  # kept, logged
    path.unlink()
    clock.now = 4.5
    assert objectives.priority("batch") == 7
    _swap(path, json.dumps({}))
    clock.now = 6.0
    assert objectives.priority("batch") == 0


@pytest.mark.parametrize("content, says", [(None, "cannot read"), ("[1]", "JSON object"), ("{", "not valid JSON"),
                                           ('{"a": "high"}', "whole number"), ('{"a": true}', "whole number")])
def test_an_unusable_file_at_start_is_refused(tmp_path, content, says):
    path = tmp_path / "objectives.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ObjectivesError, match=says):
        Objectives(path=str(path))

"""PAGODA_* numbers are read through one helper: a bad value (not a number, zero or negative,
nan or inf, empty) is refused with a message naming the variable and what it must be, and
`pagoda serve` stops on it before anything starts; no value is read at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagoda_engine import envs
from pagoda_engine.errors import InvalidEnvironmentError

SECONDS = {"PAGODA_TP_START_TIMEOUT_S": (envs.tp_start_timeout_s, 900.0),
           "PAGODA_DIST_TIMEOUT_S": (envs.dist_timeout_s, 300.0),
           "PAGODA_TP_COLLECTIVE_TIMEOUT_S": (envs.tp_collective_timeout_s, 600.0),
           "PAGODA_KV_REMOTE_TIMEOUT_S": (envs.kv_remote_timeout_s, 1.0),
           "PAGODA_KV_REMOTE_BACKOFF_S": (envs.kv_remote_backoff_s, 5.0)}
COUNTS = {"PAGODA_CPU_THREADS": (envs.cpu_threads, None),
          "PAGODA_KV_REMOTE_READ_CONNECTIONS": (envs.kv_remote_read_connections, 4)}
ALL = [*SECONDS, *COUNTS, "PAGODA_TP_JOIN_TIMEOUT_S", "PAGODA_PDL"]


@pytest.fixture(autouse=True)
def unset(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name, value, parsed", [*((name, "2.5", 2.5) for name in SECONDS),
                                                *((name, "3", 3) for name in COUNTS)])
def test_each_has_its_default_when_unset_and_its_value_when_set(monkeypatch, name, value, parsed):
    read, default = {**SECONDS, **COUNTS}[name]
    assert read() == default
    monkeypatch.setenv(name, value)
    assert read() == parsed


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", "-inf", "1e999", ""])
@pytest.mark.parametrize("name", SECONDS)
def test_a_bad_number_of_seconds_is_refused_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidEnvironmentError, match=f"^{name} must be a number of seconds > 0, got {value!r}$"):
        SECONDS[name][0]()


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5", "nan", "inf", ""])
@pytest.mark.parametrize("name", COUNTS)
def test_a_bad_count_is_refused_by_name(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidEnvironmentError, match=f"^{name} must be a whole number >= 1, got {value!r}$"):
        COUNTS[name][0]()


def test_the_pdl_switch_is_on_by_default_and_takes_only_0_or_1(monkeypatch):
    assert envs.programmatic_dependent_launch() is True
    monkeypatch.setenv("PAGODA_PDL", "0")
    assert envs.programmatic_dependent_launch() is False
    monkeypatch.setenv("PAGODA_PDL", "1")
    assert envs.programmatic_dependent_launch() is True
    for value in ("yes", "true", "2", ""):
        monkeypatch.setenv("PAGODA_PDL", value)
        with pytest.raises(InvalidEnvironmentError, match=f"^PAGODA_PDL must be 0 or 1, got {value!r}$"):
            envs.programmatic_dependent_launch()


def test_the_join_timeout_reads_its_older_name_only_when_the_new_one_is_unset(monkeypatch):
    monkeypatch.setenv("PAGODA_TP_JOIN_TIMEOUT_S", "40")
    assert envs.dist_timeout_s() == 40.0
    monkeypatch.setenv("PAGODA_DIST_TIMEOUT_S", "7")
    assert envs.dist_timeout_s() == 7.0
    monkeypatch.delenv("PAGODA_DIST_TIMEOUT_S")
    monkeypatch.setenv("PAGODA_TP_JOIN_TIMEOUT_S", "0")
    with pytest.raises(InvalidEnvironmentError, match="^PAGODA_TP_JOIN_TIMEOUT_S must be a number of seconds > 0"):
        envs.dist_timeout_s()


def _pagoda(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagoda_engine.cli", *argv], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name, value, must_be", [
    ("PAGODA_TP_START_TIMEOUT_S", "abc", "a number of seconds > 0"),
    ("PAGODA_DIST_TIMEOUT_S", "0", "a number of seconds > 0"),
    ("PAGODA_TP_JOIN_TIMEOUT_S", "nan", "a number of seconds > 0"),
    ("PAGODA_TP_COLLECTIVE_TIMEOUT_S", "inf", "a number of seconds > 0"),
    ("PAGODA_CPU_THREADS", "-1", "a whole number >= 1"),
    ("PAGODA_PDL", "yes", "0 or 1"),
])
def test_pagoda_serve_stops_on_a_bad_value_before_anything_starts(name, value, must_be):
    out = _pagoda("serve", "--model", "pagoda-tiny", "--device", "cpu", env={name: value})
    assert out.returncode == 2, out.stderr
    assert f"pagoda serve: {name} must be {must_be}, got {value!r}" in out.stderr
    assert "Traceback" not in out.stderr and "KV cache capacity" not in out.stdout


def test_other_verbs_do_not_read_them_at_import():
    out = _pagoda("route", "--help", env={name: "abc" for name in ALL})
    assert out.returncode == 0, out.stderr


def test_only_envs_reads_the_environment_for_a_pagoda_variable():
    """Every PAGODA_* variable is read through a function of `envs`, so one module lists them all."""
    import pathlib
    import re

    package = pathlib.Path(envs.__file__).parent
    sources = {path: path.read_text() for path in package.rglob("*.py") if path.name != "envs.py"}
    # Constants naming a variable: PAGODA_* ones, wherever defined.
    names = {m for text in sources.values() for m in re.findall(r"^(\w+) = \"PAGODA_", text, re.M)}
    names |= {name for name in vars(envs) if name.endswith("_ENV")}
    readers = re.compile(r"os\.environ\.get\(|os\.getenv\(|os\.environ\[[^]=]*\](?!\s*=)")
    offenders = []
    for path, text in sources.items():
        for number, line in enumerate(text.splitlines(), 1):
            if readers.search(line) and ("PAGODA_" in line or any(re.search(rf"\b{n}\b", line) for n in names)):
                offenders.append(f"{path.relative_to(package)}:{number}: {line.strip()}")
    assert offenders == []

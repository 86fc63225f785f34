"""`make serve` listens on this machine only unless its ARGS name a host; `pagoda serve` itself
keeps vLLM's default, every interface."""

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest

from pagoda_engine.serve import add_arguments

ROOT = Path(__file__).resolve().parents[2]


def serve_command(args: str) -> list[str]:
    """The flags `make serve ARGS=...` passes (-n: printed, not run; -o: setup counted as done)."""
    out = subprocess.run(["make", "-n", "-o", ".venv/.pagoda-setup", "serve", f"ARGS={args}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    (line,) = [ln for ln in out.splitlines() if "pagoda serve" in ln]
    return line.split("pagoda serve", 1)[1].split()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("args, flags", [
    ("", ["--host", "127.0.0.1"]),
    ("--port 9000", ["--host", "127.0.0.1", "--port", "9000"]),
    ("--host 0.0.0.0 --port 9000", ["--host", "0.0.0.0", "--port", "9000"]),
    ("--host=::1", ["--host=::1"]),
])
def test_make_serve_listens_on_loopback_unless_args_name_a_host(args, flags):
    assert serve_command(args) == flags


def test_pagoda_serve_itself_listens_on_every_interface_by_default():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).host == "0.0.0.0"

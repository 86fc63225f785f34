"""`python -m pagoda_engine.bench.gemv_sweep` on a GPU, cut short: one shape, FP8, one and two rows,
the engine's cuts and a few others, compiling as it times. Each cut the engine picks today is
checked and timed, and the summary names the best beside it; `--chain` times a decode step's
projections."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_support import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def test_the_sweep_times_the_engines_cuts_and_names_the_best(tmp_path, capsys, monkeypatch):
    from pagoda_engine.bench import gemv_sweep

    every = gemv_sweep.candidates

    def few(*args):
        cands = every(*args)
        now = {gemv_sweep.default_label("o", "fp8", rows) for rows in (1, 2)}
        others = [c for c in cands if c.label() not in now and c.kernel != "mma"]  # mma: its own test
        return [c for c in cands if c.label() in now] + others[::12]

    monkeypatch.setattr(gemv_sweep, "candidates", few)
    out = tmp_path / "sweep.jsonl"
    gemv_sweep.main(["--shapes", "o", "--dtypes", "fp8", "--rows", "1,2", "--jobs", "1", "--json", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    timed = {(r["rows"], r["cut"]): r for r in lines}
    for rows in (1, 2):
        now = timed[(rows, gemv_sweep.default_label("o", "fp8", rows))]
        assert now["status"] == "ok" and 0 < now["us"] < 1000 and now["tbs"] > 0.1
    assert len(lines) > 2 and not any(r["status"].startswith("WRONG") for r in lines)
    text = capsys.readouterr().out
    assert "o        fp8  rows=1: best " in text and "o        fp8  rows=2: best " in text


def test_the_chain_times_a_decode_steps_projections():
    from pagoda_engine.bench import gemv_sweep

    assert 0 < gemv_sweep.chain_us("fp8", torch.device("cuda"), layers=2) < 5000

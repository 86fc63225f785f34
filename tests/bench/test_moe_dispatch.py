"""`python -m pagoda_engine.bench.moe_dispatch` on CPU (two gloo processes, a small layer): every
way of reaching the other core's experts gives the all-gather's output (checked inside the bench
before timing) and a time per token count."""

from pagoda_engine.bench import moe_dispatch


def test_every_way_is_checked_and_timed_at_each_token_count(capsys):
    assert moe_dispatch.main(["--tokens", "1,16", "--hidden", "32", "--experts", "8", "--intermediate", "16",
                              "--top-k", "2", "--iters", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "across 2 data-parallel cores, gloo" in lines[0]
    assert "alltoallv x2 (dbo)" in lines[1]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "16"]
    assert all(len(row) == 4 and all(float(v) > 0 for v in row[1:]) for row in rows)

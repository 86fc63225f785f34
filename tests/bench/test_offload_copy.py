"""`python -m pagoda_engine.bench.offload_copy` on CPU: the KV offload data plane's store and load
round trip on a tiny pool, with contiguous and fragmented slots, pages back bit for bit."""

from __future__ import annotations

import json

from pagoda_engine.bench.offload_copy import main


def test_offload_copy_bench_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "copy.json"
    assert main(["--device", "cpu", "--pages", "24", "--load-pages", "5", "--repeats", "1",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["bit_identical"] and r["pages"] == 24 and r["pinned_h2d_Bps"] is None
    assert set(r["layouts"]) == {"contiguous", "fragmented"}
    for x in r["layouts"].values():
        assert x["store_Bps"] > 0 and x["load_Bps"] > 0 and x["load_share"] is None
    printed = capsys.readouterr().out
    assert "contiguous slots, load" in printed and "bit-identical: True" in printed

"""`pagoda bench multiturn` (M1) end to end on the tiny model: it starts `pagoda serve` with a
CPU tier and a pool smaller than the conversations, runs every turn, and reports TTFT per turn
kind, throughput, and hit rates per tier that match what the tiers did."""

from __future__ import annotations

import json

from pagoda_engine.bench.multiturn import load_summary, working_set_pages
from pagoda_engine.cli import main


def test_working_set_counts_every_conversations_final_context():
    # 64 context + 3 x 16 new + 2 x 8 replies = 128 tokens = 8 pages, for each of 3 users.
    assert working_set_pages(3, 3, 64, 16, 8, 16) == 24


def test_m1_smoke_run_on_cpu(tmp_path, capsys):
    from pagoda_engine.tiny import default_model_dir

    out = tmp_path / "m1.json"
    rc = main(["bench", "multiturn", "--model", str(default_model_dir()), "--load-format", "auto", "--dtype", "float32",
               "--device", "cpu", "--users", "3", "--turns", "3", "--context-len", "64", "--new-tokens", "16",
               "--output-len", "8", "--request-rate", "inf", "--kv-offload-cpu-gb", "0.1",
               "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["errors"]) == (9, 0, [])
    # The default pool: a third of the working set, at least two whole conversations (+ the null page).
    assert r["num_gpu_blocks_override"] == 2 * -(-(64 + 3 * 24) // 16) + 1
    for name in ("ttft_first_turn_ms", "ttft_later_turns_ms"):
        assert 0 < r[name]["p50"] <= r[name]["p99"]
    assert r["output_tokens_per_s"] > 0
    # Every turn's prompt and its tokens but the last went through the engine's steps.
    assert r["steps"] >= 3 * 8 and r["mean_tokens_per_step"] * r["steps"] >= 3 * (64 + 16 + 7)
    assert r["wall_ms_per_step"] > 0
    cpu = r["hit_rates"]["cpu"]
    assert cpu["hit_tokens"] > 0 and 0 < cpu["hit_rate"] <= 1  # later turns found their context in host memory
    assert r["hit_rates"]["device"]["hit_rate"] > 0
    assert r["cpu_loads"] > 0 and r["cpu_load_landed_ms_mean"] >= 0
    printed = capsys.readouterr().out
    assert "TTFT later turns" in printed and "hit rate cpu" in printed and "loads from the CPU tier" in printed


def test_load_summary_averages_the_sampled_gauges():
    samples = [{"running": 2.0, "waiting": 1.0, "kv_usage": 0.5}, {"running": 4.0, "waiting": 0.0, "kv_usage": 0.9},
               {"running": 6.0, "waiting": 3.0, "kv_usage": 1.0}]
    assert load_summary(samples) == {"samples": 3, "running_mean": 4.0, "running_p25_p50_p75": [3.0, 4.0, 5.0],
                                     "waiting_mean": 1.33, "kv_usage_mean": 0.8}
    assert load_summary([])["running_mean"] is None

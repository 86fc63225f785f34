"""`pagoda bench kv-share` end to end on the tiny model: it starts a real `redis-server` (the Debian
package; skipped without it) and two `pagoda serve` engines sharing it, and its report says, from
engine B's own counters, that every remote hit came from Redis and every recompute found nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import redis

from pagoda_engine.bench import remote_read
from pagoda_engine.cli import main
from pagoda_engine.envs import kv_remote_read_connections

REDIS_SERVER = shutil.which("redis-server")


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (make setup installs it as root)")
def test_kv_share_remote_hits_come_from_redis_and_recomputes_find_nothing(tmp_path, capsys):
    out = tmp_path / "kv-share.json"
    rc = main(["bench", "kv-share", "--model", "pagoda-tiny", "--device", "cpu", "--dtype", "float32",
               "--input-len", "256", "--num-prompts", "2", "--redis-maxmemory-gb", "0.25", "--redis-io-threads", "2",
               "--redis-shards", "2", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["valid"] and r["completed"] == 6
    assert "2 I/O threads" in r["redis"] and r["remote_read_connections"] == kv_remote_read_connections()
    assert r["redis_shards"] == 2 and len(r["redis_url"].split(",")) == 2
    runs = {kind: [x for x in r["runs"] if x["kind"] == kind] for kind in ("recompute", "remote_hit", "computed_on_a")}
    assert [len(v) for v in runs.values()] == [2, 2, 2]
    for x in runs["remote_hit"]:
        # Redis held every page but the last (a prompt's last token is always computed); B's prefix
        # hits are the pages it took from Redis (a split load computes the front), none from its device.
        assert x["engine"] == "B" and x["remote_hit_tokens"] == 256 - 16 and x["device_hit_tokens"] <= 0
        assert x["remote_loaded_bytes"] > 0 and x["remote_load_s"] > 0
    for x in runs["recompute"]:
        assert x["engine"] == "B" and x["remote_hit_tokens"] == 0 and x["device_hit_tokens"] == 0
    for kind in ("recompute", "remote_hit"):
        assert 0 < r[kind]["ttft_ms"]["p50"] and r[kind]["valid"] == 2
    assert r["remote_load_bytes_per_s"] > 0
    assert r["ttft_ratio_p50"] == pytest.approx(r["remote_hit"]["ttft_ms"]["p50"] / r["recompute"]["ttft_ms"]["p50"],
                                                abs=1e-3)
    for url in r["redis_url"].split(","):
        with pytest.raises(redis.ConnectionError):  # the redis-servers it started are stopped
            redis.Redis.from_url(url, socket_timeout=2).ping()
    printed = capsys.readouterr().out
    assert "remote hit on B" in printed and "TTFT remote hit / recompute" in printed and "target <= 0.5" in printed


def test_kv_share_refuses_the_tiers_that_would_hide_a_remote_hit(capsys):
    with pytest.raises(SystemExit, match="remote tier alone"):
        main(["bench", "kv-share", "--model", "pagoda-tiny", "--kv-offload-cpu-gb", "1"])


@pytest.mark.parametrize("flags, message", [
    (["--redis-shards", "0"], "--redis-shards must be >= 1"),
    (["--redis-shards", "2", "--kv-offload-remote-url", "redis://kv:6379"], "--redis-shards starts Redis servers"),
])
def test_kv_share_refuses_a_bad_shard_count(flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "kv-share", "--model", "pagoda-tiny", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--shards", "2", "0"], "--shards must be >= 1, got 2 0"),
    (["--connections", "-1"], "--connections must be >= 1, got -1"),
    (["--pages", "0"], "--pages must be >= 1, got 0"),
    (["--page-mib", "0"], "--page-mib must be > 0, got 0.0"),
])
def test_remote_read_bench_refuses_counts_below_one(flags, message):
    with pytest.raises(SystemExit, match=message):
        remote_read.main(flags)


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (make setup installs it as root)")
def test_remote_read_bench_measures_both_readers_on_every_setting(tmp_path, capsys):
    out = tmp_path / "remote-read.json"
    assert remote_read.main(["--pages", "8", "--page-mib", "0.25", "--connections", "1", "3", "--io-threads", "1", "2",
                             "--shards", "1", "3", "--repeats", "2", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    measured = [(x["io_threads"], x["shards"], x["reader"], x["connections"]) for x in r["results"]]
    assert measured == [(n, s, reader, k) for n in (1, 2) for s in (1, 3)
                        for reader, k in (("mget", 1), ("resp", 1), ("resp", 3))]
    assert all(x["best_GBps"] >= x["median_GBps"] > 0 and len(x["seconds"]) == 2 for x in r["results"])
    assert all(x["redis_cpu_ms_median"] >= 0 and x["reader_cpu_ms_median"] > 0 for x in r["results"])
    out = capsys.readouterr().out
    assert "| RESP reader, 3 conn. per server |" in out and "io-threads 2, 3 servers" in out

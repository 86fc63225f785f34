"""KV offload tiers with real processes: two `pagoda serve` engines sharing a remote tier sharded
over two real `redis-server`s (the Debian package; the module skips without it), each engine with
a pool far too small to keep prompts on the device.

- A prompt computed on engine A comes back on engine B from Redis, with A's greedy tokens, its
  pages spread over both servers.
- Faults never give a wrong token or a 5xx, and the metrics and the log say what happened: a Redis
  entry overwritten with garbage, a disk file truncated, Redis killed mid-run.
The expected tokens come from the same tiny model run in-process with no tier at all.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from pagoda_e2e import Proc, free_port, start_pagoda, until
from pagoda_engine import LLM, SamplingParams
from pagoda_engine.core.kv.block_pool import hash_pages
from pagoda_engine.tiny import default_model_dir
from tests.server.conftest import Server, scrape

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed (make setup installs it as root)")

PAGE = 16
PASSWORD = "kv-secret"
MODEL = str(default_model_dir())  # the built-in tiny Llama
POOL = ["--model", MODEL, "--served-model-name", "pagoda-tiny", "--num-gpu-blocks-override", "24",
        "--max-model-len", "256", "--max-num-seqs", "4"]


def _prompt(seed: int, length: int = 100) -> list[int]:
    return np.random.default_rng(seed).integers(5, 400, size=length).tolist()


def _page_hashes(prompt: list[int]) -> list[bytes]:
    return hash_pages(prompt, PAGE)


class Redis:
    def __init__(self, tmp: Path):
        import redis

        tmp.mkdir(exist_ok=True)
        self.port = free_port()
        self.proc = Proc([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--requirepass", PASSWORD, "--dir", str(tmp)], tmp / "redis.log")
        self.client = redis.Redis(port=self.port, password=PASSWORD, socket_timeout=2)
        until(self._ping, 30, "redis-server to answer")

    def _ping(self) -> bool:
        try:
            return self.client.ping()
        except Exception:
            return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def keys_of(self, prompt: list[int]) -> list[bytes]:
        """The Redis keys of the prompt's pages (any fingerprint) on this server."""
        return [k for h in _page_hashes(prompt) for k in self.client.scan_iter(match=b"pagoda:kv:*:" + h.hex().encode())]


class Shards:
    """The remote tier of these engines: two Redis servers, each page on the one its key picks."""

    def __init__(self, tmp: Path):
        self.servers = [Redis(tmp / f"redis-{i}") for i in range(2)]
        self.url = ",".join(server.url for server in self.servers)

    def entries_of(self, prompt: list[int]) -> list[tuple[Redis, bytes]]:
        return [(server, key) for server in self.servers for key in server.keys_of(prompt)]


def _serve(tmp: Path, name: str, *flags: str) -> Server:
    port = free_port()
    proc = start_pagoda(["serve", "--host", "127.0.0.1", "--port", str(port), *POOL, *flags], tmp / f"{name}.log",
                        env={"PAGODA_KV_REMOTE_PASSWORD": PASSWORD, "PAGODA_KV_REMOTE_TIMEOUT_S": "0.5",
                             "PAGODA_KV_REMOTE_BACKOFF_S": "1"})
    proc.wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
    return Server(proc, port)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv-offload")
    redis = Shards(tmp)
    a = _serve(tmp, "a", "--kv-offload-cpu-gb", "0.1", "--kv-offload-remote-url", redis.url)
    # B loads whole prefixes (no split), so that what it takes from Redis does not depend on how
    # fast it computes; split loads are tested in tests/engine/test_kv_offload.py.
    b = _serve(tmp, "b", "--kv-offload-disk-path", str(tmp / "disk-b"), "--kv-offload-disk-gb", "0.1",
               "--kv-offload-remote-url", redis.url, "--no-kv-offload-split-loads")
    reference = LLM(MODEL, num_gpu_blocks_override=512, max_model_len=256)
    yield redis, a, b, reference, tmp
    reference.close()
    for proc in (a.proc, b.proc, *(server.proc for server in redis.servers)):
        proc.stop()


def _complete(server: Server, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{server.base_url}/completions", timeout=60, json={
        "model": "pagoda-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _expected(reference: LLM, prompt: list[int]) -> str:
    return reference.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text


def _metric(server: Server, name: str, tier: str) -> float:
    return scrape(server.url).get(f"pagoda:kv_offload_{name}{{tier={tier}}}", 0.0)


def _settled(server: Server, prompt: list[int], tier: str) -> None:
    """Until the engine has stored the prompt's full pages to `tier`."""
    until(lambda: _metric(server, "stored_bytes_total", tier) > 0 and not scrape(server.url)["pagoda:num_requests_running"],
          30, f"pages stored to {tier}")
    time.sleep(0.3)


def _written_to_redis(a: Server, reference: LLM, seed: int) -> tuple[list[int], str]:
    """A prompt engine A computed and wrote to Redis, and its expected completion."""
    prompt = _prompt(seed)
    expected = _expected(reference, prompt)
    assert _complete(a, prompt) == expected
    _settled(a, prompt, "remote")
    return prompt, expected


def _evict(server: Server, seeds: range) -> None:
    """Other prompts through the engine's 23-page pool, so earlier prompts leave the device."""
    for seed in seeds:
        _complete(server, _prompt(seed))


def test_prefix_computed_on_one_engine_is_loaded_by_another_from_redis(stack):
    redis, a, b, reference, _ = stack
    prompt, expected = _written_to_redis(a, reference, 1)
    held = [len(server.keys_of(prompt)) for server in redis.servers]
    assert sum(held) == len(prompt) // PAGE and min(held) > 0  # one entry per full page, spread over both
    assert _complete(b, prompt) == expected
    assert _metric(b, "hit_tokens_total", "remote") >= (len(prompt) - 1) // PAGE * PAGE
    assert _metric(b, "loaded_bytes_total", "remote") > 0
    assert _metric(b, "errors_total", "remote") == 0
    metrics = scrape(b.url)
    assert metrics["pagoda:kv_offload_load_seconds_count{tier=remote}"] >= 1
    assert metrics["pagoda:kv_offload_capacity_bytes{tier=disk}"] > 0
    assert metrics["pagoda:prefix_cache_hits_total"] >= (len(prompt) - 1) // PAGE * PAGE


def test_garbage_in_redis_is_a_miss_not_a_wrong_token(stack):
    redis, a, b, reference, _ = stack
    prompt, expected = _written_to_redis(a, reference, 2)
    entries = redis.entries_of(prompt)
    assert entries
    for server, key in entries:
        server.client.set(key, b"garbage" * 100)
    errors = _metric(b, "errors_total", "remote")
    assert _complete(b, prompt) == expected
    assert _metric(b, "errors_total", "remote") > errors
    assert "remote entry" in b.proc.log_text() and "unusable" in b.proc.log_text()


def test_truncated_disk_file_is_a_miss_not_a_wrong_token(stack):
    redis, a, b, reference, tmp = stack
    prompt = _prompt(3)
    expected = _expected(reference, prompt)
    assert _complete(b, prompt) == expected
    _settled(b, prompt, "disk")
    _evict(b, range(100, 105))
    files = [p for h in _page_hashes(prompt) for p in (tmp / "disk-b").glob(f"*/{h.hex()}.kv")]
    assert files
    for path in files:
        with open(path, "r+b") as f:
            f.truncate(10)
    errors = _metric(b, "errors_total", "disk")
    assert _complete(b, prompt) == expected
    assert _metric(b, "errors_total", "disk") > errors
    assert "disk entry" in b.proc.log_text()


def test_redis_killed_mid_run_skips_the_remote_tier_and_serving_goes_on(stack):
    redis, a, b, reference, _ = stack
    prompts = [_prompt(seed) for seed in range(10, 14)]
    expected = [_expected(reference, p) for p in prompts]
    assert _complete(a, prompts[0]) == expected[0]
    for server in redis.servers:
        server.proc.kill()
    errors = _metric(a, "errors_total", "remote")
    t0 = time.monotonic()
    for prompt, want in zip(prompts, expected):
        assert _complete(a, prompt) == want
        assert _complete(b, prompt) == want
    assert time.monotonic() - t0 < 30  # bounded timeouts, not a hang per request
    until(lambda: _metric(a, "errors_total", "remote") > errors, 10, "remote errors counted")
    assert "remote tier" in a.proc.log_text() and "skipping it" in a.proc.log_text()
    assert httpx.get(f"{a.url}/health").status_code == 200

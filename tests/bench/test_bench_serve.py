"""`pagoda bench serve` (S1): Poisson arrivals, streamed requests against a real `pagoda serve`,
latency figures consistent with what came back; failures are counted, not hidden; a server it
starts itself is stopped when the run ends."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from pagoda_engine.bench.serve import arrival_offsets
from pagoda_engine.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))

from pagoda_e2e import free_port, start_engine  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model():
    from pagoda_engine.tiny import default_model_dir

    return str(default_model_dir())


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    port = free_port()
    proc = start_engine(port, tmp_path_factory.mktemp("serve") / "serve.log",
                        extra=["--model", "pagoda-tiny", "--num-kv-pages", "512", "--max-model-len", "256", "--max-num-seqs", "32"])
    yield f"http://127.0.0.1:{port}"
    proc.stop()


def test_arrivals_are_a_seeded_poisson_process():
    offsets = arrival_offsets(4000, rate=20.0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=1e-9)  # exponential gaps scaled to mean 1/rate exactly
    assert arrival_offsets(400, rate=32.0)[-1] == pytest.approx(399 / 32.0)  # the sample offers the rate asked
    assert gaps.std() == pytest.approx(1 / 20.0, rel=0.1)  # and standard deviation 1/rate
    assert arrival_offsets(50, rate=20.0) == arrival_offsets(50, rate=20.0)
    assert arrival_offsets(3, rate=float("inf")) == [0.0, 0.0, 0.0]


def test_s1_against_a_running_server(server_url, tiny_model, tmp_path, capsys):
    out = tmp_path / "s1.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--num-prompts", "12",
               "--input-len", "24", "--output-len", "6", "--request-rate", "40", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["errors"]) == (12, 0, [])
    assert (r["input_tokens"], r["output_tokens"]) == (12 * 24, 12 * 6)  # the server's own usage counts
    assert r["standard_workload"] is False and r["server_startup_s"] is None and r["server_http"] is None
    assert r["server_flags"] is None  # a server started elsewhere: its flags are not known here
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = r[name]
        assert 0 < s["p50"] <= s["p99"], (name, s)
    assert r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"]
    assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["duration_s"], rel=0.01)
    assert "TTFT  ms:" in capsys.readouterr().out
    # The load client's own CPU is measured; a server this run did not start has no API figure.
    assert r["cpu"]["client_cpu_s"] > 0 and r["cpu"]["client_cpu_ms_per_token"] > 0
    assert r["cpu"]["api_cpu_ms_per_token"] is None


def test_failed_requests_are_counted_and_fail_the_run(server_url, tiny_model, tmp_path):
    out = tmp_path / "s1.json"
    # 300-token prompts exceed the server's max_model_len of 256: every request gets a 400.
    rc = main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--num-prompts", "3",
               "--input-len", "300", "--output-len", "4", "--request-rate", "inf", "--output-json", str(out)])
    assert rc == 1
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"]) == (0, 3)
    assert r["errors"] and r["errors"][0].startswith("HTTP 400")
    assert httpx.get(f"{server_url}/health", timeout=10).status_code == 200  # the server is unharmed


def test_synthetic_tokenizer_maps_every_id_to_one_word(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from pagoda_engine.bench import default_model_dir
    from pagoda_engine.bench.serve import with_token_tokenizer

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    made = with_token_tokenizer(default_model_dir())  # the shipped Llama-3.1-8B config: no tokenizer
    assert made != default_model_dir() and with_token_tokenizer(made) == made
    assert with_token_tokenizer(default_model_dir()) == made  # cached, not rebuilt
    tok = AutoTokenizer.from_pretrained(made)
    assert len(tok) == 128256
    ids = [0, 5, 128000, 128255]
    assert tok.decode(ids) == "<0> <5> <128000> <128255>"
    assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids


def test_a_model_name_is_resolved_as_serve_resolves_it(tmp_path, monkeypatch):
    # `bench serve --model pagoda-tiny` (the built-in model, which has its own tokenizer) used to
    # look for a directory named pagoda-tiny.
    from pagoda_engine.bench.serve import with_token_tokenizer
    from pagoda_engine.tiny import default_model_dir

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    assert with_token_tokenizer("pagoda-tiny") == str(default_model_dir())


def test_starts_and_stops_its_own_server(tiny_model, tmp_path, monkeypatch):
    """A model directory without a tokenizer (weights and config only) gets the synthetic one."""
    import shutil

    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for f in Path(tiny_model).iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy(f, model / f.name)
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "s1.json"
    rc = main(["bench", "serve", "--model", str(model), "--dtype", "float32", "--device", "cpu",
               "--num-kv-pages", "128", "--max-model-len", "128", "--num-prompts", "4", "--input-len", "8",
               "--output-len", "3", "--request-rate", "inf", "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["output_tokens"] == 12 and r["server_startup_s"] > 0
    # The engine's dependencies: the fast event loop and HTTP parser, recorded with the figures.
    assert r["server_http"]["event_loop"].startswith("uvloop ") and r["server_http"]["http_parser"].startswith("httptools ")
    assert r["model"] == "no-tokenizer"  # served under the directory's name, not the cache path
    # The flags that shape its steps, as started (None: the engine's own choice for the device).
    assert r["server_flags"] == {"max_num_seqs": None, "max_num_batched_tokens": 8192,
                                 "long_prefill_token_threshold": 0, "async_scheduling": None,
                                 "step_launch_pacing": None, "cudagraph_mode": None, "enable_prefix_caching": True,
                                 "api_server_count": 1}
    if Path("/proc/self/stat").exists():  # the API process's CPU clock, read from /proc
        assert r["cpu"]["api_cpu_s"] > 0
        assert r["cpu"]["api_cpu_ms_per_token"] == pytest.approx(r["cpu"]["api_cpu_s"] * 1e3 / 12, rel=0.01)
    assert not multiprocessing.active_children()  # the server process is gone


def test_invalid_rate_is_refused(tiny_model):
    with pytest.raises(SystemExit, match="--request-rate must be > 0"):
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", tiny_model, "--request-rate", "0"])


def test_rate_sweep_runs_every_rate_against_one_server(server_url, tiny_model, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--num-prompts", "6",
               "--input-len", "48", "--output-len", "4", "--rates", "30,inf", "--output-json", str(out),
               "--save-detailed"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["rates"] == [30.0, float("inf")] and [run["request_rate"] for run in r["runs"]] == r["rates"]
    for run in r["runs"]:
        assert (run["completed"], run["failed"], run["output_tokens"]) == (6, 0, 24)
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["p99"]
        # --save-detailed: every request, in arrival order, with the figures the percentiles come from.
        details = run["requests"]
        assert len(details) == 6 and [d["sent_s"] for d in details] == sorted(d["sent_s"] for d in details)
        assert all(d["error"] is None and d["output_tokens"] == 4 for d in details)
        assert all(len(d["itl_ms"]) <= 3 and min(d["itl_ms"], default=0) >= 0 for d in details)  # per text chunk
        assert sum(d["ttft_ms"] for d in details) / 6 == pytest.approx(run["ttft_ms"]["mean"], abs=0.01)
        assert all(0 < d["ttft_ms"] <= d["e2e_ms"] for d in details)
        # From the engine's own histograms, over this rate's requests only: an idle tiny engine
        # queues them for far less than the first bucket, 0.3 s; the mean TTFT splits into parts.
        srv = run["server"]
        assert (srv["queue_p50_le_ms"], srv["queue_p99_le_ms"]) == (300.0, 300.0)
        assert 0 <= srv["queue_mean_ms"] < run["ttft_ms"]["mean"] and 0 < srv["prefill_mean_ms"] < run["ttft_ms"]["mean"]
        assert srv["rest_mean_ms"] == pytest.approx(
            run["ttft_ms"]["mean"] - srv["queue_mean_ms"] - srv["prefill_mean_ms"], abs=0.01)
        assert srv["api_mean_ms"] > 0 and srv["client_mean_ms"] > 0  # the server's TTFT is inside the client's
        assert srv["api_mean_ms"] + srv["client_mean_ms"] == pytest.approx(srv["rest_mean_ms"], abs=0.01)
        assert srv["prefix_cache_queried_tokens"] == 6 * 48
    # Each rate has prompts of its own: the second finds none of the first's 2 cacheable pages a
    # prompt (the first rate's may share a page with other tests' seeded prompts).
    assert r["runs"][1]["server"]["prefix_cache_hit_tokens"] == 0
    table = capsys.readouterr().out
    assert "| rate req/s |" in table and "| 30 |" in table and "| inf |" in table
    assert "prefix cache: 0 of 288 prompt tokens hit" in table


def test_queue_time_quantile_bounds_between_two_scrapes():
    from pagoda_engine.bench.serve import histogram_quantile_bound, server_histograms

    text = "\n".join([
        "# TYPE pagoda:request_queue_time_seconds histogram",
        *(f'pagoda:request_queue_time_seconds_bucket{{engine="{e}",le="{le}",model_name="m"}} {n}'
          for e, rows in (("0", ((0.1, 4), (1.0, 8), ("+Inf", 10))), ("1", ((0.1, 0), (1.0, 2), ("+Inf", 2))))
          for le, n in rows),
        "",
    ])
    after = server_histograms(text).queue_buckets
    assert after == {0.1: 4, 1.0: 10, float("inf"): 12}  # summed over the engines
    # 10 observations in between: 2 <= 0.1 s, 6 in (0.1, 1], 2 above 1 s.
    before = {0.1: 2, 1.0: 2, float("inf"): 2}
    assert histogram_quantile_bound(0.2, before, after) == 0.1
    assert histogram_quantile_bound(0.6, before, after) == 1.0
    assert histogram_quantile_bound(0.95, before, after) is None  # beyond the last finite bound
    assert histogram_quantile_bound(0.5, after, after) is None  # nothing observed in between


def test_invalid_rate_list_is_refused(tiny_model):
    for bad in ("4,0", "fast", ""):
        with pytest.raises(SystemExit):
            main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", tiny_model, "--rates", bad])


def test_s1_with_a_json_schema_on_every_request(server_url, tiny_model, tmp_path):
    out = tmp_path / "s1.json"
    rc = main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--num-prompts", "8",
               "--input-len", "24", "--output-len", "12", "--request-rate", "inf", "--json-schema-fields", "10",
               "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["json_schema_fields"]) == (8, 0, 10)
    assert r["output_tokens"] == 8 * 12  # the schema is too long to be complete early


def test_the_bench_schema_is_fixed_and_outlasts_the_output():
    from pagoda_engine.bench.serve import bench_json_schema

    schema = bench_json_schema(10, 128)
    assert schema == bench_json_schema(10, 128) and len(schema["properties"]) == 10
    assert schema["required"] == list(schema["properties"])
    strings = [p for p in schema["properties"].values() if p.get("type") == "string"]
    assert sum(p["minLength"] for p in strings) >= 8 * 128


def test_the_byte_level_synthetic_tokenizer_can_write_json(tmp_path, monkeypatch):
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    from pagoda_engine.bench.serve import bench_json_schema, with_token_tokenizer
    from pagoda_engine.sampling_params import StructuredOutputsParams
    from pagoda_engine.structured_outputs import grammar_text

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 2000, "eos_token_id": [1500, 1501]}))
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    tok = AutoTokenizer.from_pretrained(with_token_tokenizer(str(model), byte_level=True))
    assert len(tok) == 2000 and tok.decode([ord("{"), 1500], skip_special_tokens=True) == "{"
    grammar = grammar_text(StructuredOutputsParams(json=bench_json_schema(4, 8)))  # as the server compiles it
    matcher = LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=2000), grammar)
    written = []
    for _ in range(40):  # the first allowed token each time: a valid JSON prefix, far past the brace
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        token = int(np.flatnonzero(bits[:2000])[0])
        assert matcher.consume_token(token)
        written.append(token)
    assert tok.decode(written).startswith('{"field_0":')


def test_flags_that_would_be_ignored_are_refused(tiny_model, server_url):
    with pytest.raises(SystemExit, match="give --rates .* or --request-rate .*, not both"):
        main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--rates", "4,8",
              "--request-rate", "4"])
    # The tiny model has its own tokenizer, and a running server keeps the one it has.
    with pytest.raises(SystemExit, match="--synthetic-tokenizer is for a server this run starts .* has its own"):
        main(["bench", "serve", "--model", tiny_model, "--synthetic-tokenizer", "bytes"])
    with pytest.raises(SystemExit, match="--synthetic-tokenizer .* is already running"):
        main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--synthetic-tokenizer", "words"])
    # M1 takes neither S1's sweep nor its sizes.
    with pytest.raises(SystemExit) as e:
        main(["bench", "multiturn", "--base-url", server_url, "--rates", "4,8"])
    assert e.value.code == 2  # argparse: no such flag for multiturn
    with pytest.raises(SystemExit, match="--num-prompts and --input-len do not apply"):
        main(["bench", "multiturn", "--base-url", server_url, "--num-prompts", "8"])



@pytest.mark.parametrize("argv, count", [([], 1), (["--api-server-count", "2"], 2)])
def test_the_server_it_starts_gets_its_api_server_count(argv, count):
    from pagoda_engine.bench.serve import _server_args
    from pagoda_engine.cli import build_parser

    args = build_parser().parse_args(["bench", "serve", *argv])
    assert _server_args(args, 8123).api_server_count == count


@pytest.mark.parametrize("chunked", [True, False])
def test_the_lean_stream_reader_reads_chunked_and_close_delimited_bodies(chunked):
    """The load client's own HTTP/1.1 reader: events split across writes and chunks, several in
    one chunk, an event with no text (a held-back byte), usage, [DONE]."""
    import asyncio

    from pagoda_engine.bench.serve import _one_stream

    events = [b'data: {"choices":[{"index":0,"text":"a"}]}\n\n',
              b'data: {"choices":[{"index":0,"text":""}]}\n\ndata: {"choices":[{"index":0,"text":"bc"}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3}}\n\n', b"data: [DONE]\n\n"]
    body = b"".join(events)
    pieces = [body[:10], body[10:57], body[57:]]  # cuts inside events

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                     .split(b":")[1])
        request = await reader.readexactly(length)
        assert b'"stream":true' in request
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     + (b"transfer-encoding: chunked\r\n" if chunked else b"") + b"\r\n")
        for piece in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        if chunked:
            writer.write(b"0\r\n\r\n")
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await _one_stream(f"http://127.0.0.1:{port}/v1/completions", {"stream": True}, 0.0, 0.0)

    r = asyncio.run(main())
    assert r.ok and r.error is None
    assert len(r.chunk_times) == 2  # the chunks with text
    assert r.first_choice <= r.chunk_times[0] <= r.chunk_times[1] <= r.done
    assert (r.prompt_tokens, r.output_tokens) == (7, 3)


def test_profile_records_the_chosen_rate_of_a_sweep_and_prints_the_paths(tiny_model, tmp_path, capsys):
    """A server started here gets a profiler config writing to --profile-dir; only --profile-rates
    are profiled, over --profile-window (here longer than the run: it ends with the run)."""
    out = tmp_path / "s1.json"
    rc = main(["bench", "serve", "--model", tiny_model, "--dtype", "float32", "--device", "cpu",
               "--num-kv-pages", "128", "--max-model-len", "128", "--num-prompts", "4", "--input-len", "8",
               "--output-len", "3", "--rates", "8,inf", "--profile", "--profile-rates", "inf",
               "--profile-window", "0,600", "--profile-dir", str(tmp_path / "prof"), "--output-json", str(out)])
    assert rc == 0
    unprofiled, profiled = json.loads(out.read_text())["runs"]
    assert unprofiled["profile"] is None
    [trace], [summary] = profiled["profile"]["traces"], profiled["profile"]["summaries"]
    assert trace.startswith(str(tmp_path / "prof")) and Path(trace).is_file() and Path(summary).is_file()
    printed = capsys.readouterr().out
    assert "--- profile of inf req/s: 1 trace(s)" in printed and trace in printed and summary in printed
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("argv, message", [
    (["--save-detailed"], "--save-detailed writes into --output-json; give it a file"),
    (["--profile-rates", "8"], "--profile-rates needs --profile"),
    (["--profile-window", "1,2"], "--profile-window needs --profile"),
    (["--profile", "--rates", "4,8", "--profile-rates", "16"], "--profile-rates 16 not among the rates run"),
    (["--profile", "--profile-dir", "d"], "--profile-dir is for a server started here"),
])
def test_profile_flags_that_cannot_apply_are_refused(tiny_model, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", tiny_model, *argv])


def test_profile_dir_and_a_profiler_config_must_agree(tiny_model, tmp_path):
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "a")})
    with pytest.raises(SystemExit, match="--profile-dir .* and --profiler-config's torch_profiler_dir .* differ"):
        main(["bench", "serve", "--model", tiny_model, "--profile", "--profiler-config", config,
              "--profile-dir", str(tmp_path / "b")])
    assert not multiprocessing.active_children()  # refused before a server started


def test_profile_against_a_server_without_a_profiler_config_says_so(server_url, tiny_model):
    with pytest.raises(RuntimeError, match="has no /start_profile: start the server with --profiler-config"):
        main(["bench", "serve", "--base-url", server_url, "--model", tiny_model, "--num-prompts", "2",
              "--input-len", "8", "--output-len", "2", "--profile"])


@pytest.mark.parametrize("window", ["5", "-1,2", "1,0", "a,b"])
def test_a_bad_profile_window_is_refused(tiny_model, window):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", tiny_model, "--profile",
              "--profile-window", window])
    assert exc.value.code == 2


def test_the_http_stack_names_the_fallbacks_where_the_fast_parts_are_missing(monkeypatch):
    import importlib

    from pagoda_engine.api.server import api_server

    real = importlib.import_module

    def without_them(name, *args):
        if name in ("uvloop", "httptools"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(api_server.importlib, "import_module", without_them)
    assert api_server.http_stack() == {"event_loop": "asyncio", "http_parser": "h11"}

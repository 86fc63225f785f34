"""`pagoda bench`: the workloads are exactly docs/benchmarks.md's, and a run on the tiny CPU model
reports figures consistent with what it generated."""

from __future__ import annotations

import argparse
import gc
import json

import pytest

from pagoda_engine.bench import default_model_dir
from pagoda_engine.bench.workloads import build_workload
from pagoda_engine.cli import main

LLAMA_VOCAB = 128256


def test_workloads_are_the_documented_ones_and_deterministic():
    t1 = build_workload("T1", LLAMA_VOCAB)
    assert (t1.num_requests, {len(p) for p in t1.prompts}, set(t1.output_lens)) == (1000, {1024}, {512})
    n1 = build_workload("N1", LLAMA_VOCAB)
    assert n1.num_requests == 256
    assert all(100 <= len(p) <= 1024 for p in n1.prompts) and all(100 <= n <= 1024 for n in n1.output_lens)
    assert len({len(p) for p in n1.prompts}) > 100  # lengths really vary
    l1 = build_workload("L1", LLAMA_VOCAB)
    assert (l1.num_requests, len(l1.prompts[0]), l1.output_lens) == (1, 128, [512])
    assert build_workload("N1", LLAMA_VOCAB).prompts == n1.prompts  # default_rng(0): same every time
    assert all(0 <= t < LLAMA_VOCAB for p in n1.prompts for t in p)
    params = t1.sampling_params(0)
    assert (params.temperature, params.ignore_eos, params.max_tokens) == (1.0, True, 512)


def test_shipped_llama_config_is_llama_31_8b():
    with open(f"{default_model_dir()}/config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (4096, 32, 8)
    assert config["rope_scaling"]["rope_type"] == "llama3"


def test_shipped_moe_config_is_qwen3_30b_a3b_and_named_by_model():
    from pagoda_engine.bench import _resolve_model, shipped_config_dir

    with open(f"{shipped_config_dir('qwen3-30b-a3b')}/config.json") as f:
        config = json.load(f)
    assert (config["model_type"], config["hidden_size"], config["num_hidden_layers"]) == ("qwen3_moe", 2048, 48)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 4, 128)
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (128, 8, 768)
    assert config["vocab_size"] == 151936
    args = argparse.Namespace(model="qwen3-30b-a3b")
    _resolve_model(args)
    assert args.model == shipped_config_dir("qwen3-30b-a3b")


def test_moe_roofline_counts_the_bytes_one_token_reads(tmp_path):
    """An MoE model's single-stream bytes: every weight but the unrouted experts and all embedding
    rows but one, checked term by term on the tiny Qwen3-MoE."""
    import torch

    from pagoda_engine.bench.offline import bytes_read_per_token, weight_bytes
    from pagoda_engine.worker.model.loader import load_hf_config, load_model
    from pagoda_engine.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", arch="qwen3_moe")
    model = load_model(str(model_dir), load_hf_config(str(model_dir)), torch.float32, torch.device("cpu"),
                       load_format="dummy")
    moe = [layer.mlp for layer in model.model.layers]
    experts = sum(m.experts.w13.nbytes + m.experts.w2.nbytes for m in moe)
    embed = model.model.embed_tokens.weight
    expected = weight_bytes(model) - experts * (1 - moe[0].top_k / moe[0].num_experts) - embed.nbytes + embed.nbytes // embed.shape[0]
    assert bytes_read_per_token(model) == expected < weight_bytes(model)


def test_fp8_roofline_reads_one_byte_per_projection_weight(tmp_path):
    """--quantization fp8: the projections' weights count one byte each (their row scales four
    bytes a row), the embedding and LM head their --dtype's bytes."""
    import torch

    from pagoda_engine.bench.offline import bytes_read_per_token, fp8_weight_bytes, weight_bytes
    from pagoda_engine.tiny import build_tiny_model
    from pagoda_engine.worker.model.layers import ColumnParallelLinear, RowParallelLinear
    from pagoda_engine.worker.model.loader import load_hf_config, load_model

    model_dir = str(build_tiny_model(tmp_path / "m"))
    config = load_hf_config(model_dir)
    plain = load_model(model_dir, config, torch.bfloat16, torch.device("cpu"), load_format="dummy")
    fp8 = load_model(model_dir, config, torch.bfloat16, torch.device("cpu"), load_format="dummy", quantization="fp8")
    projections = [m for m in fp8.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert fp8_weight_bytes(fp8) == sum(m.weight.numel() for m in projections) > 0
    scales = sum(m.weight_scale.nbytes for m in projections)
    assert weight_bytes(fp8) == weight_bytes(plain) - fp8_weight_bytes(fp8) + scales
    embed = fp8.model.embed_tokens.weight
    if embed.data_ptr() == fp8.lm_head.weight.data_ptr():  # tied: the LM head reads every row
        assert bytes_read_per_token(fp8) == weight_bytes(fp8)
    else:  # one embedding row, the LM head whole
        assert bytes_read_per_token(fp8) == weight_bytes(fp8) - embed.nbytes + embed.nbytes // embed.shape[0]


@pytest.fixture(scope="module")
def tiny_model():
    from pagoda_engine.tiny import default_model_dir as tiny_dir

    return str(tiny_dir())


def test_throughput_run_reports_what_it_generated(tiny_model, tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["bench", "throughput", "--model", tiny_model, "--dtype", "float32", "--num-prompts", "3",
               "--input-len", "12", "--output-len", "5", "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["workload"] == "T1" and result["standard_workload"] is False
    assert (result["input_tokens"], result["output_tokens"]) == (36, 15)
    assert result["output_tokens_per_s"] == pytest.approx(15 / result["elapsed_s"], rel=0.01)  # both are rounded
    assert result["settings"]["device"] == "cpu" and result["roofline"]["copy_bandwidth_Bps"] is None
    printed = capsys.readouterr().out
    assert "command: pagoda bench throughput" in printed and "output tokens/s" in printed


def test_latency_run_reports_time_per_token(tiny_model, tmp_path):
    out = tmp_path / "l.json"
    assert main(["bench", "latency", "--model", tiny_model, "--dtype", "float32", "--input-len", "8",
                 "--output-len", "6", "--num-iters", "2", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["iterations"]) == 2
    # median_e2e_s is rounded to 0.1 ms, so allow that much (spread over 6 tokens) besides 1%.
    assert result["ms_per_output_token"] == pytest.approx(result["median_e2e_s"] / 6 * 1e3, rel=0.01, abs=0.05 / 6 + 1e-3)


def test_fp8_kv_pages_run_and_are_reported(tiny_model, tmp_path):
    """--kv-cache-dtype fp8 (`throughput` builds its engine from the same flags): the run's engine
    keeps FP8 pages, and its settings say so."""
    out = tmp_path / "l.json"
    assert main(["bench", "latency", "--model", tiny_model, "--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
                 "--input-len", "8", "--output-len", "4", "--num-iters", "1", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["kv_cache_dtype"] == "fp8" and len(result["iterations"]) == 1


def test_shipped_drafting_models_fit_llama_31_8b():
    """`llama-3.2-1b` (a draft model) and `eagle3-llama-3.1-8b` (an EAGLE-3 head, the published
    head's shape) draft for the shipped Llama-3.1-8B: its vocabulary, its hidden size."""
    from pagoda_engine.bench import shipped_config_dir

    target, draft, head = (json.loads(open(f"{shipped_config_dir(n)}/config.json").read())
                           for n in ("llama-3.1-8b", "llama-3.2-1b", "eagle3-llama-3.1-8b"))
    assert draft["vocab_size"] == head["vocab_size"] == target["vocab_size"]
    assert (draft["hidden_size"], draft["num_hidden_layers"]) == (2048, 16)
    assert head["architectures"] == ["LlamaForCausalLMEagle3"] and head["hidden_size"] == target["hidden_size"]
    assert (head["num_hidden_layers"], head["draft_vocab_size"]) == (1, 32000)


def test_latency_with_a_draft_model_reports_its_acceptance(tiny_model, tmp_path, capsys):
    """The drafting path timed as L1 (`--speculative-config` with a draft model; L1 samples at
    temperature 1, so with dummy weights most drafts are refused: the cost of failed drafts)."""
    out = tmp_path / "d.json"
    config = json.dumps({"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3})
    assert main(["bench", "latency", "--model", tiny_model, "--dtype", "float32", "--input-len", "8",
                 "--output-len", "13", "--num-iters", "1", "--speculative-config", config,
                 "--output-json", str(out)]) == 0
    spec = json.loads(out.read_text())["speculative"]
    assert spec["method"] == "draft_model" and spec["num_drafts"] > 0
    assert spec["num_drafts"] <= spec["num_draft_tokens"] <= 3 * spec["num_drafts"]
    assert spec["mean_acceptance_length"] == round(1 + spec["num_accepted_tokens"] / spec["num_drafts"], 3)
    assert (f"speculative decoding (draft_model, k = 3): {spec['num_drafts']} drafts, mean acceptance length "
            f"{spec['mean_acceptance_length']}") in capsys.readouterr().out


def test_throughput_with_speculation_off_above_a_batch_size_reports_no_drafts(tiny_model, tmp_path, capsys):
    """T1 with `disable_by_batch_size` below its batch: the run reports its speculation (here none:
    the four requests run together from the first step to the last)."""
    out = tmp_path / "t.json"
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2})
    assert main(["bench", "throughput", "--workload", "T1", "--model", tiny_model, "--dtype", "float32",
                 "--num-prompts", "4", "--input-len", "8", "--output-len", "6", "--speculative-config", config,
                 "--output-json", str(out)]) == 0
    spec = json.loads(out.read_text())["speculative"]
    assert (spec["method"], spec["disable_by_batch_size"], spec["num_drafts"]) == ("ngram", 2, 0)
    assert "speculative decoding (ngram, k = 4, off above 2 running requests): 0 drafts" in capsys.readouterr().out


def test_spec_copy_reports_acceptance_speed_up_and_identical_outputs(tiny_model, capsys):
    """`bench.spec_copy` on the tiny model (its chat template; random weights copy little): both
    runs' figures, the speed-up of one over the other, and the verdict on the outputs."""
    from pagoda_engine.bench import spec_copy

    code = spec_copy.main(["--model", tiny_model, "--max-tokens", "12", "--dtype", "float32",
                           "--num-kv-pages", "64"])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["identical_outputs"] is True
    without, with_ = summary["without"], summary["with"]
    assert without["tokens"] == with_["tokens"] > 0
    assert summary["speed_up"] == round(with_["tokens_per_s"] / without["tokens_per_s"], 3)
    assert with_["mean_acceptance_length"] >= 1.0 and "mean_acceptance_length" not in without
    # One stream without speculation writes at most a token a step.
    assert with_["steps"] <= without["steps"] and without["steps"] >= without["tokens"]


def test_spec_replay_measures_each_k_and_acceptance_against_no_speculation(tiny_model, tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "latency", "--model", tiny_model, "--dtype", "float32", "--input-len", "8",
                 "--output-len", "24", "--num-iters", "1", "--spec-replay-acceptance", "0,1", "--spec-replay-k", "2",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["baseline"]["ms_per_output_token"] > 0
    none, all_kept = result["runs"]
    assert (none["k"], none["acceptance"], none["draft_acceptance_rate"], none["mean_acceptance_length"]) == (2, 0.0, 0, 1)
    # Every replayed draft is the token the model writes: all kept, up to 3 tokens a step.
    assert all_kept["draft_acceptance_rate"] == 1.0 and all_kept["mean_acceptance_length"] > 2.5
    assert (all_kept["replay_matched"], none["replay_matched"]) == (1.0, 1.0)
    assert "k=2 acceptance 100%" in capsys.readouterr().out
    assert main(["bench", "latency", "--model", tiny_model, "--spec-replay-acceptance", "0,2"]) == 2
    assert "shares in [0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["throughput", "latency"])
def test_timed_runs_leave_the_start_up_heap_to_the_collector_only_after(tiny_model, monkeypatch, bench):
    """The timed runs go with the heap frozen (as a core process's), and the process gets it back."""
    from pagoda_engine.bench import offline

    before = gc.get_freeze_count()
    frozen_while = {}
    drive = offline._drive

    def recording(core, wl, tag, *args, **kwargs):
        frozen_while[tag] = gc.get_freeze_count()
        return drive(core, wl, tag, *args, **kwargs)

    monkeypatch.setattr(offline, "_drive", recording)
    size = ["--num-prompts", "2"] if bench == "throughput" else ["--num-iters", "1"]
    assert main(["bench", bench, "--model", tiny_model, "--dtype", "float32", "--input-len", "8",
                 "--output-len", "4", *size]) == 0
    timed = "bench" if bench == "throughput" else "iter0"
    assert frozen_while[timed] > before
    if bench == "latency":
        assert frozen_while["warmup-run"] == before
    assert gc.get_freeze_count() == before


def test_invalid_sizes_are_refused(tiny_model, capsys):
    assert main(["bench", "throughput", "--model", tiny_model, "--num-prompts", "0"]) == 2
    assert "--num-prompts must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("bench", ["throughput", "latency", "serve"])
def test_invalid_engine_flags_are_refused_before_any_engine_starts(tiny_model, capsys, bench):
    assert main(["bench", bench, "--model", tiny_model, "--data-parallel-size", "0"]) == 2
    assert "pagoda bench: --data-parallel-size must be >= 1, got 0" in capsys.readouterr().err


def test_profile_records_the_chosen_steps(tiny_model, tmp_path, capsys):
    assert main(["bench", "throughput", "--model", tiny_model, "--dtype", "float32", "--num-prompts", "2",
                 "--input-len", "8", "--output-len", "6", "--profile", str(tmp_path / "prof"),
                 "--profile-steps", "1:3"]) == 0
    printed = capsys.readouterr().out
    assert "--- profiled steps 1..3: wall" in printed and "top ops by self CPU time" in printed
    assert (tmp_path / "prof" / "trace.json").is_file()
    with pytest.raises(SystemExit) as exc:
        main(["bench", "latency", "--model", tiny_model, "--profile", "x", "--profile-steps", "3"])
    assert exc.value.code == 2
    assert "expected FIRST:COUNT" in capsys.readouterr().err


def test_spec_replay_settles_on_the_continuation_the_speculating_run_writes(tiny_model):
    """A verification step sums in another order than a one-token decode, so in bf16 it may flip a
    near-tie the recorded run did not (llama-3.1-8b's dummy weights on an H200: from then on the
    run's context is not the recorded one, and no replayed draft was kept). Emulated here by a
    recording that leaves the run's own tokens after its fourth: replayed as recorded, drafts
    miss; settled, the bench replays what the speculating run writes and keeps every draft."""
    from pagoda_engine import LLM
    from pagoda_engine.bench.spec_replay import (MAX_SETTLE_ROUNDS, ReplayProposer, _Greedy, _outputs,
                                                 _settle)
    from pagoda_engine.core.spec_decode import SpecDecoder
    from pagoda_engine.speculative import SpeculativeConfig

    core = LLM(tiny_model, load_format="dummy", dtype="bfloat16").core
    prompt, other = [5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]
    wl = _Greedy("t", "one prompt", [prompt, other], [24, 24])
    own = _outputs(core, wl, "plain")
    recorded = {tuple(prompt): own[tuple(prompt)][:4] + own[tuple(other)][4:], tuple(other): own[tuple(other)]}
    assert recorded[tuple(prompt)] != own[tuple(prompt)]
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=1, prompt_lookup_min=1)

    def mean_acceptance_length(continuations) -> float:
        core.scheduler.spec = spec = SpecDecoder(config, ReplayProposer(continuations, 1.0, core.vocab_size))
        wl_one = _Greedy("t", "one prompt", [prompt], [24])
        assert _outputs(core, wl_one, f"replay-{id(continuations)}") == {tuple(prompt): own[tuple(prompt)]}
        return 1 + spec.stats.num_accepted_tokens / spec.stats.num_drafts

    assert mean_acceptance_length(recorded) < 2.0
    settled, rounds, matched = _settle(core, wl, config, recorded, 1.0, MAX_SETTLE_ROUNDS)
    assert (settled, rounds, matched) == (own, 2, 1.0)
    assert mean_acceptance_length(settled) > 2.8  # k + 1 = 3 at every step but the last ones

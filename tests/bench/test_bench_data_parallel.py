"""`pagoda bench throughput|latency --data-parallel-size N`: the offline workloads through N engine
core processes, driven over their sockets as the API server drives them. The requests spread over
the cores and every token comes back; with experts across the cores a lone stream runs while the
other core steps dummy batches."""

from __future__ import annotations

import json

import pytest
from pagoda_engine.cli import main


@pytest.fixture(scope="module")
def tiny_model():
    from pagoda_engine.tiny import default_model_dir as tiny_dir

    return str(tiny_dir())


def test_throughput_spreads_requests_over_the_cores(tiny_model, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", tiny_model, "--dtype", "float32", "--data-parallel-size", "2",
                 "--num-prompts", "6", "--input-len", "10", "--output-len", "4", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["data_parallel_size"] == 2
    assert (result["input_tokens"], result["output_tokens"]) == (60, 24)
    assert result["requests_per_core"] == [3, 3]  # sent all at once: the least-loaded core alternates
    assert all(steps > 0 for steps in result["steps_per_core"])
    assert result["output_tokens_per_s"] == pytest.approx(24 / result["elapsed_s"], rel=0.01)
    printed = capsys.readouterr().out
    assert "2 data-parallel engine cores" in printed and "per core: [3, 3] requests" in printed


def test_latency_with_experts_across_the_cores(tmp_path):
    """One request at a time: one core serves it, the other joins every step with a dummy batch
    (lockstep); without those the MoE layers' collectives would hang and the run time out."""
    from pagoda_engine.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "moe", arch="qwen3_moe")
    out = tmp_path / "l.json"
    assert main(["bench", "latency", "--model", str(model), "--dtype", "float32", "--data-parallel-size", "2",
                 "--enable-expert-parallel", "--input-len", "8", "--output-len", "5", "--num-iters", "2",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["enable_expert_parallel"] is True and len(result["iterations"]) == 2
    assert result["ms_per_output_token"] > 0


def test_profile_is_refused_with_several_cores(tiny_model):
    with pytest.raises(SystemExit, match="--profile needs the engine in this process"):
        main(["bench", "throughput", "--model", tiny_model, "--data-parallel-size", "2", "--num-prompts", "1",
              "--profile", "x"])


def test_allreduce_probe_times_each_size_on_two_ranks(capsys):
    """`python -m pagoda_engine.bench.allreduce`: two real processes (gloo here, NCCL on two GPUs),
    one line per size, after a check that the timed collective sums."""
    from pagoda_engine.bench import allreduce

    assert allreduce.main(["--rows", "1,64", "--hidden", "128", "--iters", "3"]) == 0
    printed = capsys.readouterr().out
    assert "over 2 ranks, gloo" in printed
    assert "     1 rows =     0.00 MB" in printed and "    64 rows =     0.02 MB" in printed
    for argv, message in ((["--rows", "0"], "--rows, --hidden and --iters must be >= 1"),
                          (["--rows", "x"], "--rows takes whole numbers separated by commas, got 'x'")):
        with pytest.raises(SystemExit) as exc:
            allreduce.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err

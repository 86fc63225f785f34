"""torch.profiler through the offline LLM (`profiler_config`, `start_profile`, `stop_profile`):
the trace holds the model's ops, delay_iterations and max_iterations count engine steps, misuse
is refused with typed errors, and bad configs are refused before an engine starts."""

import gzip
import json

import pytest

from pagoda_engine import LLM, SamplingParams
from pagoda_engine.profiler import InvalidProfilerConfigError, ProfilerStateError, parse_profiler_config
from pagoda_engine.tiny import build_tiny_model

PROMPT = list(range(5, 25))  # 20 tokens: the prefill step's embedding reads [20] ids, a decode step's [1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("prof") / "model", seed=1)


def _events(trace_path: str) -> list[dict]:
    with gzip.open(trace_path, "rt") as f:
        return json.load(f)["traceEvents"]


def _embedding_input_dims(trace_path: str) -> list:
    """The ids shape of every aten::embedding (one per forward) in the trace, in time order."""
    calls = [e for e in _events(trace_path) if e.get("name") == "aten::embedding"]
    return [e["args"]["Input Dims"][1] for e in sorted(calls, key=lambda e: e["ts"])]


def test_start_and_stop_write_a_trace_of_the_model_and_its_summary(model_dir, tmp_path):
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"), "torch_profiler_with_stack": False}
    with LLM(str(model_dir), num_kv_pages=64, profiler_config=config) as llm:
        llm.start_profile()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4))
        paths = llm.stop_profile()
    trace, summary = paths
    assert trace.endswith(".pt.trace.json.gz") and trace.startswith(str(tmp_path / "traces" / "dp0_pp0_tp0_rank0."))
    names = {e.get("name") for e in _events(trace)}
    assert {"aten::embedding", "aten::mm"} <= names
    text = open(summary).read()
    assert "wall" in text and "no GPU" in text and "aten::mm" in text


def test_delay_and_max_iterations_pick_the_steps_recorded(model_dir, tmp_path):
    """delay 1 skips the prefill step; max 3 records three decode steps and stops by itself, so the
    trace is written before stop_profile is called."""
    out = tmp_path / "traces"
    config = {"profiler": "torch", "torch_profiler_dir": str(out), "torch_profiler_with_stack": False,
              "torch_profiler_record_shapes": True, "delay_iterations": 1, "max_iterations": 3}
    with LLM(str(model_dir), num_kv_pages=64, profiler_config=config) as llm:
        llm.start_profile()
        llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))
        [trace] = list(out.glob("*.pt.trace.json.gz"))  # written already: the limit stopped it
        assert llm.stop_profile() == [str(trace), str(trace).replace(".pt.trace.json.gz", ".summary.txt")]
    assert _embedding_input_dims(str(trace)) == [[1], [1], [1]]


def test_profiler_misuse_is_refused(model_dir, tmp_path):
    with LLM(str(model_dir), num_kv_pages=64) as llm:
        with pytest.raises(ProfilerStateError, match="not configured"):
            llm.start_profile()
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": False,
              "torch_profiler_dump_cuda_time_total": False, "torch_profiler_with_stack": False}
    with LLM(str(model_dir), num_kv_pages=64, profiler_config=config) as llm:
        with pytest.raises(ProfilerStateError, match="not running"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(ProfilerStateError, match="already running"):
            llm.start_profile()
        [trace] = llm.stop_profile()  # no summary asked for; plain JSON
    assert trace.endswith(".pt.trace.json") and json.load(open(trace))["traceEvents"]


@pytest.mark.parametrize("config, message", [
    ({"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_dirr": "y"}, "unknown field"),
    ({"profiler": "torch", "torch_profiler_dir": ""}, "torch_profiler_dir must be set"),
    ({"profiler": "torch"}, "torch_profiler_dir must be set"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "max_iterations": "5"}, "max_iterations must be a whole"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "delay_iterations": -1}, "delay_iterations must be a whole"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "torch_profiler_with_stack": 1}, "must be true or false"),
    ({"profiler": "torch", "torch_profiler_dir": "x", "ignore_frontend": False}, "ignore_frontend must be true"),
    ({"profiler": "cuda"}, 'profiler must be "torch"'),
    ({"torch_profiler_dir": "x"}, 'set "profiler"'),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_profiler_configs_are_refused_before_an_engine_starts(config, message):
    with pytest.raises(InvalidProfilerConfigError, match=message):
        LLM("no-such-model-dir", profiler_config=config)


def test_a_config_without_a_profiler_is_off_and_the_directory_is_made_absolute(tmp_path, monkeypatch):
    assert not parse_profiler_config({}).enabled and not parse_profiler_config('{"profiler": null}').enabled
    assert not parse_profiler_config(None).enabled
    monkeypatch.chdir(tmp_path)
    config = parse_profiler_config('{"profiler": "torch", "torch_profiler_dir": "t"}')
    assert config.torch_profiler_dir == str(tmp_path / "t")

"""Engine flags map onto EngineConfig, bad values fail at start with the option's name, and the
capability table names real flags, hides those of features not implemented yet and refuses them."""

import argparse
from dataclasses import fields

import pytest

from pagoda_engine import capabilities, cli
from pagoda_engine.config import EngineConfig, add_engine_args, config_from_args, resolve_cudagraph_mode


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_cuda_graph_capture_size_flag_defaults_to_every_batch():
    assert parse().model.max_cudagraph_capture_size is None  # up to --max-num-seqs
    assert parse("--max-cudagraph-capture-size", "64").model.max_cudagraph_capture_size == 64
    assert parse("--enforce-eager").model.enforce_eager is True


def test_cudagraph_mode_flag_takes_vllms_names_in_either_case():
    assert parse().model.cudagraph_mode is None  # the default: resolve_cudagraph_mode decides
    assert parse("--cudagraph-mode", "full_decode_only").model.cudagraph_mode == "FULL_DECODE_ONLY"
    assert parse("--cudagraph-mode", "NONE").model.cudagraph_mode == "NONE"


def test_piecewise_graphs_are_the_default_on_one_gpu_and_asked_for_under_tensor_parallelism():
    assert resolve_cudagraph_mode(None, tensor_parallel_size=1) == "FULL_AND_PIECEWISE"
    assert resolve_cudagraph_mode(None, tensor_parallel_size=2) == "FULL_DECODE_ONLY"
    assert resolve_cudagraph_mode("FULL_AND_PIECEWISE", tensor_parallel_size=2) == "FULL_AND_PIECEWISE"
    assert resolve_cudagraph_mode("NONE", tensor_parallel_size=1) == "NONE"


def test_bad_cudagraph_mode_flag_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse("--cudagraph-mode", "piecewise_only")
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, message", [
    ("max_cudagraph_capture_size", 0, "max_cudagraph_capture_size"),
    ("cudagraph_mode", "FULL", "cudagraph_mode must be one of FULL_AND_PIECEWISE"),
    ("block_size", 12, "block_size"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("max_num_seqs", 0, "max_num_seqs"),
])
def test_bad_values_name_the_option(option, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**{option: value})


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="max_cuda_graph_size"):
        EngineConfig.from_kwargs(max_cuda_graph_size=8)


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_option_of_the_capability_table_is_an_engine_flag_named_as_the_table_says():
    actions = {action.dest: action for action in _engine_parser()._actions}
    options = [option for feature in capabilities.FEATURES for option in feature.options]
    assert options, "the table names no flags"
    config_fields = {f.name for section in vars(EngineConfig()).values() for f in fields(section)}
    for option in options:
        assert option in config_fields
        assert capabilities.flag_of(option) in actions[option].option_strings


def test_serve_help_shows_only_the_flags_of_features_the_engine_implements(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    for feature in capabilities.FEATURES:
        for option in feature.options:
            assert (capabilities.flag_of(option) in help_text) == feature.implemented, option
    assert "not implemented" not in help_text
    assert "--tensor-parallel-size" in help_text and "--max-num-seqs" in help_text


def test_hidden_flags_still_parse_so_the_engine_can_refuse_them_by_name(monkeypatch):
    monkeypatch.delenv("LWS_GROUP_SIZE", raising=False)
    config = parse("--pipeline-parallel-size", "2", "--enable-expert-parallel", "--kv-offload-disk-path", "/kv", "--kv-offload-disk-gb", "100")
    assert config.parallel.pipeline_parallel_size == 2 and config.cache.kv_offload_disk_gb == 100.0
    assert capabilities.refusal(config, {}) == (
        "not implemented in this engine yet: pipeline parallelism (--pipeline-parallel-size 2; tensor parallelism works); "
        "expert parallelism (--enable-expert-parallel; MoE models are not served yet); "
        "KV offload tiers on local disk (--kv-offload-disk-path /kv, --kv-offload-disk-gb 100.0)")
    assert "; multi-node serving (LWS_GROUP_SIZE=2; tensor parallelism works inside one pod); KV offload tiers on local disk" in (
        capabilities.refusal(config, {"LWS_GROUP_SIZE": "2"}))
    # What the engine implements, or the defaults, asks for nothing it lacks.
    assert capabilities.refusal(parse("--tensor-parallel-size", "2", "--pipeline-parallel-size", "1"), {"LWS_GROUP_SIZE": "1"}) is None
    assert [f.key for f, how in capabilities.requested(parse("-tp", "2"), {})] == ["tensor-parallel"]

"""Engine flags map onto EngineConfig, and bad values fail at start with the option's name."""

import argparse

import pytest

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

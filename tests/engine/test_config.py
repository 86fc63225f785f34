"""Engine flags map onto EngineConfig, and bad values fail at start with the option's name."""

import argparse

import pytest

from pagoda_engine.config import EngineConfig, add_engine_args, config_from_args


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_cuda_graph_capture_size_flag_defaults_to_every_batch():
    assert parse().model.max_cudagraph_capture_size is None  # up to --max-num-seqs
    assert parse("--max-cudagraph-capture-size", "64").model.max_cudagraph_capture_size == 64
    assert parse("--enforce-eager").model.enforce_eager is True


@pytest.mark.parametrize("option, value, message", [
    ("max_cudagraph_capture_size", 0, "max_cudagraph_capture_size"),
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

"""The LoRA flags (vLLM's): parsed from the command line in both of --lora-modules' forms, checked
by `EngineConfig.validate` with the flag named, and `pagoda serve` exits 2 on a bad one before
anything loads; a `--lora-modules` adapter that does not fit stops the start-up naming it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pagoda_engine.config import EngineConfig, add_engine_args, config_from_args
from pagoda_engine.lora import LoRAModulePath, LoRARequest, parse_lora_modules


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(list(argv)))


def test_flags_reach_the_config_with_vllms_defaults():
    default = parse()
    assert (default.model.enable_lora, default.model.lora_modules, default.model.max_loras,
            default.model.max_lora_rank, default.model.max_cpu_loras) == (False, None, 1, 16, None)
    spec = json.dumps({"name": "b", "path": "/adapters/b", "base_model_name": "base"})
    cfg = parse("--enable-lora", "--lora-modules", "a=/adapters/a", spec, "--max-loras", "4", "--max-lora-rank", "64",
                "--max-cpu-loras", "8")
    mc = cfg.model
    assert (mc.enable_lora, mc.max_loras, mc.max_lora_rank, mc.max_cpu_loras) == (True, 4, 64, 8)
    assert parse_lora_modules(mc.lora_modules) == [LoRAModulePath("a", "/adapters/a"),
                                                   LoRAModulePath("b", "/adapters/b", "base")]


@pytest.mark.parametrize("kwargs, message", [
    ({"lora_modules": ["a=/x"]}, "--lora-modules needs --enable-lora"),
    ({"enable_lora": True, "max_loras": 0}, "--max-loras must be >= 1, got 0"),
    ({"enable_lora": True, "max_lora_rank": 1024}, "--max-lora-rank must be <= 512, got 1024"),
    ({"enable_lora": True, "max_loras": 4, "max_cpu_loras": 2}, r"--max-cpu-loras \(2\) must be >= --max-loras \(4\)"),
    ({"enable_lora": True, "lora_modules": ["noequals"]}, "--lora-modules 'noequals': expected name=path"),
    ({"enable_lora": True, "lora_modules": ['{"name": "a"}']}, '"name" and "path" must be non-empty strings'),
    ({"enable_lora": True, "lora_modules": ['{"name": "a", "path": "/p", "rank": 8}']}, r"unknown keys \['rank'\]"),
    ({"enable_lora": True, "lora_modules": ["a=/p", "a=/q"]}, "adapter name 'a' is given twice"),
])
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_lora_request_is_checked_where_it_is_made():
    assert LoRARequest("a", 1, "/p").name == "a"
    with pytest.raises(ValueError, match="lora_int_id must be an integer of at least 1"):
        LoRARequest("a", 0, "/p")
    with pytest.raises(ValueError, match="lora_name must not be empty"):
        LoRARequest("", 1, "/p")


def test_serve_exits_2_naming_the_flag():
    out = subprocess.run([sys.executable, "-m", "pagoda_engine.cli", "serve", "--model", "pagoda-tiny",
                          "--lora-modules", "a=/nowhere"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--lora-modules needs --enable-lora" in out.stderr


def test_a_lora_module_that_does_not_fit_stops_the_engine_naming_it(tmp_path):
    from pagoda_engine import LLM

    with pytest.raises(ValueError, match="LoRA adapter 'gone': '/nowhere/gone' is not a directory"):
        LLM("pagoda-tiny", enable_lora=True, lora_modules=["gone=/nowhere/gone"], num_kv_pages=16)


def test_lora_is_refused_by_no_parallel_layout():
    from pagoda_engine import capabilities

    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"data_parallel_size": 2},
                   {"data_parallel_size": 2, "enable_expert_parallel": True}):
        assert capabilities.refusal(EngineConfig.from_kwargs(enable_lora=True, **layout), {}) is None, layout

"""`worker/compile_ahead.py`: inside the block, Triton launches note their variants and do not
run; on leaving it a pool of processes compiles each variant once into Triton's cache; after it,
the real launches load every variant from there and run it; a variant whose compile fails is left
for its real launch, which raises. An engine started on an
empty Triton cache compiles its kernels ahead (the profile step's, the sampler's, the graphs'), so
that its own process compiles none, and gives the same tokens as one started on the cache that
start filled, which compiles nothing ahead and nothing at all."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from gpu_support import CUDA, LLM_DEFAULTS, random_prompts, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


@triton.jit
def _fill_kernel(out_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    tl.static_assert(VALUE < 100, "VALUE must stay under 100")
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full((BLOCK,), VALUE, tl.float32), mask=offs < n)


def test_launches_inside_note_their_variants_and_do_not_run_then_load_them_compiled(caplog, monkeypatch, tmp_path):
    """Inside the block nothing runs; on leaving it the pool compiles each variant once (two
    launches repeat one), with its launcher; after it, each real launch loads its variant and its
    launcher from Triton's cache instead of building them, and runs it."""
    import triton.runtime.build as build

    from pagoda_engine.worker.compile_ahead import compile_ahead, stop_compile_pool

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # nothing built before
    out = torch.full((3, 1000), -1.0, device=CUDA)
    try:
        with caplog.at_level(logging.INFO), compile_ahead(torch.device(CUDA), "the test", workers=2) as ahead:
            assert ahead
            for i, value in enumerate((11, 12, 13, 11, 12)):
                _fill_kernel[(4,)](out[i % 3], 1000, VALUE=value, BLOCK=256)
            torch.cuda.synchronize()
            assert bool((out == -1).all()), "a kernel ran inside the block"
    finally:
        stop_compile_pool()
    assert "compiled 3 Triton kernel variant(s) ahead of the test" in caplog.text
    hits, built = [], []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    build_module = build._build
    monkeypatch.setattr(build, "_build", lambda name, *a, **kw: built.append(name) or build_module(name, *a, **kw))
    for i, value in enumerate((11, 12, 13)):
        _fill_kernel[(4,)](out[i], 1000, VALUE=value, BLOCK=256)
    torch.cuda.synchronize()
    assert hits == [True, True, True], "a real launch compiled its variant again"
    assert built == [], "a real launch built its launcher (a C module) again"
    assert torch.equal(out, torch.tensor([11.0, 12.0, 13.0], device=CUDA)[:, None].expand(3, 1000))


def test_a_failed_compile_is_raised_by_the_real_launch():
    from pagoda_engine.worker.compile_ahead import compile_ahead, stop_compile_pool

    out = torch.zeros(256, device=CUDA)
    try:
        with compile_ahead(torch.device(CUDA), "the test", workers=1):
            _fill_kernel[(1,)](out, 256, VALUE=500, BLOCK=256)  # fails its static assert: no error here
    finally:
        stop_compile_pool()
    with pytest.raises(Exception, match="VALUE must stay under 100"):
        _fill_kernel[(1,)](out, 256, VALUE=500, BLOCK=256)


_START_AND_GENERATE = """
import json, sys
import triton
import triton.runtime.build as build
from pagoda_engine import LLM, SamplingParams
compiled, built, build_module = [], [], build._build
triton.knobs.compilation.listener = lambda **kw: kw["cache_hit"] or compiled.append(kw["src"].fn.__name__)
build._build = lambda name, *a, **kw: built.append(name) or build_module(name, *a, **kw)
llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))
started = {"compiled": list(compiled), "built": list(built)}
outputs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
print(json.dumps({"compile_ahead": llm.core.executor.compile_ahead, "decode_replays": llm.core.executor.graphs.replays,
                  "tokens": [o.outputs[0].token_ids for o in outputs], "start": started,
                  "served": {"compiled": compiled[len(started["compiled"]):], "built": built[len(started["built"]):]}}))
"""


def _start_and_generate(model_dir, cache_dir, prompts) -> dict:
    """A fresh process's engine with Triton's cache in `cache_dir`: what it decided, and its greedy tokens."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache_dir)}
    done = subprocess.run([sys.executable, "-c", _START_AND_GENERATE, str(model_dir), json.dumps(LLM_DEFAULTS),
                           json.dumps(prompts)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_engine_on_an_empty_cache_compiles_ahead_and_gives_the_tokens_of_a_warm_start(gpu_model_dir, tmp_path):
    prompts = random_prompts(5, [3, 17, 40, 64, 101])
    fresh = _start_and_generate(gpu_model_dir, tmp_path / "triton-cache", prompts)
    assert fresh["compile_ahead"] is True
    assert any((tmp_path / "triton-cache").iterdir()), "the first start left Triton's cache empty"
    print("fresh start, compiled or built in the engine's own process:", fresh["start"], "serving:", fresh["served"])
    warm = _start_and_generate(gpu_model_dir, tmp_path / "triton-cache", prompts)
    assert warm["compile_ahead"] is False
    assert fresh["decode_replays"] > 0 and warm["decode_replays"] > 0
    assert fresh["tokens"] == warm["tokens"]
    assert warm["start"] == warm["served"] == {"compiled": [], "built": []}, warm
    # Everything the fresh start compiled went through the pool; only Triton's driver module may
    # be built here, when the engine's first launch comes before the pool's processes built it.
    assert fresh["start"]["compiled"] == [] and set(fresh["start"]["built"]) <= {"cuda_utils"}, fresh["start"]

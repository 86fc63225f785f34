"""A throughput run's floor (`bench.floor`): the model's costs add up to its weights, each step's
bytes and work are what its rows need, and the recorder sees exactly the steps the engine ran."""

from __future__ import annotations

import pytest
import torch

from pagoda_engine.bench.floor import (
    ModelCosts,
    StepRecorder,
    StepShape,
    expected_experts,
    model_costs,
    run_floor,
    step_bytes,
    step_flops,
)
from pagoda_engine.bench.offline import weight_bytes


def _load(tmp_path, arch: str):
    from pagoda_engine.tiny import build_tiny_model
    from pagoda_engine.worker.model.loader import load_hf_config, load_model

    model_dir = build_tiny_model(tmp_path / arch, arch=arch)
    return load_model(str(model_dir), load_hf_config(str(model_dir)), torch.float32, torch.device("cpu"),
                      load_format="dummy")


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def test_expected_experts_under_uniform_routing():
    assert expected_experts(128, 8, 0) == 0
    assert expected_experts(128, 8, 1) == pytest.approx(8)  # one token: its own k experts
    assert expected_experts(128, 8, 2) == pytest.approx(8 + 8 * 120 / 128)  # the second's new ones
    assert 127.9 < expected_experts(128, 8, 256) < 128


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_model_costs_account_for_every_weight_once(tmp_path, arch):
    model = _load(tmp_path, arch)
    c = model_costs(model, num_layers=2, num_qo_heads=4, head_dim=16, kv_bytes_per_token=256)
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    untied = embed.data_ptr() != lm_head.data_ptr()
    experts = c.moe_layers * c.num_experts
    assert c.dense_bytes + untied * embed.nbytes + experts * c.expert_bytes == weight_bytes(model)
    assert c.dense_params_per_token + lm_head.numel() + untied * embed.numel() + experts * c.expert_params == _numel(model)
    assert c.embed_row_bytes == embed.shape[1] * embed.element_size()
    assert c.attn_flops_per_pair == 4 * 2 * 4 * 16
    if arch == "qwen3_moe":
        moe = model.model.layers[0].mlp
        assert (c.moe_layers, c.num_experts, c.top_k) == (len(model.model.layers), moe.num_experts, moe.top_k)
        assert c.expert_params * moe.num_experts == moe.experts.w13.numel() + moe.experts.w2.numel()
    else:
        assert c.moe_layers == c.expert_bytes == 0


COSTS = ModelCosts(dense_bytes=1000, embed_row_bytes=10, lm_head_params=50, dense_params_per_token=200,
                   moe_layers=2, num_experts=4, top_k=2, expert_bytes=100, expert_params=40,
                   kv_bytes_per_token=8, attn_flops_per_pair=3)


def test_a_decode_step_reads_weights_experts_and_context():
    step = StepShape([(9, 1, True), (4, 1, True)])  # two decodes, over 9 and 4 computed tokens
    experts = 2 * expected_experts(4, 2, 2) * 100
    assert step_bytes(COSTS, step) == pytest.approx(1000 + 2 * 10 + experts + (10 + 5) * 8)
    # Weights: 2 tokens x (200 dense + 2 layers x 2 experts x 40) + 2 samples x 50, twice; attention: 10 + 5 pairs.
    assert step_flops(COSTS, step) == 2 * (2 * (200 + 2 * 2 * 40) + 2 * 50) + (10 + 5) * 3


def test_a_prompt_chunk_attends_causally_and_samples_only_at_its_end():
    chunk = StepShape([(16, 4, False)])  # 4 new tokens after 16: 17 + 18 + 19 + 20 pairs, no sample
    assert step_flops(COSTS, chunk) == 2 * 4 * (200 + 2 * 2 * 40) + (17 + 18 + 19 + 20) * 3
    last = StepShape([(16, 4, True)])
    assert step_flops(COSTS, last) - step_flops(COSTS, chunk) == 2 * 50


def test_run_floor_takes_each_steps_bound():
    steps = [StepShape([(0, 1, True)]), StepShape([(0, 400, True)])]
    slow_memory = run_floor(COSTS, steps, bandwidth_Bps=1.0, flops_per_s=1e12)
    assert slow_memory["floor_s"] == pytest.approx(sum(step_bytes(COSTS, s) for s in steps))
    assert slow_memory["memory_bound_s"] == slow_memory["floor_s"] and slow_memory["steps"] == 2
    slow_math = run_floor(COSTS, steps, bandwidth_Bps=1e12, flops_per_s=1.0)
    assert slow_math["floor_s"] == pytest.approx(sum(step_flops(COSTS, s) for s in steps))
    assert slow_math["memory_bound_s"] == 0


def test_recorder_sees_every_token_the_engine_computed():
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core.engine_core import EngineCore
    from pagoda_engine.messages import EngineCoreRequest
    from pagoda_engine.sampling_params import SamplingParams
    from pagoda_engine.tiny import default_model_dir

    core = EngineCore(EngineConfig.from_kwargs(model=str(default_model_dir()), dtype="float32", device="cpu",
                                               max_num_batched_tokens=32, num_kv_pages=64))
    scheduler_class_schedule = type(core.scheduler).schedule
    recorder = StepRecorder(core.scheduler)
    # No prefix in common: every prompt token is computed.
    prompts, outputs = [[3 + i] + list(range(100, 100 + n)) for i, n in enumerate((5, 40, 70))], [4, 6, 3]
    for i, (prompt, n) in enumerate(zip(prompts, outputs)):
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt,
                                           sampling_params=SamplingParams(max_tokens=n, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    recorder.remove()
    rows = [row for step in recorder.steps for row in step.rows]
    # Every prompt token and every output token but the last went in; each output was sampled once.
    assert sum(n for _, n, _ in rows) == sum(map(len, prompts)) + sum(outputs) - len(outputs)
    assert sum(s for _, _, s in rows) == sum(outputs)
    assert max(step.num_tokens for step in recorder.steps) <= 32  # the 70-token prompt went in chunks
    assert any(before > 0 and n > 1 for before, n, _ in rows)  # a later chunk, over the earlier ones
    assert core.scheduler.schedule.__func__ is scheduler_class_schedule  # removed


def test_throughput_bench_reports_the_floor_of_its_own_steps(monkeypatch):
    """The CUDA-only part, on CPU with the device's two rates given: the floor of the steps the
    run made, and the run's time against it."""
    from pagoda_engine.bench import floor as floor_module
    from pagoda_engine.bench import offline
    from pagoda_engine.config import EngineConfig
    from pagoda_engine.core.engine_core import EngineCore
    from pagoda_engine.tiny import default_model_dir

    monkeypatch.setattr(offline, "measure_matmul_flops", lambda device, dtype: 1e9)
    core = EngineCore(EngineConfig.from_kwargs(model=str(default_model_dir()), dtype="float32", device="cpu",
                                               num_kv_pages=64))
    steps = [StepShape([(0, 20, True)]), StepShape([(20, 1, True)])]
    result = offline._workload_floor(core, steps, bandwidth=1e9, elapsed_s=2.0, output_tokens=2)
    spec = core.executor.model.kv_cache_spec(core.config.cache.block_size, core.dtype)
    costs = floor_module.model_costs(core.executor.model, spec.num_layers, spec.num_qo_heads, spec.head_dim,
                                     spec.bytes_per_page() // spec.page_size)
    want = run_floor(costs, steps, 1e9, 1e9)["floor_s"]
    assert result["floor_s"] == pytest.approx(want, abs=1e-6) and result["steps"] == 2
    assert result["of_floor"] == pytest.approx(2.0 / want, rel=1e-3)
    assert result["output_tokens_per_s"] == pytest.approx(2 / want, rel=1e-3)
    assert offline._workload_floor(core, steps, bandwidth=None, elapsed_s=2.0, output_tokens=2) is None  # no CUDA

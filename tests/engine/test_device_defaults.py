"""`config.resolve_for_device`: the defaults that depend on rank 0's device, resolved once from the
facts the executor reports (`DeviceFacts`), into a copy of the config, before the engine core
starts. A pure function: tested here with facts of devices this machine does not have."""

import argparse

import pytest

from pagoda_engine.config import EngineConfig, add_engine_args, config_from_args, resolve_for_device
from pagoda_engine.errors import ModelLoadError
from pagoda_engine.executor_types import DeviceFacts

H200 = DeviceFacts(device="cuda", kind="cuda", steps_run_ahead=True, first_steps_pay_once=True,
                   total_memory=140 << 30, name="NVIDIA H200", collectives="nccl", graph_attention=True)
CPU = DeviceFacts(device="cpu", kind="cpu", steps_run_ahead=False, first_steps_pay_once=False)


def serve(*flags: str) -> EngineConfig:
    """The config `pagoda serve` builds from these flags (its defaults leave the device's to the core)."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return config_from_args(parser.parse_args(["--model", "m", *flags]))


def test_a_gpu_server_gets_async_scheduling_pacing_vllms_batch_cap_and_both_graph_kinds():
    config = serve()
    resolved = resolve_for_device(config, H200)
    sc = resolved.scheduler
    assert (sc.async_scheduling, sc.step_launch_pacing, sc.max_num_seqs) == (True, True, 1024)
    assert resolved.model.cudagraph_mode == "FULL_AND_PIECEWISE" and resolved.model.device == "cuda"
    # The caller's config is left as it was built.
    assert (config.scheduler.async_scheduling, config.scheduler.step_launch_pacing, config.scheduler.max_num_seqs,
            config.model.cudagraph_mode, config.model.device) == (None, None, None, None, "auto")


def test_a_cpu_server_runs_steps_synchronously_and_eagerly():
    resolved = resolve_for_device(serve(), CPU)
    sc = resolved.scheduler
    assert (sc.async_scheduling, sc.step_launch_pacing, sc.max_num_seqs) == (False, False, 256)
    assert resolved.model.cudagraph_mode == "NONE" and resolved.model.device == "cpu"


def test_explicit_settings_are_kept():
    resolved = resolve_for_device(serve("--no-async-scheduling", "--max-num-seqs", "7", "--cudagraph-mode",
                                        "FULL_DECODE_ONLY"), H200)
    assert (resolved.scheduler.async_scheduling, resolved.scheduler.step_launch_pacing) == (False, False)
    assert resolved.scheduler.max_num_seqs == 7 and resolved.model.cudagraph_mode == "FULL_DECODE_ONLY"


@pytest.mark.parametrize("flags", [["-pp", "2"], ["-dp", "2", "--enable-expert-parallel"]])
def test_pacing_is_not_a_default_where_it_does_not_apply(flags):
    assert resolve_for_device(serve(*flags), H200).scheduler.step_launch_pacing is False


def test_pacing_asked_for_where_steps_do_not_run_ahead_is_refused():
    with pytest.raises(ModelLoadError, match="--step-launch-pacing times steps running on a GPU; on cpu"):
        resolve_for_device(serve("--step-launch-pacing"), CPU)


@pytest.mark.parametrize("flags, facts, why", [
    (["--enforce-eager"], H200, "enforce-eager"),
    (["--attention-backend", "torch"], H200, "a backend without graphs"),
    ([], DeviceFacts(**{**H200.__dict__, "graph_attention": False}), "auto finds no FlashInfer"),
    (["-dp", "2", "--enable-expert-parallel", "-pp", "2"], H200, "experts across cores with pipelines"),
    (["-dp", "2", "--enable-expert-parallel"], DeviceFacts(**{**H200.__dict__, "collectives": "gloo"}),
     "experts across cores over gloo"),
    (["-tp", "2"], DeviceFacts(**{**H200.__dict__, "collectives": "gloo"}), "tensor parallelism over gloo"),
])
def test_cuda_graphs_are_off_where_they_cannot_run(flags, facts, why):
    assert resolve_for_device(serve(*flags), facts).model.cudagraph_mode == "NONE", why


def test_experts_across_cores_replay_decode_graphs_of_padded_steps_when_asked():
    """Every core pads its decode steps to a size all of them replay (`worker/dp_padding.py`);
    other steps run eagerly, so the piecewise graphs are not captured. Asked for: by default these
    cores run eagerly until the padded graphs are measured on GPUs."""
    assert resolve_for_device(serve("-dp", "2", "--enable-expert-parallel"), H200).model.cudagraph_mode == "NONE"
    for mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):
        resolved = resolve_for_device(serve("-dp", "2", "--enable-expert-parallel", "--cudagraph-mode", mode), H200)
        assert resolved.model.cudagraph_mode == "FULL_DECODE_ONLY"
    eager = resolve_for_device(serve("-dp", "2", "--enable-expert-parallel", "--enforce-eager",
                                     "--cudagraph-mode", "FULL_DECODE_ONLY"), H200)
    assert eager.model.cudagraph_mode == "NONE"


def test_tensor_parallelism_over_nccl_keeps_its_graphs():
    assert resolve_for_device(serve("-tp", "2"), H200).model.cudagraph_mode == "FULL_AND_PIECEWISE"

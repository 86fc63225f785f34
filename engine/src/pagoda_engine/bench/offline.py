"""Drives a workload through an in-process `EngineCore` and measures it.

Owns the timing (throughput: wall time from the first request added to the last token; latency:
time to first token and end-to-end time of one stream), the roofline (weight bytes ÷ a measured
device-to-device copy bandwidth), the start-to-ready time, and the result: figures (`report`),
settings, GPU and versions, printed and returned as a dict.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time

import torch

from pagoda_engine.bench.lora import RandomAdapters
from pagoda_engine.bench.floor import StepRecorder, model_costs, run_floor, unique_parameters
from pagoda_engine.bench.report import (environment, is_standard_workload, latency_summary, mean_tpot_of_complete_run,
                                        process_age_s, throughput_summary)
from pagoda_engine.bench.workloads import Workload, build_workload
from pagoda_engine.config import config_from_args
from pagoda_engine.core.engine_core import EngineCore
from pagoda_engine.messages import EngineCoreRequest
from pagoda_engine.processes import freeze_gc_heap
from pagoda_engine.sampling_params import SamplingParams


def _device_seconds(fn, iters: int, warmup: int = 3) -> float:
    """Seconds `iters` calls of `fn` take on the current CUDA device, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float | None:
    """Device memory bandwidth in bytes/s from a large device-to-device copy (bytes read + written)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _device_seconds(lambda: dst.copy_(src), iters)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16, iters: int = 20,
                         n: int = 8192) -> float | None:
    """The device's matmul rate (FLOP/s) on a large square product; None off CUDA."""
    if device.type != "cuda":
        return None
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = _device_seconds(lambda: a @ b, iters)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 * iters / seconds


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in unique_parameters(model))  # tied weights once


def fp8_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the FP8 projection weights (`--quantization fp8`), their scales not counted."""
    return sum(p.nbytes for p in unique_parameters(model) if p.dtype == torch.float8_e4m3fn)


def bytes_read_per_token(model: torch.nn.Module) -> int:
    """What one decoded token reads of the weights: every projection, norm and router, of an MoE
    model's experts only top_k a layer, one embedding row and the LM head (the FP8 roofline of
    issue 47: FP8 projections plus the bf16 LM head)."""
    from pagoda_engine.worker.model.moe import FusedMoE

    moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    total = weight_bytes(model)
    for layer in moe_layers:
        experts = layer.experts.w13.nbytes + layer.experts.w2.nbytes
        total -= experts - experts * layer.top_k // layer.num_experts
    embed = model.model.embed_tokens.weight
    if embed.data_ptr() != model.lm_head.weight.data_ptr():  # tied: the LM head reads all rows anyway
        total -= embed.nbytes - embed.nbytes // embed.shape[0]
    return total


def _build(args) -> tuple[EngineCore, dict]:
    t0 = time.monotonic()
    config = config_from_args(args)
    if config.scheduler.step_launch_pacing is None:  # no core loop, no arrivals to pace for: all requests come first
        config.scheduler.step_launch_pacing = False
    core = EngineCore(config)
    init_s = time.monotonic() - t0
    age = process_age_s()
    sc, cc, mc = core.config.scheduler, core.config.cache, core.config.model
    settings = {
        "model": mc.model, "load_format": mc.load_format, "dtype": str(core.dtype).removeprefix("torch."),
        "quantization": mc.quantization or "none", "kv_cache_dtype": cc.kv_cache_dtype,
        "device": str(core.device), "attention_backend": core.executor.attn.name, "cuda_graphs": core.cuda_graphs,
        "cudagraph_mode": core.cudagraph_mode,
        "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
        "async_scheduling": sc.async_scheduling,
        "max_model_len": core.max_model_len, "block_size": cc.block_size,
        "gpu_memory_utilization": cc.gpu_memory_utilization, "enable_prefix_caching": cc.enable_prefix_caching,
        "kv_capacity_tokens": core.kv_capacity_tokens,
    }
    startup = {"engine_init_s": round(init_s, 2), "start_to_ready_s": round(age, 2) if age is not None else None}
    return core, {"settings": settings, "startup": startup}


def _warm_up(core: EngineCore) -> None:
    """A few short requests, so one-time costs (kernel loads, cuBLAS heuristics) stay out of the timing."""
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    for i in range(4):
        core.add_request(EngineCoreRequest(request_id=f"warmup-{i}", prompt_token_ids=list(range(1, 65 + i)),
                                           sampling_params=params))
    while core.has_unfinished_requests():
        core.step()
    if core.device.type == "cuda":
        torch.cuda.synchronize()


class _StepProfiler:
    """torch.profiler over steps [first, first + count) of a run, then its summary (`profile_summary`)."""

    def __init__(self, out_dir: str | None, first: int, count: int):
        self.out_dir, self.first, self.last = out_dir, first, first + count
        self.prof = None

    def before(self, step: int) -> None:
        if self.out_dir and step == self.first:
            from torch.profiler import profile

            from pagoda_engine.worker.profiler import profiler_activities

            self.prof = profile(activities=profiler_activities(torch.device("cuda" if torch.cuda.is_available()
                                                                            else "cpu")))
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def after(self, step: int) -> None:
        if self.prof is not None and step == self.last - 1:
            self.finish()

    def finish(self) -> None:
        if self.prof is None:
            return
        from pagoda_engine.worker.profiler import profile_summary

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        os.makedirs(self.out_dir, exist_ok=True)
        self.prof.export_chrome_trace(os.path.join(self.out_dir, "trace.json"))
        print(profile_summary(self.prof, wall_s, torch.cuda.is_available(), f"steps {self.first}..{self.last - 1}"))
        self.prof = None


def _drive(core: EngineCore, wl: Workload, tag: str, profiler: _StepProfiler | None = None,
           adapters: RandomAdapters | None = None) -> dict:
    """Add every request, step until all finish. Returns timing per request and overall.
    `adapters`: each request runs on a random one of them (--num-loras)."""
    start = time.perf_counter()
    ids = [f"{tag}-{i}" for i in range(wl.num_requests)]
    for i, (rid, prompt) in enumerate(zip(ids, wl.prompts)):
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                                           sampling_params=wl.sampling_params(i),
                                           lora_request=adapters.draw() if adapters is not None else None))
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    num_out: dict[str, int] = dict.fromkeys(ids, 0)
    step = 0
    while core.has_unfinished_requests():
        if profiler:
            profiler.before(step)
        out = core.step()
        if profiler:
            profiler.after(step)
        now = time.perf_counter()
        for o in out.outputs:
            num_out[o.request_id] += len(o.new_token_ids)
            first_token.setdefault(o.request_id, now)
            if o.finish_reason is not None:
                finished[o.request_id] = now
        step += 1
    if profiler:
        profiler.finish()
    if core.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "steps": step, "start": start, "first_token": first_token, "finished": finished,
            "mean_tpot_s": mean_tpot_of_complete_run(wl, num_out, first_token, finished),
            "num_preemptions": core.scheduler.num_preemptions}


def _roofline(core: EngineCore) -> dict:
    wbytes = bytes_read_per_token(core.executor.model)
    bw = measure_copy_bandwidth(core.device)
    return {"weight_bytes": weight_bytes(core.executor.model), "bytes_read_per_token": wbytes,
            "fp8_weight_bytes": fp8_weight_bytes(core.executor.model), "copy_bandwidth_Bps": bw,
            "roofline_ms_per_token": wbytes / bw * 1e3 if bw else None}


def _print_header(title: str, wl: Workload, info: dict, env: dict) -> None:
    print(f"=== pagoda bench {title}: workload {wl.name} ({wl.description}) ===")
    if "bench" in sys.argv:
        print("command: pagoda " + " ".join(sys.argv[sys.argv.index("bench"):]))
    else:
        print(f"command: pagoda bench {title} (called in-process; settings below)")
    print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
    print("settings: " + ", ".join(f"{k}={v}" for k, v in info["settings"].items()))
    s = info["startup"]
    print(f"start to ready: {s['start_to_ready_s']} s since process start (engine init {s['engine_init_s']} s)")


def _print_roofline(r: dict) -> None:
    if r["copy_bandwidth_Bps"]:
        fp8 = f", {r['fp8_weight_bytes'] / 1e9:.2f} GB of them FP8 projections" if r["fp8_weight_bytes"] else ""
        print(f"roofline: {r['bytes_read_per_token'] / 1e9:.2f} GB of weights read per token "
              f"(of {r['weight_bytes'] / 1e9:.2f} GB{fp8}) / {r['copy_bandwidth_Bps'] / 1e12:.2f} TB/s "
              f"measured copy = {r['roofline_ms_per_token']:.2f} ms per token (single-stream floor)")


@contextlib.contextmanager
def _heap_frozen():
    """The timed runs with every object alive before them out of the collector's reach, as an engine
    core process keeps its start-up heap (`processes.freeze_gc_heap`); given back after. A full
    collection otherwise walks torch's and transformers' objects in this process: 100-250 ms with
    the device idle (an N1 run on an H200, 2026-11-27). Worker ranks of a tensor- or
    pipeline-parallel run are not frozen."""
    freeze_gc_heap()
    try:
        yield
    finally:
        gc.unfreeze()


def _prepare(args, title: str) -> tuple[EngineCore, Workload, dict, dict, dict]:
    """Engine up, workload built, header printed, roofline measured, kernels warm (with
    --num-loras: the random adapters written, `info["adapters"]`, and every one loaded)."""
    core, info = _build(args)
    if getattr(args, "num_loras", 0):
        adapters = RandomAdapters(args, core.model_dir)
        for lora in adapters.requests:
            core.check_lora(lora)  # read and checked on every rank before the timing
        info["settings"].update(adapters.describe())
        info["adapters"] = adapters
    wl = build_workload(args.workload, core.vocab_size, args.num_prompts, args.input_len, args.output_len)
    env = environment()
    _print_header(title, wl, info, env)
    roof = _roofline(core)
    _warm_up(core)
    return core, wl, info, env, roof


def run_throughput(args) -> dict:
    if args.data_parallel_size > 1:
        from pagoda_engine.bench.data_parallel import run_data_parallel

        return run_data_parallel(args, "throughput")
    core, wl, info, env, roof = _prepare(args, "throughput")
    profiler = _StepProfiler(args.profile, *(args.profile_steps or (300, 10))) if args.profile else None
    recorder = StepRecorder(core.scheduler)
    adapters = info.pop("adapters", None)
    try:
        with _heap_frozen():
            r = _drive(core, wl, "bench", profiler, adapters)
    finally:
        recorder.remove()
    figures, lines = throughput_summary(wl, r["elapsed_s"], r["mean_tpot_s"])
    floor = _workload_floor(core, recorder.steps, roof["copy_bandwidth_Bps"], r["elapsed_s"], wl.num_output_tokens)
    result = {
        "bench": "throughput", "workload": wl.name, "standard_workload": is_standard_workload(args), "env": env, **info,
        **figures, "steps": r["steps"], "num_preemptions": r["num_preemptions"], "roofline": roof,
        "workload_floor": floor,
    }
    _add_speculative(core, result, lines)
    _print_roofline(roof)
    print(f"{wl.num_requests} requests in {r['elapsed_s']:.2f} s ({r['steps']} steps, "
          f"{r['num_preemptions']} preemptions)")
    print("\n".join(lines))
    if floor:
        print(f"workload floor: {floor['floor_s']:.2f} s ({floor['output_tokens_per_s']:,.1f} output tokens/s; "
              f"{floor['memory_bound_s']:.2f} s of it bound by bytes) at the measured "
              f"{floor['copy_bandwidth_Bps'] / 1e12:.2f} TB/s and {floor['matmul_flops'] / 1e12:.0f} TFLOP/s bf16 "
              f"matmul, over the run's own {floor['steps']} steps; this run took {floor['of_floor']:.3f} x the floor")
    return result


def _workload_floor(core: EngineCore, steps: list, bandwidth: float | None, elapsed_s: float,
                    output_tokens: int) -> dict | None:
    """The run's floor (`bench.floor`) on this device; None off CUDA or across several ranks
    (the model here is one rank's share)."""
    if bandwidth is None or core.config.parallel.world_size > 1:
        return None
    flops = measure_matmul_flops(core.device, core.dtype)
    if flops is None:
        return None
    spec = core.executor.kv_cache_spec(core.config.cache.block_size)
    costs = model_costs(core.executor.model, spec.num_layers, spec.num_qo_heads, spec.head_dim,
                        spec.bytes_per_page() // spec.page_size)
    floor = run_floor(costs, steps, bandwidth, flops)
    return {**{k: round(v, 6) if isinstance(v, float) else v for k, v in floor.items()},
            "copy_bandwidth_Bps": bandwidth, "matmul_flops": flops,
            "output_tokens_per_s": round(output_tokens / floor["floor_s"], 1),
            "of_floor": round(elapsed_s / floor["floor_s"], 4)}


def run_latency(args) -> dict:
    if args.num_iters < 1:
        raise SystemExit("error: --num-iters must be >= 1")
    if args.data_parallel_size > 1:
        from pagoda_engine.bench.data_parallel import run_data_parallel

        return run_data_parallel(args, "latency")
    core, wl, info, env, roof = _prepare(args, "latency")
    adapters = info.pop("adapters", None)
    if args.spec_replay_acceptance is not None:
        if adapters is not None:
            raise SystemExit("error: --spec-replay-acceptance and --num-loras do not combine")
        from pagoda_engine.bench.spec_replay import parse_ks, parse_shares, run_spec_replay

        replay = run_spec_replay(core, wl, _drive, args.num_iters, parse_shares(args.spec_replay_acceptance),
                                 parse_ks(args.spec_replay_k))
        return {"bench": "latency-spec-replay", "workload": wl.name, "standard_workload": is_standard_workload(args),
                "env": env, **info, **replay, "roofline": roof}
    _drive(core, wl, "warmup-run", adapters=adapters)
    runs = []
    with _heap_frozen():
        for it in range(args.num_iters):
            profiler = (_StepProfiler(args.profile, *(args.profile_steps or (100, 20)))
                        if args.profile and it == 0 else None)
            r = _drive(core, wl, f"iter{it}", profiler, adapters)
            ttft = statistics.fmean(r["first_token"][k] - r["start"] for k in r["first_token"])
            runs.append({"e2e_s": r["elapsed_s"], "ttft_s": ttft, "tpot_s": r["mean_tpot_s"]})
    out_len = wl.output_lens[0]
    figures, lines = latency_summary(runs, out_len, roof["roofline_ms_per_token"])
    result = {
        "bench": "latency", "workload": wl.name, "standard_workload": is_standard_workload(args), "env": env, **info,
        **figures, "roofline": roof,
    }
    _add_speculative(core, result, lines)
    _print_roofline(roof)
    print("\n".join(lines))
    return result


def _add_speculative(core: EngineCore, result: dict, lines: list[str]) -> None:
    """--speculative-config: what the drafts kept over every run (warm-up included), into the
    result and the printed lines."""
    spec = core.scheduler.spec
    if spec is None:
        return
    st = spec.stats
    disable = spec.config.disable_by_batch_size
    result["speculative"] = {"method": spec.config.method, "num_speculative_tokens": spec.k,
                             "disable_by_batch_size": disable, "num_drafts": st.num_drafts,
                             "num_draft_tokens": st.num_draft_tokens, "num_accepted_tokens": st.num_accepted_tokens,
                             "mean_acceptance_length": round(1 + st.num_accepted_tokens / max(st.num_drafts, 1), 3)}
    off = f", off above {disable} running requests" if disable is not None else ""
    lines.append(f"speculative decoding ({spec.config.method}, k = {spec.k}{off}): {st.num_drafts} drafts, mean "
                 f"acceptance length {result['speculative']['mean_acceptance_length']}")

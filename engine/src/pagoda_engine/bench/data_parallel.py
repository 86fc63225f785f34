"""`pagoda bench throughput|latency --data-parallel-size N`: the offline workloads through N
data-parallel engine cores, each in its own process (on CUDA, core i on devices [i × TP, (i + 1) × TP)).

The cores cannot live in this process as the one-core benchmark's does, so this one drives them as
the API server does, through `DPEngineCoreClient` over the cores' ZMQ sockets, without HTTP, the
tokenizer or detokenization: every request goes to the least-loaded core as it is added (all at
once, so they spread evenly), and the clock runs from the first request sent to the last token
received. With `--enable-expert-parallel` and an MoE model the cores step in lockstep (a core with
no work runs dummy batches), which is what makes a lone stream's latency worth measuring here.

What the one-core benchmark prints that this one cannot: the roofline (the weights are in the
cores' processes) and the profile (`--profile` is refused; `pagoda serve --profiler-config` profiles
every core).
"""

from __future__ import annotations

import asyncio
import statistics
import time

from pagoda_engine.api.server.dp_client import DPEngineCoreClient
from pagoda_engine.bench.report import (environment, is_standard_workload, latency_summary, mean_tpot_of_complete_run,
                                        process_age_s, throughput_summary)
from pagoda_engine.bench.workloads import Workload, build_workload
from pagoda_engine.config import EngineConfig, config_from_args
from pagoda_engine.messages import CoreReady, EngineCoreError, EngineCoreOutputs, EngineCoreRequest
from pagoda_engine.sampling_params import SamplingParams


class _Run:
    """One batch of requests in flight across the cores: when each produced its first and last token."""

    def __init__(self, ids: list[str]):
        self.pending = set(ids)
        self.num_out = dict.fromkeys(ids, 0)
        self.first_token: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.rank_of: dict[str, int] = {}
        self.done = asyncio.Event()
        if not ids:
            self.done.set()


class DataParallelDriver:
    """The pod's cores, started from this process, and the requests of one run at a time."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.size = config.parallel.data_parallel_size
        self.failure: str | None = None
        self.run: _Run | None = None
        self.steps = [0] * self.size  # this run's output messages per core: one per step that produced any
        self.client = DPEngineCoreClient(config, on_outputs=self._on_outputs, on_refused=self._on_refused,
                                         on_dead=self._on_dead)

    async def start(self) -> CoreReady:
        return await self.client.start()

    async def shutdown(self) -> None:
        await self.client.shutdown()

    # --- callbacks ------------------------------------------------------------------------------
    def _on_outputs(self, rank: int, outputs: EngineCoreOutputs) -> None:
        run = self.run
        if run is None or not outputs.outputs:
            return
        self.steps[rank] += 1
        now = time.perf_counter()
        for o in outputs.outputs:
            if o.request_id not in run.num_out:
                continue
            run.num_out[o.request_id] += len(o.new_token_ids)
            run.first_token.setdefault(o.request_id, now)
            if o.finish_reason is not None:
                run.finished[o.request_id] = now
                run.pending.discard(o.request_id)
        if not run.pending:
            run.done.set()

    def _on_refused(self, err: EngineCoreError) -> None:
        self._fail(f"the engine core refused request {err.request_id}: {err.message}")

    def _on_dead(self, reason: str) -> None:
        self._fail(f"engine dead: {reason}")

    def _fail(self, reason: str) -> None:
        self.failure = self.failure or reason
        if self.run is not None:
            self.run.done.set()

    # --- runs -----------------------------------------------------------------------------------
    async def drive(self, prompts: list[list[int]], params: list[SamplingParams], tag: str,
                    rank: int | None = None) -> tuple[_Run, float, float]:
        """Send every request (each to the least-loaded core, or all to `rank`) and wait for all of
        them to finish; the run, its start and its elapsed seconds."""
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        run = self.run = _Run(ids)
        self.steps = [0] * self.size
        start = time.perf_counter()
        for rid, prompt, sp in zip(ids, prompts, params):
            target = self.client.least_loaded() if rank is None else rank
            run.rank_of[rid] = target
            self.client.add_requests([EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                                                        arrival_time=time.time())], target)
        await run.done.wait()
        elapsed = time.perf_counter() - start
        self.run = None
        if self.failure:
            raise RuntimeError(self.failure)
        return run, start, elapsed

    async def warm_up(self) -> None:
        """A few short requests on every core, so one-time costs stay out of the timing."""
        params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
        for rank in range(self.size):
            await self.drive([list(range(1, 65 + i)) for i in range(4)], [params] * 4, f"warmup{rank}", rank=rank)


def _mean_tpot_s(wl: Workload, run: _Run) -> float | None:
    """The run's mean time per output token, once it is checked complete (`report.mean_tpot_of_complete_run`)."""
    return mean_tpot_of_complete_run(wl, run.num_out, run.first_token, run.finished)


def _settings(config: EngineConfig, ready: CoreReady) -> dict:
    sc, cc, mc, pc = config.scheduler, config.cache, config.model, config.parallel
    return {
        "model": mc.model, "load_format": mc.load_format, "dtype": mc.dtype,
        "data_parallel_size": pc.data_parallel_size, "tensor_parallel_size": pc.tensor_parallel_size,
        "enable_expert_parallel": pc.enable_expert_parallel, "all2all_backend": pc.all2all_backend,
        "enable_eplb": pc.enable_eplb, "enforce_eager": mc.enforce_eager,
        "max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
        "max_model_len": ready.max_model_len, "block_size": ready.block_size,
        "gpu_memory_utilization": cc.gpu_memory_utilization, "enable_prefix_caching": cc.enable_prefix_caching,
        "kv_capacity_tokens_per_core": ready.kv_capacity_tokens,
    }


async def _run(args, title: str) -> dict:
    if args.profile:
        raise SystemExit("error: --profile needs the engine in this process (--data-parallel-size 1); "
                         "profile data-parallel cores with `pagoda serve --profiler-config`")
    config = config_from_args(args)
    driver = DataParallelDriver(config)
    t0 = time.monotonic()
    ready = await driver.start()
    try:
        init_s = time.monotonic() - t0
        age = process_age_s()
        info = {"settings": _settings(config, ready),
                "startup": {"engine_init_s": round(init_s, 2), "start_to_ready_s": round(age, 2) if age else None}}
        wl = build_workload(args.workload, ready.vocab_size, args.num_prompts, args.input_len, args.output_len)
        env = environment()
        print(f"=== pagoda bench {title}: workload {wl.name} ({wl.description}), "
              f"{driver.size} data-parallel engine cores ===")
        print("environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
        print("settings: " + ", ".join(f"{k}={v}" for k, v in info["settings"].items()))
        print(f"start to ready: {info['startup']['start_to_ready_s']} s since process start "
              f"(engine cores {info['startup']['engine_init_s']} s)")
        print("roofline: not measured (the weights are in the engine cores' processes)")
        await driver.warm_up()
        params = [wl.sampling_params(i) for i in range(wl.num_requests)]
        base = {"bench": title, "workload": wl.name, "standard_workload": is_standard_workload(args), "env": env,
                **info}
        if title == "throughput":
            return _throughput_result(wl, base, *await driver.drive(wl.prompts, params, "bench"), driver)
        return await _latency(wl, base, params, driver, args.num_iters)
    finally:
        await driver.shutdown()


def _throughput_result(wl: Workload, base: dict, run: _Run, start: float, elapsed: float,
                       driver: DataParallelDriver) -> dict:
    figures, lines = throughput_summary(wl, elapsed, _mean_tpot_s(wl, run))
    per_core = [sum(1 for r in run.rank_of.values() if r == rank) for rank in range(driver.size)]
    result = {**base, **figures, "requests_per_core": per_core, "steps_per_core": list(driver.steps)}
    print(f"{wl.num_requests} requests in {elapsed:.2f} s; per core: {per_core} requests")
    print("\n".join(lines))
    return result


async def _latency(wl: Workload, base: dict, params: list[SamplingParams], driver: DataParallelDriver,
                   num_iters: int) -> dict:
    await driver.drive(wl.prompts, params, "warmup-run")
    runs = []
    for it in range(num_iters):
        run, start, elapsed = await driver.drive(wl.prompts, params, f"iter{it}")
        tpot = _mean_tpot_s(wl, run)
        ttft = statistics.fmean(t - start for t in run.first_token.values())
        runs.append({"e2e_s": elapsed, "ttft_s": ttft, "tpot_s": tpot})
    figures, lines = latency_summary(runs, wl.output_lens[0])
    print("\n".join(lines))
    return {**base, **figures}


def run_data_parallel(args, title: str) -> dict:
    """`title`: "throughput" or "latency"."""
    return asyncio.run(_run(args, title))

"""What an offline benchmark reports, whichever way it drives the engine (one in-process core,
`offline`; data-parallel cores in their own processes, `data_parallel`): the environment (Python,
torch, CUDA, GPU, FlashInfer), the process's age for start-to-ready, the check that a run
produced all of its workload, and the throughput and latency figures with the lines that print
them.
"""

from __future__ import annotations

import os
import platform
import statistics

import torch

from pagoda_engine.bench.workloads import Workload


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), so start-to-ready includes the imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / (1 << 30), 1)
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        env["flashinfer"] = None
    return env


def mean_tpot_of_complete_run(wl: Workload, num_out: dict[str, int], first_token: dict[str, float],
                              finished: dict[str, float]) -> float | None:
    """The mean time per output token after each request's first, once the run is checked to have
    produced every token and finished every request of `wl` (RuntimeError otherwise). `num_out`:
    tokens per request; `first_token` and `finished`: when each got its first and its last."""
    produced = sum(num_out.values())
    if produced != wl.num_output_tokens or len(finished) != wl.num_requests:
        raise RuntimeError(f"workload {wl.name}: produced {produced} of {wl.num_output_tokens} output tokens, "
                           f"{len(finished)} of {wl.num_requests} requests finished")
    tpots = [(finished[r] - first_token[r]) / (n - 1) for r, n in num_out.items() if n > 1]
    return statistics.fmean(tpots) if tpots else None


def throughput_summary(wl: Workload, elapsed_s: float, mean_tpot_s: float | None) -> tuple[dict, list[str]]:
    """A throughput run's figures (the result's fields) and the lines that report them."""
    out_tps = wl.num_output_tokens / elapsed_s
    total_tps = (wl.num_output_tokens + wl.num_input_tokens) / elapsed_s
    fields = {
        "num_requests": wl.num_requests, "input_tokens": wl.num_input_tokens, "output_tokens": wl.num_output_tokens,
        "elapsed_s": round(elapsed_s, 6), "requests_per_s": round(wl.num_requests / elapsed_s, 3),
        "output_tokens_per_s": round(out_tps, 1), "total_tokens_per_s": round(total_tps, 1),
        "mean_time_per_output_token_ms": round(mean_tpot_s * 1e3, 3) if mean_tpot_s else None,
    }
    lines = [f"output tokens/s: {out_tps:,.1f}   total tokens/s: {total_tps:,.1f}   "
             f"requests/s: {fields['requests_per_s']}"]
    if mean_tpot_s:
        lines.append(f"mean time per output token (per request, after its first): {mean_tpot_s * 1e3:.2f} ms")
    return fields, lines


def latency_summary(runs: list[dict], out_len: int, roofline_ms_per_token: float | None = None
                    ) -> tuple[dict, list[str]]:
    """A latency benchmark's figures over its timed runs (each with e2e_s, ttft_s and tpot_s; the
    medians) and the lines that report them, against the roofline when it was measured;
    `out_len`: output tokens per run."""
    e2e = statistics.median(x["e2e_s"] for x in runs)
    tpot = statistics.median(x["tpot_s"] for x in runs)
    ttft = statistics.median(x["ttft_s"] for x in runs)
    fields = {"iterations": runs, "median_e2e_s": round(e2e, 4), "median_ttft_ms": round(ttft * 1e3, 2),
              "ms_per_output_token": round(e2e / out_len * 1e3, 3), "ms_per_decode_token": round(tpot * 1e3, 3)}
    lines = [f"end to end: {e2e:.3f} s for {out_len} output tokens (median of {len(runs)}); TTFT {ttft * 1e3:.1f} ms",
             f"time per output token: {e2e / out_len * 1e3:.3f} ms (end to end / output tokens); "
             f"decode only: {tpot * 1e3:.3f} ms"]
    if roofline_ms_per_token:
        lines.append(f"vs roofline: {e2e / out_len * 1e3 / roofline_ms_per_token:.3f} x")
    return fields, lines


def is_standard_workload(args) -> bool:
    """Whether the run is the workload as its table defines it (no --num-prompts, --input-len or
    --output-len given), which the result records so that runs compare like with like."""
    return args.num_prompts is None and args.input_len is None and args.output_len is None

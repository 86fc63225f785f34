"""torch.profiler on one rank: start, stop, write the trace and its summary.

Each rank of an engine core holds one `RankProfiler` (`Worker.start_profile`): CPU activity
always, CUDA activity when the rank is on a GPU. `stop()` writes `<name>.pt.trace.json.gz` (a
chrome trace, as vLLM names them; `.json` without gzip) and `<name>.summary.txt`:
`profile_summary`, also printed by `pagoda bench throughput|latency --profile`.
"""

from __future__ import annotations

import os
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pagoda_engine.profiler import ProfilerConfig


def profiler_activities(device: torch.device) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def profile_summary(prof: profile, wall_s: float, on_gpu: bool, what: str, row_limit: int = 30) -> str:
    """The wall time profiled, the kernels' sum (how busy the GPU was), and the key-averages tables:
    kernels and ops by their own device time (GPU; each kernel counted once) or ops by CPU time,
    then by self CPU time (the host's own work)."""
    events = prof.key_averages()
    wall_ms = wall_s * 1e3
    if on_gpu:
        # Only the device's own events: torch also charges a kernel's time to the op that launched
        # it and to the launch call, so a sum over every event counts it up to three times.
        kernel_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3
        head = (f"--- profiled {what}: wall {wall_ms:.1f} ms, GPU kernels {kernel_ms:.1f} ms "
                f"({100 * kernel_ms / max(wall_ms, 1e-9):.0f}% busy; the rest is host-side work the GPU waits for) ---")
    else:
        ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3
        head = (f"--- profiled {what}: wall {wall_ms:.1f} ms, no GPU (CPU activity only); torch ops' own CPU time "
                f"{ops_ms:.1f} ms ({100 * ops_ms / max(wall_ms, 1e-9):.0f}% of the wall) ---")
    sort = "self_device_time_total" if on_gpu else "cpu_time_total"
    return "\n".join([
        head,
        f"--- torch.profiler: {what} (top ops by {sort}) ---",
        events.table(sort_by=sort, row_limit=row_limit),
        f"--- torch.profiler: {what} (top ops by self CPU time: the host's work) ---",
        events.table(sort_by="self_cpu_time_total", row_limit=row_limit),
    ])


class RankProfiler:
    """One recording of this rank, from `start()` to `stop()`."""

    def __init__(self, config: ProfilerConfig, device: torch.device, name: str):
        self.config, self.device, self.name = config, device, name
        self._prof = profile(activities=profiler_activities(device),
                             record_shapes=config.torch_profiler_record_shapes,
                             profile_memory=config.torch_profiler_with_memory,
                             with_stack=config.torch_profiler_with_stack,
                             with_flops=config.torch_profiler_with_flops)
        self._t0 = 0.0

    def start(self) -> None:
        self._prof.start()
        self._t0 = time.perf_counter()

    def stop(self) -> list[str]:
        """Stop, write the trace (and the summary); the paths written."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_s = time.perf_counter() - self._t0
        self._prof.stop()
        out_dir = self.config.torch_profiler_dir
        os.makedirs(out_dir, exist_ok=True)
        suffix = ".pt.trace.json.gz" if self.config.torch_profiler_use_gzip else ".pt.trace.json"
        trace = os.path.join(out_dir, self.name + suffix)
        self._prof.export_chrome_trace(trace)  # torch gzips a path that ends in .gz
        written = [trace]
        if self.config.torch_profiler_dump_cuda_time_total:
            summary = os.path.join(out_dir, self.name + ".summary.txt")
            with open(summary, "w") as f:
                f.write(profile_summary(self._prof, wall_s, self.device.type == "cuda", self.name) + "\n")
            written.append(summary)
        return written

"""Programmatic dependent launch (PDL) of the engine's Triton kernels on Hopper and later GPUs.

A kernel launched this way may be placed on the SMs while the kernel before it in the stream is
still finishing. Its programs compute their offsets, then wait (`griddepcontrol.wait`: Triton's
`tl.extra.cuda.gdc_wait()`) until that kernel has ended and its writes are visible, then let the
kernel after them launch (`gdc_launch_dependents`: it may start once every program of this one
has passed that point, i.e. once the kernel before has ended). Nothing that another kernel writes
is read, and nothing is written, before the wait; the one-row projections (`gemv_triton`) load
weights before it, their first tile or, with the norm folded in, all their rows (weights are
written once, at load time). So the results are
the same bits, and what is saved is the launch gap between kernels, the start of each kernel's
programs during the last wave of the one before, and, where weights are loaded early, the first
loads' latency. CUDA graphs capture the launches with their programmatic edges, so the decode
graphs get it too. On an H200 it took a lone request's decode step (L1) from 4.030 to 3.926 ms at
Llama-3.1-8B and from 2.746 to 2.512 ms at Qwen3-30B-A3B (docs/benchmarks.md, 2026-11-27).

Each kernel that takes part has a `PDL: tl.constexpr` parameter that puts the wait in, and is
launched with `**launch(device)`, which sets it and Triton's `launch_pdl` together (a wait without
the launch attribute is a no-op; the attribute without the wait would be a race, so the two never
come apart). Off on GPUs before Hopper, on ROCm, with a Triton older than 3.4, and with PAGODA_PDL=0."""

from __future__ import annotations

import functools

import torch

from pagoda_engine import envs

_ON = {"PDL": True, "launch_pdl": True}
_OFF = {"PDL": False}


def launch(device: torch.device) -> dict:
    """The keywords that launch a kernel with a `PDL` parameter on `device`: with programmatic
    dependent launch where it is supported and not turned off, else without. Decided once per
    device and process (every eager step launches hundreds of kernels)."""
    return _keywords(device.type, device.index)


@functools.cache
def _keywords(device_type: str, device_index: int | None) -> dict:
    # ROCm builds of torch call their GPUs "cuda" too; PDL is NVIDIA's (Triton's `tl.extra.cuda`).
    if device_type != "cuda" or torch.version.hip is not None or not envs.programmatic_dependent_launch():
        return _OFF
    import triton

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    capable = torch.cuda.get_device_capability(device_index or 0)[0] >= 9
    return _ON if (major, minor) >= (3, 4) and capable else _OFF

"""Programmatic dependent launch (PDL) of the engine's Triton kernels on Hopper and later GPUs.

A kernel launched this way may be placed on the SMs while the kernel before it in the stream is
still finishing. Its programs compute their offsets, then wait (`griddepcontrol.wait`: Triton's
`tl.extra.cuda.gdc_wait()`) until that kernel has ended and its writes are visible. Nothing that
another kernel writes is read, and nothing is written, before the wait; a kernel that streams
weights may load its first weight tile before it (weights are written once, at load time). So the
results are the same bits, and what is saved is the launch gap between kernels and, where weights
are loaded early, the first loads' latency. CUDA graphs capture the launches with their
programmatic edges, so the decode graphs get it too.

Each kernel that takes part has a `PDL: tl.constexpr` parameter that puts the wait in, and is
launched with `**launch(device)`, which sets it and Triton's `launch_pdl` together (a wait without
the launch attribute is a no-op; the attribute without the wait would be a race, so the two never
come apart). Off on GPUs before Hopper, with a Triton older than 3.4, and with PAGODA_PDL=0."""

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
    if device_type != "cuda" or not envs.programmatic_dependent_launch():
        return _OFF
    import triton

    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    capable = torch.cuda.get_device_capability(device_index or 0)[0] >= 9
    return _ON if (major, minor) >= (3, 4) and capable else _OFF

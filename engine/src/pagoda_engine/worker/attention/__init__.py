"""Attention backends behind one interface (`base.AttentionBackend`) and the factory that picks one."""

from __future__ import annotations

import importlib.util

import torch

from pagoda_engine.worker.attention.base import AttentionBackend, AttentionBatch, KVCacheSpec

BACKENDS = ("auto", "flashinfer", "torch")


def _flashinfer_backend():
    from pagoda_engine.worker.attention.flashinfer import FlashInferBackend  # needs the flashinfer package and CUDA

    return FlashInferBackend


def flashinfer_available() -> bool:
    """Whether FlashInfer is installed ("auto" picks its backend on CUDA then): the one backend
    whose decode steps replay CUDA graphs (`plan_graph_decode`). Found without importing it, so
    that nothing touches a GPU before the executor has picked the process's device."""
    return importlib.util.find_spec("flashinfer") is not None


def get_attention_backend(name: str, spec: KVCacheSpec, num_pages: int, device: torch.device) -> AttentionBackend:
    """"torch": the reference backend (any device); "flashinfer": FlashInfer kernels (CUDA);
    "auto": FlashInfer on CUDA when it imports, else the reference."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    if name == "flashinfer" or (name == "auto" and device.type == "cuda"):
        try:
            cls = _flashinfer_backend()
        except ImportError as e:
            if name == "flashinfer":
                raise ImportError(f"attention backend 'flashinfer' is unavailable ({e}); "
                                  "install pagoda-engine[gpu] on a CUDA machine or use 'torch'") from e
        else:
            if device.type != "cuda":
                raise ValueError(f"attention backend 'flashinfer' needs a CUDA device, got {device}")
            return cls(spec, num_pages, device)
    from pagoda_engine.worker.attention.torch_ref import TorchRefBackend

    return TorchRefBackend(spec, num_pages, device)


__all__ = ["AttentionBackend", "AttentionBatch", "KVCacheSpec", "BACKENDS", "flashinfer_available",
           "get_attention_backend"]

"""Which launches use programmatic dependent launch (`worker/pdl.py`), decided without a GPU: never
off CUDA, never on ROCm (whose torch also says "cuda"), never with PAGODA_PDL=0, and on CUDA only
from Hopper on with a Triton that has it; the kernel's switch and the launch attribute always
together. The kernels themselves: tests/gpu/test_pdl_gpu.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from pagoda_engine.worker import pdl

ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device of a given capability and a Triton of a given version, as torch and Triton
    report them."""
    def make(capability=(9, 0), triton_version="3.6.0", hip=None):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__=triton_version))
        pdl._keywords.cache_clear()
    yield make
    pdl._keywords.cache_clear()


def test_on_for_hopper_with_a_recent_triton(fake_gpu, monkeypatch):
    monkeypatch.delenv("PAGODA_PDL", raising=False)
    fake_gpu((9, 0), "3.6.0")
    assert pdl.launch(torch.device("cuda", 0)) == ON
    assert pdl.launch(torch.device("cpu")) == OFF


@pytest.mark.parametrize("capability, version, hip", [((8, 0), "3.6.0", None), ((9, 0), "3.3.1", None),
                                                      ((9, 4), "3.6.0", "6.4")])
def test_off_before_hopper_with_an_old_triton_and_on_rocm(fake_gpu, monkeypatch, capability, version, hip):
    monkeypatch.delenv("PAGODA_PDL", raising=False)
    fake_gpu(capability, version, hip)
    assert pdl.launch(torch.device("cuda", 0)) == OFF


def test_pagoda_pdl_0_turns_it_off(fake_gpu, monkeypatch):
    monkeypatch.setenv("PAGODA_PDL", "0")
    fake_gpu((9, 0), "3.6.0")
    assert pdl.launch(torch.device("cuda", 0)) == OFF

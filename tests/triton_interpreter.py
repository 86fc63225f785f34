"""Import a module of Triton kernels so that its kernels run under Triton's CPU interpreter where
there is no GPU (on a GPU, compiled as usual). The interpreter switch is read when `triton.jit`
wraps a function, so only the module imported here is affected."""

from __future__ import annotations

import importlib
import os

import torch


def import_kernels(name: str):
    if torch.cuda.is_available():
        return importlib.import_module(name)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
        interpreted = any(type(v).__name__ == "InterpretedFunction" for v in vars(module).values())
        return module if interpreted else importlib.reload(module)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous

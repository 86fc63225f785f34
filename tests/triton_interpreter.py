"""Import a module of Triton kernels so that its kernels run under Triton's CPU interpreter where
there is no GPU (on a GPU, compiled as usual). The interpreter switch is read when `triton.jit`
wraps a function, so only the module imported here is affected."""

from __future__ import annotations

import importlib
import os

import torch


def _index_scalars_of_any_shape() -> None:
    """Triton's interpreter holds a scalar loaded from memory as a one-element array and turns it
    into a Python int (a loop bound, say) with `int(array)`, which numpy 2.4 refuses for arrays of
    one dimension; `item()` takes both."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "indexes_any_shape", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched.indexes_any_shape = True
    interpreter._patch_lang_tensor = patched


def import_kernels(name: str):
    if torch.cuda.is_available():
        return importlib.import_module(name)
    _index_scalars_of_any_shape()
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


def convert_to_e4m3_as_the_gpu(monkeypatch) -> None:
    """For one test: the interpreter's float32 → e4m3 conversion done as the GPU's (and torch's):
    round to nearest even. Triton 3.6's own rounds ties away from zero, drops the carry when
    rounding up crosses a power of two (124 becomes 64, not 128) and truncates subnormals
    (tests/engine/test_fp8_quant_kernel.py shows each), which in a kernel that quantizes its own
    results would stand for errors of the kernel's. Values are clamped to ±448 by the kernels
    before they convert, so saturation never arises."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
            values = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(input.shape)
        return original(input, input_dtype, output_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)

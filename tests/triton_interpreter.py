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

"""One process of `compile_ahead`'s pool: compiles the Triton kernel variants it is sent into
Triton's on-disk cache, where the engine's own launches then find them.

`python -m pagoda_engine.worker.compile_worker` (started with the parent's import path as
PYTHONPATH), spoken to over its stdin and stdout in pickles: "ready" out once Triton and torch are
imported; then, for each `CompileJob` in, None out when the variant is in the cache, or the error
as a string. It exits
when its stdin closes (the parent is done, or gone). A process of its own, not a thread: Triton's
compiler holds the GIL for most of a compile, so threads compile one variant at a time."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class CompileJob:
    """One kernel variant, as `JITFunction._do_compile` is given it: the function by module and
    qualified name, its signature, constants and specialisation, the backend's options and the
    target GPU."""
    module: str
    qualname: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    target: object


def jit_function(module: str, qualname: str):
    """The `triton.jit` function `qualname` of `module`, through `autotune`/`heuristics` wrappers."""
    from triton.runtime.jit import JITFunction

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def compile_job(job: CompileJob) -> None:
    import triton
    from triton.compiler import ASTSource

    src = ASTSource(jit_function(job.module, job.qualname), job.signature, job.constexprs, job.attrs)
    triton.compile(src, target=job.target, options=job.options)


def main() -> None:
    # Results go out on the original stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    import torch  # noqa: F401  (the kernels' modules import it: loaded while the engine starts)
    import triton  # noqa: F401

    pickle.dump("ready", out)
    while True:
        try:
            job = pickle.load(inp)
        except EOFError:
            return
        try:
            compile_job(job)
            result = None
        except Exception as e:  # left for the engine's own launch, which raises it where it belongs
            result = f"{type(e).__name__}: {e}"
        pickle.dump(result, out)


if __name__ == "__main__":
    main()

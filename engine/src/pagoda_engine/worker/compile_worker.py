"""One process of `compile_ahead`'s pool: compiles the Triton kernel variants it is sent into
Triton's on-disk cache, where the engine's own launches then find them.

`python -m pagoda_engine.worker.compile_worker` (started with the parent's import path as
PYTHONPATH), spoken to over its stdin and stdout in pickles: "ready" out once torch and Triton are
imported and its compiler warmed up; then, for each `CompileJob` in, None out when the variant is
in the cache, or the error as a string. It exits when its stdin closes (the parent is done, or
gone). A process of its own, not a thread: Triton's compiler holds the GIL for most of a compile,
so threads compile one variant at a time.

What a fresh process would pay on its first job is paid before "ready", while the engine still
loads: a first compile costs 0.4-0.9 s more than the next ones (the compiler's own start), so the
worker compiles a small kernel of its own first, into a cache directory of its own that it then
deletes (the engine's cache must hold no kernel until the engine has asked whether it does).

A variant's first launch needs two things from the cache: the kernel's binary and its launcher, a
small C extension per argument signature that Triton builds with the host's C compiler (0.3-0.5 s
each on an H100 host). Where this machine has a GPU, the worker builds the launcher too, after the
kernel, and Triton's driver module (`cuda_utils`, 0.5 s) before "ready", which the engine's first
launch then loads instead of building it."""

from __future__ import annotations

import ctypes
import importlib
import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import dataclass

# The CUDA driver API's attribute numbers for the compute capability.
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 75, 76


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


def cuda_capability() -> int | None:
    """The first visible CUDA GPU's compute capability as Triton writes it (90 for 9.0), asked of
    the CUDA driver library without torch and without creating a context (CUDA_VISIBLE_DEVICES
    applies); None where there is no driver or no GPU."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    if (cuda.cuDeviceGetAttribute(ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0) != 0
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0) != 0):
        return None
    return major.value * 10 + minor.value


def jit_function(module: str, qualname: str):
    """The `triton.jit` function `qualname` of `module`, through `autotune`/`heuristics` wrappers."""
    from triton.runtime.jit import JITFunction

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def active_driver():
    """Triton's driver for this machine's GPU (building its `cuda_utils` module into the cache on
    first use), or None where there is none (a CPU machine compiling for a GPU it lacks)."""
    try:
        from triton.runtime.driver import driver

        return driver.active
    except Exception:
        return None


def compile_job(job: CompileJob, driver=None) -> None:
    """Compile the variant into Triton's cache, and with `driver` (`active_driver()`) its launcher."""
    import triton
    from triton.compiler import ASTSource

    src = ASTSource(jit_function(job.module, job.qualname), job.signature, job.constexprs, job.attrs)
    kernel = triton.compile(src, target=job.target, options=job.options)
    if driver is not None:
        # What the first launch's `CompiledKernel._init_handles` builds; the binary's loading
        # onto the GPU stays with the launch.
        driver.launcher_cls(kernel.src, kernel.metadata)


def warm_up_compiler(capability: int) -> None:
    """Compile a small kernel for this GPU (`capability`, as `cuda_capability` gives it) into a
    cache directory that is then deleted: the compiler's one-time start, paid ahead."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def _double(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, mask=offs < n)

    scratch = tempfile.mkdtemp(prefix="pagoda-triton-warm-up-")
    before = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = scratch
    try:
        src = ASTSource(_double, {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}, {"BLOCK": 128}, {})
        triton.compile(src, target=GPUTarget("cuda", capability, 32))
    finally:
        if before is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = before
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    # Results go out on the original stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    import torch  # noqa: F401  (the kernels' modules import it: loaded while the engine starts)
    import triton  # noqa: F401

    driver = None
    if (capability := cuda_capability()) is not None:
        try:
            warm_up_compiler(capability)
        except Exception:  # only a head start: the first job pays for it instead
            pass
        # Builds Triton's `cuda_utils` into the cache, for the engine's own first launch too
        # (`triton_cache_is_empty` does not count it).
        driver = active_driver()
    try:
        pickle.dump("ready", out)
    except BrokenPipeError:  # the engine stopped (or failed) while this process started
        return
    while True:
        try:
            job = pickle.load(inp)
        except EOFError:
            return
        try:
            compile_job(job, driver)
            result = None
        except Exception as e:  # left for the engine's own launch, which raises it where it belongs
            result = f"{type(e).__name__}: {e}"
        pickle.dump(result, out)


if __name__ == "__main__":
    main()

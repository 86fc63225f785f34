"""Compile the Triton kernels a forward will launch, several at once, before running it, when
nothing is compiled yet.

On a fresh machine (an empty Triton cache) the first launch of each kernel variant compiles it,
one after the other on the engine's thread. Capturing Llama-3.1-8B's CUDA graphs on an H100
compiled fourteen variants that way, 5.1-5.6 s of a 35-37 s start; compiled ahead, the capture
took 6 s less (benchmarks.md, twenty-fourth session). `compile_ahead()` runs a block of code with
every Triton launch turned into a compile submitted to a pool of threads (Triton's
`AsyncCompileMode`: its code generation runs outside the GIL and `ptxas` in processes of its
own), and waits for them all on leaving the block. The kernels are not run; torch's own
operations in the block are. Run the same forward again afterwards, for real: each launch finds
its kernel compiled.

The pass is one more forward at every graph size. With Triton's cache warm (a restarted process
on the same node, or a `compileCache` claim an earlier pod filled) there is nothing to compile
and it only costs: 4 s of Qwen3-30B-A3B's start on an H200. So the engine core asks
`triton_cache_is_empty()` once, when it starts and before anything compiled, and every rank
follows its answer (their forwards' collectives must pair up).

Only for code whose host side never reads what a Triton kernel writes (a forward that a CUDA graph
captures cannot), since inside the block those outputs keep whatever the memory held. A compile
that fails here is left for the real launch, which raises it where it belongs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)


def triton_cache_is_empty() -> bool:
    """True when Triton's on-disk kernel cache holds nothing: its directory (TRITON_CACHE_DIR, or
    .triton/cache under TRITON_HOME or the home directory) is missing or empty. False where
    Triton is absent, or a cache manager of its own (TRITON_CACHE_MANAGER, a remote backend) may
    hold kernels this process cannot see."""
    try:
        from triton import knobs
    except ImportError:
        return False
    if knobs.cache.manager_class is not None or knobs.cache.remote_manager_class is not None:
        return False
    try:
        with os.scandir(knobs.cache.dir) as entries:
            return next(entries, None) is None
    except FileNotFoundError:
        return True
    except OSError:
        return False


@contextlib.contextmanager
def compile_ahead(device: torch.device, what: str, enabled: bool = True) -> Iterator[bool]:
    """Inside: Triton launches compile on a thread pool instead of running; on leaving, every
    compile has ended. Yields False (and changes nothing) when not `enabled`, off CUDA or without
    Triton's async compile mode: run the block's code only when it yields True. `what` names the
    block in the log."""
    if not enabled or device.type != "cuda":
        yield False
        return
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield False
        return
    launch, do_compile = JITFunction.run, JITFunction._do_compile
    submitted: dict[tuple, object] = {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    def submit_once(self, key, signature, device, *rest):
        # A variant enters Triton's in-memory cache only when the block ends; until then every
        # launch of it would hash its source again to find the same submission.
        once = (self, device, key)
        if once not in submitted:
            submitted[once] = do_compile(self, key, signature, device, *rest)
        return submitted[once]

    started = time.monotonic()
    mode = None
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(os.sched_getaffinity(0)))),
                            thread_name_prefix="triton-compile") as pool:
        JITFunction.run, JITFunction._do_compile = compile_only, submit_once
        try:
            with _async_compile.AsyncCompileMode(pool, ignore_errors=True) as mode:
                yield True
        finally:
            JITFunction.run, JITFunction._do_compile = launch, do_compile
    if mode is not None:
        logger.info("compiled %d Triton kernel variant(s) ahead of %s in %.1fs", len(mode.future_kernels), what,
                    time.monotonic() - started)

"""Compile the Triton kernels a forward will launch, several at once, before running it.

On a fresh machine (an empty Triton cache) the first launch of each kernel variant compiles it,
one after the other on the engine's thread. Capturing Llama-3.1-8B's CUDA graphs on an H100
compiled fourteen variants that way, 5.1-5.6 s of a 35-37 s start; compiled ahead, the capture
took 6 s less (benchmarks.md, twenty-fourth session). `compile_ahead()` runs a block of code with every Triton launch turned into a compile submitted
to a pool of threads (Triton's `AsyncCompileMode`: its code generation runs outside the GIL and
`ptxas` in processes of its own), and waits for them all on leaving the block. The kernels are
not run; torch's own operations in the block are. Run the same forward again afterwards, for
real: each launch finds its kernel compiled.

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


@contextlib.contextmanager
def compile_ahead(device: torch.device, what: str) -> Iterator[bool]:
    """Inside: Triton launches compile on a thread pool instead of running; on leaving, every
    compile has ended. Yields False (and changes nothing) off CUDA or without Triton's async
    compile mode: run the block's code only when it yields True. `what` names the block in the log."""
    if device.type != "cuda":
        yield False
        return
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield False
        return
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    started = time.monotonic()
    mode = None
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(os.sched_getaffinity(0)))),
                            thread_name_prefix="triton-compile") as pool:
        JITFunction.run = compile_only
        try:
            with _async_compile.AsyncCompileMode(pool, ignore_errors=True) as mode:
                yield True
        finally:
            JITFunction.run = launch
    if mode is not None:
        logger.info("compiled %d Triton kernel variant(s) ahead of %s in %.1fs", len(mode.future_kernels), what,
                    time.monotonic() - started)

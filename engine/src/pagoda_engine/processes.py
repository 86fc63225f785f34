"""What every child process of the engine does first: die with its parent; how many CPU threads
torch runs in a process that runs a model; and, once started, its objects out of the garbage
collector's reach.

The engine core process (child of the API server) and the tensor-parallel workers (children of
the core) call `die_with_parent` before anything else, so no process outlives the one that owns
it, even when that one was SIGKILLed and could clean nothing up.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time

from pagoda_engine import envs

logger = logging.getLogger(__name__)

_PARENT_CHECK_S = 1.0


def die_with_parent(parent_pid: int) -> None:
    """Exit when the parent process goes: the kernel's parent-death signal on Linux, and a
    thread watching the parent pid everywhere (which also covers the race before the prctl call).

    The kernel signal follows the parent *thread* that started us, so a child started from a
    short-lived thread dies with that thread: start children from a thread that lives as long
    as they do (the main thread, as the server and scripts do)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(_PARENT_CHECK_S)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


SMALL_CPU_MODEL_PARAMS = 50_000_000


def set_torch_threads(device_type: str, num_params: int | None = None) -> None:
    """Torch's CPU threads in a process that runs a model (an engine core or a worker rank).
    PAGODA_CPU_THREADS decides when set. Otherwise:
    - on a GPU, one thread unless OMP_NUM_THREADS is set (vLLM's rule for its GPU workers). The
      host's torch ops there are a step's small inputs, and the OpenMP pools of the processes of
      one host (tensor-parallel ranks, data-parallel cores) spin against each other: on 2 × H200,
      TP=2 T1 went from 9,043 to 13,164 output tok/s, and one GPU's T1 from 7,418 to 8,232. The
      offline `LLM` runs its engine core in the caller's process, so that process gets one thread
      too (logged); OMP_NUM_THREADS keeps the caller's own;
    - on CPU, one thread for models under 50 M parameters (`num_params`), whose tiny matmuls gain
      less than OpenMP's synchronisation costs, which collapses when several engines share a
      machine; torch's default for larger ones."""
    # Imported here, not at the top: the API process imports this module on its way to spawning
    # the engine core and runs no model; torch at the top delayed that spawn by seconds.
    import torch

    wanted = envs.cpu_threads()
    if wanted is not None:
        torch.set_num_threads(wanted)
    elif device_type == "cuda":
        if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
            logger.info("torch CPU threads %d -> 1 in this GPU process (set OMP_NUM_THREADS or "
                        "PAGODA_CPU_THREADS to choose)", torch.get_num_threads())
            torch.set_num_threads(1)
    elif num_params is not None and num_params < SMALL_CPU_MODEL_PARAMS:
        torch.set_num_threads(1)


def freeze_gc_heap() -> None:
    """Collect once, then move every object alive (modules, weights' Python objects, tokenizers,
    imported libraries) into the collector's permanent generation, as vLLM does after start-up:
    a later full collection walks only what serving made since. For processes that serve one
    engine to the end (an engine core process and its worker ranks): what is frozen is never
    collected, cycles included."""
    gc.collect()
    gc.freeze()


_collections_paused = False  # by `pause_collections_for_start_up`, in this process


def pause_collections_for_start_up() -> None:
    """No automatic collections while a serving process (an engine core, a worker rank) builds
    its heap: each full one walked all of it again (four took 0.77-0.84 s of a fresh H100 server's
    start, and a rank's collections hold the others in their collectives). `resume_collections`
    turns them back on once the engine has started."""
    global _collections_paused
    gc.disable()
    _collections_paused = True


def resume_collections() -> None:
    """Automatic collections again, in a process that paused them for its start-up; elsewhere (the
    process of a user who runs the offline LLM) the collector is left as it is."""
    global _collections_paused
    if _collections_paused:
        gc.enable()
        _collections_paused = False

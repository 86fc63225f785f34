"""What every child process of the engine does first: die with its parent.

The engine core process (child of the API server) and the tensor-parallel workers (children of
the core) call `die_with_parent` before anything else, so no process outlives the one that owns
it, even when that one was SIGKILLed and could clean nothing up.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

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

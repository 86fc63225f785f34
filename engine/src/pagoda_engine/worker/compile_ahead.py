"""Compile the Triton kernels a forward will launch, in several processes at once, before running
it, when nothing is compiled yet.

On a fresh machine (an empty Triton cache) the first launch of each kernel variant compiles it,
one after the other on the engine's thread: capturing Llama-3.1-8B's CUDA graphs on an H100
compiled fourteen variants that way, 6-7 s of the capture. `compile_ahead()` runs a block of code
with every Triton launch turned into a note of the variant it needs; the kernels are not run,
torch's own operations in the block are. Each variant goes, as soon as it is noted, to a pool of
processes (`compile_worker`: Triton's compiler holds the GIL for most of a compile, so threads
overlap little more than `ptxas`) that compile it, with its launcher, into Triton's on-disk cache
while the block goes on; leaving the block waits for them. Run the same code again afterwards,
for real: each launch loads its kernel from the cache, as on a warm start.

The engine runs three such blocks: the profile step with the sampler's draws
(`Worker.profile_run`), the sampler alone (cache hits after the first, or where no profile step
runs) and the graphs' forwards at every size (`DecodeGraphs`, `PiecewiseGraphs`). Each is one
more forward, and the pool's processes import torch and Triton: the engine core process starts
its pool before its own imports (`start_compile_pool_early`), every other rank its own before the
weights load (`create_executor`), and the processes warm their compiler up while the engine loads.
With Triton's cache warm (a restarted container on the same emptyDir, or a `compileCache` claim an
earlier pod filled) there is nothing to compile and the blocks only cost: 4 s of Qwen3-30B-A3B's
start on an H200. So `create_executor` asks `triton_cache_is_empty()` once, when the engine starts
and before anything compiled, and every rank follows its answer (`Worker.compile_ahead`: their
forwards' collectives must pair up).

Only for code whose host side never reads what a Triton kernel writes (a forward that a CUDA graph
captures cannot; the eager profile step does not either), since inside the block those outputs keep
whatever the memory held. A variant the pool cannot compile (a kernel defined inside a function,
or a failing compile) is left for the real launch, which compiles it or raises where it belongs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagoda_engine.worker.compile_worker import CompileJob

if TYPE_CHECKING:
    import torch  # not imported here: the engine core process starts the pool before importing torch

    from pagoda_engine.config import EngineConfig

logger = logging.getLogger(__name__)


def triton_cache_is_empty() -> bool:
    """True when Triton's on-disk kernel cache holds no kernel: its directory (TRITON_CACHE_DIR,
    or .triton/cache under TRITON_HOME or the home directory) is missing, empty, or holds only
    Triton's driver module (which the pool's processes build as they start). False where Triton
    is absent, or a cache manager of its own (TRITON_CACHE_MANAGER, a remote backend) may hold
    kernels this process cannot see."""
    try:
        from triton import knobs
    except ImportError:
        return False
    if knobs.cache.manager_class is not None or knobs.cache.remote_manager_class is not None:
        return False
    try:
        with os.scandir(knobs.cache.dir) as entries:
            return all(_holds_only_driver_module(entry.path) for entry in entries)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _holds_only_driver_module(path: str) -> bool:
    """One entry of Triton's cache (a directory per key): whether it holds no kernel, only the
    driver's C module (`cuda_utils`, `hip_utils`), which every process that launches a kernel
    builds or loads, or nothing yet (Triton makes a key's directory when it first looks the key
    up, and writes each file through a `tmp.pid_*` directory inside it)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(name.startswith(("cuda_utils", "hip_utils", "tmp.pid_")) for name in names)


class CompilePool:
    """Processes of `compile_worker`, started at once; each imports torch and Triton meanwhile.
    Jobs are `submit`ted as they come (a process takes the next as soon as it is free and ready)
    and `wait` collects them, so that compiles run while the code that notes them goes on."""

    def __init__(self, workers: int):
        # This process's import path, so that `-m` finds the engine wherever this process found it.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.procs = [subprocess.Popen([sys.executable, "-m", "pagoda_engine.worker.compile_worker"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) for _ in range(workers)]
        self._ready = [False] * workers
        self._ended = [False] * workers
        # (job, its pickle) to compile; None: a feeder's end.
        self._todo: queue.SimpleQueue[tuple[CompileJob, bytes] | None] = queue.SimpleQueue()
        self._feeders: list[threading.Thread] = []
        self._errors: list[str] = []

    def submit(self, job: CompileJob, pickled: bytes | None = None) -> None:
        """Compile `job` (`pickled`: its pickle, where the caller made one already) as soon as a
        process is free."""
        if not self._feeders:  # one thread per process: each waits on its pipes and the queue, without the GIL
            self._feeders = [threading.Thread(target=self._feed, args=(i,), name="triton-compile", daemon=True)
                             for i, ended in enumerate(self._ended) if not ended]
            for feeder in self._feeders:
                feeder.start()
        self._todo.put((job, pickled if pickled is not None else pickle.dumps(job)))

    def wait(self) -> list[str]:
        """Wait for every job submitted so far; the errors of those that failed. The jobs of a
        worker that died go to the others (its end is logged), or fail where none is left."""
        for _ in self._feeders:
            self._todo.put(None)
        for feeder in self._feeders:
            feeder.join()
        self._feeders = []
        while True:  # the end markers of feeders whose process died, and jobs no process was left for
            try:
                item = self._todo.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._errors.append(f"{item[0].module}.{item[0].qualname}: no compile worker left")
        errors, self._errors = self._errors, []
        return errors

    def compile(self, jobs: list[CompileJob]) -> list[str]:
        """Compile every job; the errors of those that failed."""
        for job in jobs:
            self.submit(job)
        return self.wait()

    def _feed(self, i: int) -> None:
        proc, item = self.procs[i], None
        try:
            if not self._ready[i]:
                self._ready[i] = pickle.load(proc.stdout) == "ready"
            while (item := self._todo.get()) is not None:
                proc.stdin.write(item[1])
                proc.stdin.flush()
                if (error := pickle.load(proc.stdout)) is not None:
                    self._errors.append(f"{item[0].module}.{item[0].qualname}: {error}")
                item = None
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            self._ended[i] = True
            if item is not None:
                self._todo.put(item)  # another process takes it
            logger.warning("compiling ahead: compile worker %d ended (%s); its jobs go to the others", proc.pid,
                           type(e).__name__)

    def close(self, wait: bool = True) -> None:
        """Its processes exit; `wait=False`: without waiting for them here (each takes tenths of
        a second to tear torch down), a daemon thread reaps them."""
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the worker exits at the end of its input
        if wait:
            self._reap()
        else:
            threading.Thread(target=self._reap, name="triton-compile-reaper", daemon=True).start()

    def _reap(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_pool: CompilePool | None = None


def compile_workers(ranks_on_node: int = 1) -> int:
    """How many compile processes one rank starts: half the CPUs it may use, shared with the
    node's other ranks, at most 8 (each holds torch, a few hundred MB)."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // (2 * ranks_on_node)))


def settings_allow_compile_ahead(config: EngineConfig) -> bool:
    """Whether the engine's settings let it capture CUDA graphs through Triton kernels, the first
    condition of compiling ahead (`create_executor` adds the device and the cache's state;
    `start_compile_pool_early` asks before it knows them all)."""
    mc = config.model
    # Cores whose experts span each other pair every forward's collectives: each core decides
    # alone whether to compile ahead (its extra passes), so none does.
    return (not mc.enforce_eager and mc.cudagraph_mode != "NONE" and mc.attention_backend != "torch"
            and not config.parallel.expert_parallel_across_cores)


def ranks_on_node(config: EngineConfig) -> int:
    """The ranks that share a node with each of the engine's: its own there (a multi-node engine's
    are spread evenly) times the data-parallel cores the node runs."""
    pc = config.parallel
    return pc.ranks_per_node * len(pc.local_cores)


def engine_compile_workers(config: EngineConfig) -> int:
    """`compile_workers` for rank 0 (in the engine core's process)."""
    return compile_workers(ranks_on_node(config))


def start_compile_pool_early(config: EngineConfig) -> None:
    """In the engine core process, before it imports torch: start the pool where the engine will
    very likely compile ahead (a GPU, CUDA graphs, an empty Triton cache), so that its processes
    import torch and Triton alongside this process instead of after it. `create_executor` makes
    the exact decision and stops the pool where it decides otherwise."""
    from pagoda_engine.worker.compile_worker import cuda_capability

    if (config.model.device != "cpu" and settings_allow_compile_ahead(config) and cuda_capability() is not None
            and triton_cache_is_empty()):
        start_compile_pool(engine_compile_workers(config))


def start_compile_pool(workers: int) -> None:
    """Start the pool now, so that its processes have imported torch and Triton by the time
    `compile_ahead` needs them (it starts one itself otherwise)."""
    global _pool
    if _pool is None:
        _pool = CompilePool(workers)


def stop_compile_pool() -> None:
    """Its processes exit, unwaited for (after the CUDA graphs are captured: nothing compiles ahead
    later)."""
    global _pool
    if _pool is not None:
        _pool.close(wait=False)
        _pool = None


@contextlib.contextmanager
def compile_ahead(device: torch.device, what: str, enabled: bool = True, workers: int | None = None) -> Iterator[bool]:
    """Inside: Triton launches note the variants they need instead of running, and the pool
    (`start_compile_pool`'s, or one of `workers` processes started here and kept for the next
    block) compiles each into Triton's cache meanwhile; leaving waits for it. Yields False (and
    changes nothing) when not `enabled`, or off CUDA or Triton: run the block's code only when it
    yields True. `what` names the block in the log."""
    if not enabled or device.type != "cuda":
        yield False
        return
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield False
        return
    launch, do_compile = JITFunction.run, JITFunction._do_compile
    wanted: dict[tuple, tuple[CompileJob, bytes] | None] = {}
    start_compile_pool(workers or compile_workers())
    pool = _pool

    def note_only(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    def note(self, key, signature, device, constexprs, options, attrs, warmup):
        if (self, device, key) not in wanted:
            wanted[self, device, key] = job = _job(self, device, signature, constexprs, options, attrs)
            if job is not None:
                pool.submit(*job)  # compiles while the block goes on
        return None  # `run` returns at once: nothing is compiled here, nothing launched

    started = time.monotonic()
    JITFunction.run, JITFunction._do_compile = note_only, note
    try:
        yield True
    finally:
        JITFunction.run, JITFunction._do_compile = launch, do_compile
        errors = pool.wait()
    jobs = sum(job is not None for job in wanted.values())
    if not wanted:
        return
    for error in errors:
        logger.warning("compiling ahead: %s", error)
    logger.info("compiled %d Triton kernel variant(s) ahead of %s in %.1fs (%d process(es)%s)", jobs - len(errors),
                what, time.monotonic() - started, len(pool.procs),
                f"; {len(wanted) - jobs} left for their launch" if len(wanted) > jobs else "")


def _job(fn, device, signature, constexprs, options, attrs) -> tuple[CompileJob, bytes] | None:
    """The pool's job for a variant and its pickle, or None for a kernel a process of its own
    cannot import."""
    qualname = fn.fn.__qualname__
    if "<locals>" in qualname:
        return None
    job = CompileJob(fn.module, qualname, signature, constexprs, attrs, dict(options.__dict__),
                     fn.device_caches[device][2])
    try:
        return job, pickle.dumps(job)
    except Exception:
        return None

"""Runs the model for the engine core: in this process (TP=1), or as rank 0 of N tensor-parallel
ranks (`create_executor` picks).

The core talks to an `Executor` only: `init_kv_cache` (the attention backend and its pages),
`profile_run` (the largest step, for memory sizing), `capture_graphs` (the decode and piecewise
CUDA graphs), `execute_model` (one forward over the step's tokens: a whole-forward graph replay for
all-decode steps that fit one, piecewise replays for other short steps) and `compute_logits`, then
`close`.

Under tensor parallelism every rank holds one shard of the weights (`model/layers.py`: heads, MLP
columns, vocabulary slices) and its own KV pool with the same page count (heads/N per page). One
scheduler, on rank 0, decides for all, so a page id means the same page on every rank. For every
call rank 0 sends the workers a small pickled command over a pipe (the call, the batch's lengths
and page tables), then broadcasts the call's tensors (token ids, positions and slots; or the hidden
rows to turn into logits) over the group, and every rank runs the same forward: the all-reduces
inside the model keep them in step. Logits are gathered on every rank; only rank 0 samples. The
group is the engine's own (`model.layers.TPGroup`), not torch.distributed's global one, so a
process may hold several engines (tests do).

Processes: rank 0 is the engine core's own process; ranks 1..N-1 are fresh interpreters started
here (`python -c`, like multiprocessing's spawn but without re-importing the caller's main module,
so a script that makes an `LLM` at top level needs no `if __name__ == "__main__"`). Gloo on CPU
(one thread per rank), NCCL on CUDA (rank r on cuda:r). A worker exits when told (`close`), when
its pipe closes, or when the core's process dies (PR_SET_PDEATHSIG on Linux, and a watch on the
parent pid); a worker that fails to start makes `create_executor` raise ModelLoadError with the
worker's own error.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

import pagoda_engine

from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import EngineDeadError, ModelLoadError
from pagoda_engine.worker.attention import get_attention_backend
from pagoda_engine.worker.attention.base import AttentionBackend, AttentionBatch, KVCacheSpec
from pagoda_engine.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from pagoda_engine.worker.model.layers import TPGroup, attach_tp_group
from pagoda_engine.worker.model.loader import load_hf_config, load_model

logger = logging.getLogger(__name__)

# Start-up covers spawning, importing torch and loading a shard of a large checkpoint.
_START_TIMEOUT_S = float(os.environ.get("PAGODA_TP_START_TIMEOUT_S", "900"))
# A collective that waits longer than this means a rank is gone.
_COLLECTIVE_TIMEOUT_S = float(os.environ.get("PAGODA_TP_COLLECTIVE_TIMEOUT_S", "600"))
_PARENT_CHECK_S = 1.0


class Executor:
    """The model in this process: every call runs here, nothing is sent anywhere."""

    tp_size = 1

    def __init__(self, model: nn.Module, device: torch.device, attn: AttentionBackend | None = None):
        self.model = model
        self.device = torch.device(device)
        self.attn = attn
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None

    def init_kv_cache(self, backend: str, spec: KVCacheSpec, num_pages: int) -> AttentionBackend:
        """Create the attention backend that owns the KV pages (`spec` is per rank)."""
        self.attn = get_attention_backend(backend, spec, num_pages, self.device)
        return self.attn

    def capture_graphs(self, batch_sizes: list[int], max_pages_per_seq: int, piecewise_sizes: list[int]) -> None:
        """Capture the decode forward at these batch sizes and, when `piecewise_sizes` is not
        empty, the piecewise forward at those token counts (after `init_kv_cache`)."""
        pool = torch.cuda.graph_pool_handle()
        self.graphs = DecodeGraphs(self.model, self.attn, self.device, batch_sizes, max_pages_per_seq, pool)
        if piecewise_sizes:
            self.piecewise = PiecewiseGraphs(self.model, self.attn, self.device, piecewise_sizes, pool)

    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Plan attention for `batch`, run the forward; hidden states [num_tokens, hidden_size]."""
        if self.graphs is not None and self.graphs.fits(batch):
            return self.graphs.run(input_ids, positions, batch)
        if self.piecewise is not None and self.piecewise.fits(batch):
            return self.piecewise.run(input_ids, positions, batch)
        self.attn.plan(batch)
        return self.model(input_ids, positions, self.attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the whole vocabulary for the given hidden rows."""
        return self.model.compute_logits(hidden)

    def profile_run(self, backend: str, spec: KVCacheSpec, num_tokens: int, num_rows: int) -> torch.Tensor:
        """The largest step the scheduler can form, for measuring peak memory: `num_tokens` new
        tokens of one sequence through the attention backend (over a scratch pool of just enough
        pages), then the logits of the last `num_rows` of them, which it returns."""
        page_size = spec.page_size
        scratch_pages = -(-num_tokens // page_size) + 1  # + the null page
        scratch = get_attention_backend(backend, spec, scratch_pages, self.device)
        batch = AttentionBatch(query_lens=[num_tokens], seq_lens=[num_tokens],
                               page_tables=[list(range(1, scratch_pages))],
                               slot_mapping=torch.arange(page_size, page_size + num_tokens, device=self.device))
        scratch.plan(batch)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(num_tokens, device=self.device), scratch)
        return self.model.compute_logits(hidden[-num_rows:])

    def close(self) -> None:
        pass


def check_tensor_parallel(hf_config: PretrainedConfig, tp_size: int) -> None:
    """Refuse, before any process starts, a TP size the model's shapes cannot be split by."""
    if tp_size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp_size:
        raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the model's num_attention_heads "
                             f"({heads}); valid sizes: {_divisors(heads)}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide num_key_value_heads ({kv_heads}) "
                             f"or be a multiple of it (KV heads are then replicated)")
    inter = getattr(hf_config, "intermediate_size", None)
    if inter and inter % tp_size:
        raise ModelLoadError(f"tensor_parallel_size {tp_size} must divide the model's intermediate_size ({inter})")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def create_executor(config: EngineConfig, model_dir: str, hf_config: PretrainedConfig, dtype: torch.dtype,
                    device: torch.device) -> Executor:
    """Load the model (rank 0's shard, with workers for the others under TP) and return the
    executor that runs it."""
    mc = config.model
    tp_size = config.parallel.tensor_parallel_size
    check_tensor_parallel(hf_config, tp_size)
    if tp_size == 1:
        return Executor(load_model(model_dir, hf_config, dtype, device, mc.load_format, mc.seed), device)
    return TPExecutor.start(config, model_dir, hf_config, dtype, device)


# --- tensor parallelism: rank 0 -----------------------------------------------------------------


@dataclass
class _WorkerArgs:
    rank: int
    tp_size: int
    store_port: int
    model_dir: str
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda"
    load_format: str
    seed: int
    parent_pid: int
    log_level: int


class _WorkerHandle:
    def __init__(self, rank: int, process: subprocess.Popen, conn: Connection):
        self.rank = rank
        self.process = process
        self.conn = conn

    def wait_reply(self, doing: str, timeout_s: float):
        """The worker's next reply; a reported error or an early exit becomes ModelLoadError."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            if self.process.poll() is not None:
                # It may have written its error just before exiting.
                if self.conn.poll(0):
                    break
                raise ModelLoadError(f"tensor-parallel worker {self.rank} exited (code {self.process.returncode}) "
                                     f"while trying to {doing} (its log is above)")
            if time.monotonic() > deadline:
                raise ModelLoadError(f"tensor-parallel worker {self.rank} did not {doing} within {timeout_s:.0f}s")
        try:
            reply = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError) as e:
            try:
                code = self.process.wait(2.0)
            except subprocess.TimeoutExpired:
                raise ModelLoadError(f"tensor-parallel worker {self.rank} closed its pipe while trying to {doing}") from e
            raise ModelLoadError(f"tensor-parallel worker {self.rank} exited (code {code}) while trying to "
                                 f"{doing} (its log is above)") from e
        if reply[0] == "error":
            _, error_type, message = reply
            raise ModelLoadError(f"tensor-parallel worker {self.rank} failed to {doing}: {error_type}: {message}")
        return reply[1]


def _stop_workers(workers: list[_WorkerHandle], timeout_s: float = 10.0) -> None:
    """Ask every worker to exit, then make sure: terminate, then kill, whatever is left."""
    for w in workers:
        try:
            w.conn.send_bytes(pickle.dumps(("close",)))
        except (OSError, ValueError):
            pass  # already gone
    deadline = time.monotonic() + timeout_s
    for w in workers:
        for stop in (None, w.process.terminate, w.process.kill):
            if stop is not None:
                stop()
            try:
                w.process.wait(max(0.1, deadline - time.monotonic()) if stop is None else 2.0)
                break
            except subprocess.TimeoutExpired:
                continue
        w.conn.close()


class TPExecutor(Executor):
    """Rank 0 of a tensor-parallel group: every call goes to the workers first, then runs here."""

    def __init__(self, model: nn.Module, device: torch.device, group: TPGroup, workers: list[_WorkerHandle]):
        super().__init__(model, device)
        self.tp_size = group.size
        self.group = group
        self.workers = workers
        # Interpreter exit without close() (a script that never closes its LLM) still stops them.
        self._finalizer = weakref.finalize(self, _stop_workers, workers)
        self.closed = False

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    @classmethod
    def start(cls, config: EngineConfig, model_dir: str, hf_config: PretrainedConfig, dtype: torch.dtype,
              device: torch.device) -> "TPExecutor":
        mc = config.model
        tp_size = config.parallel.tensor_parallel_size
        if device.type == "cuda":
            if torch.cuda.device_count() < tp_size:
                raise ModelLoadError(f"tensor_parallel_size {tp_size} needs {tp_size} GPUs, "
                                     f"{torch.cuda.device_count()} are visible")
            # Rank r runs on cuda:r; rank 0 (this process) on cuda:0.
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        elif device.type != "cpu":
            raise ModelLoadError(f"tensor parallelism runs on cuda or cpu, not {device}")
        # Port 0: the store picks a free port itself (no race with other engines on this host).
        store = dist.TCPStore("127.0.0.1", 0, tp_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=_START_TIMEOUT_S))
        workers: list[_WorkerHandle] = []
        try:
            for rank in range(1, tp_size):
                args = _WorkerArgs(rank=rank, tp_size=tp_size, store_port=store.port, model_dir=model_dir,
                                   dtype=dtype, device_type=device.type, load_format=mc.load_format, seed=mc.seed,
                                   parent_pid=os.getpid(), log_level=logging.getLogger().getEffectiveLevel())
                workers.append(_start_worker(args))
            # Rank 0 loads its shard while the workers load theirs.
            model = load_model(model_dir, hf_config, dtype, device, mc.load_format, mc.seed, tp_size, 0)
            for w in workers:
                w.wait_reply("load its weights", _START_TIMEOUT_S)
            group = _make_group(store, 0, tp_size, device)
            for w in workers:
                w.wait_reply("join the group", _START_TIMEOUT_S)
        except BaseException:
            _stop_workers(workers)
            raise
        attach_tp_group(model, group)
        logger.info("tensor parallelism: %d ranks (%s), workers %s", tp_size, _backend(device),
                    [w.process.pid for w in workers])
        return cls(model, device, group, workers)

    def _send(self, command: tuple) -> None:
        if self.closed:
            raise EngineDeadError("the tensor-parallel executor is closed")
        payload = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.workers:
            try:
                w.conn.send_bytes(payload)
            except OSError as e:
                raise EngineDeadError(f"tensor-parallel worker {w.rank} is gone "
                                      f"(exit code {w.process.poll()})") from e

    def init_kv_cache(self, backend: str, spec: KVCacheSpec, num_pages: int) -> AttentionBackend:
        self._send(("init_kv", backend, spec, num_pages))
        attn = super().init_kv_cache(backend, spec, num_pages)
        for w in self.workers:
            w.wait_reply(f"allocate {num_pages} KV pages", _START_TIMEOUT_S)
        return attn

    @contextlib.contextmanager
    def _on_all_ranks(self):
        """A collective fails (gloo) when a rank has died: name the rank instead of the socket error."""
        try:
            yield
        except RuntimeError as e:
            for w in self.workers:
                try:
                    code = w.process.wait(1.0)  # the sockets close a moment before the exit is reported
                except subprocess.TimeoutExpired:
                    continue
                raise EngineDeadError(f"tensor-parallel worker {w.rank} died (exit code {code})") from e
            raise

    def profile_run(self, backend: str, spec: KVCacheSpec, num_tokens: int, num_rows: int) -> torch.Tensor:
        with self._on_all_ranks():
            self._send(("profile", backend, spec, num_tokens, num_rows))
            return super().profile_run(backend, spec, num_tokens, num_rows)

    def capture_graphs(self, batch_sizes: list[int], max_pages_per_seq: int, piecewise_sizes: list[int]) -> None:
        # Every rank captures the same sizes in the same order: the all-reduces inside each
        # forward (warm-up and capture) pair up across ranks.
        with self._on_all_ranks():
            self._send(("graphs", batch_sizes, max_pages_per_seq, piecewise_sizes))
            super().capture_graphs(batch_sizes, max_pages_per_seq, piecewise_sizes)
        for w in self.workers:
            w.wait_reply("capture the CUDA graphs", _START_TIMEOUT_S)

    def execute_model(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        with self._on_all_ranks():
            self._send(("step", batch.query_lens, batch.seq_lens, batch.page_tables, batch.num_decodes))
            # One broadcast for the step's three token-indexed arrays.
            self.group.broadcast(torch.stack([input_ids, positions, batch.slot_mapping.to(torch.int64)]))
            return super().execute_model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        with self._on_all_ranks():
            self._send(("logits", tuple(hidden.shape), hidden.dtype))
            self.group.broadcast(hidden)
            return super().compute_logits(hidden)

    def close(self) -> None:
        """Stop the workers; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._finalizer.detach()
        _stop_workers(self.workers)
        self.group = None


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _make_group(store, rank: int, size: int, device: torch.device) -> TPGroup:
    """This rank's member of the engine's group; returns once every rank has joined."""
    timeout = datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S)
    store = dist.PrefixStore("pagoda-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    group = TPGroup(backend, rank, size)
    # A first collective: every rank is connected (NCCL makes its communicator lazily) before
    # anyone reports ready.
    group.all_reduce(torch.zeros(1, device=device))
    return group


def _start_worker(args: _WorkerArgs) -> _WorkerHandle:
    """A fresh interpreter running `worker_entry`, talking to us over one end of a socket pair."""
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    # The worker must import this very pagoda_engine (a source checkout, not only an installed one).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(pagoda_engine.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", "from pagoda_engine.worker.executor import worker_entry; worker_entry()",
             str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    finally:
        theirs.close()
    conn = Connection(ours.detach())
    try:
        conn.send_bytes(pickle.dumps(args))
    except OSError:
        pass  # it died at once; waiting for its first reply reports how
    return _WorkerHandle(args.rank, process, conn)


# --- tensor parallelism: the worker processes ------------------------------------------------------


def die_with_parent(parent_pid: int) -> None:
    """Exit when the parent process goes, even if it was SIGKILLed: the kernel's parent-death signal
    on Linux, and a thread watching the parent pid everywhere (which also covers the race before
    the prctl call). The kernel signal follows the parent *thread* that started us, so an engine
    made on a short-lived thread loses its workers with that thread: make engines on a thread
    that lives as long as they do (the main thread, as the server and scripts do)."""
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


def _reply(conn: Connection, value=None) -> None:
    conn.send_bytes(pickle.dumps(("ok", value)))


def _reply_error(conn: Connection, e: BaseException) -> None:
    try:
        conn.send_bytes(pickle.dumps(("error", type(e).__name__, str(e))))
    except OSError:
        pass


def worker_entry() -> None:
    """Entry point of a worker process (`_start_worker`): its socket's fd is the one argument."""
    conn = Connection(int(sys.argv[1]))
    try:
        args: _WorkerArgs = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        os._exit(1)
    _worker_main(args, conn)


def _worker_main(args: _WorkerArgs, conn: Connection) -> None:
    """TP rank `args.rank`: load the shard, join the group, then serve rank 0's commands."""
    die_with_parent(args.parent_pid)
    # The core owns shutdown; a Ctrl-C reaching the whole process group must not kill us mid-step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=args.log_level,
                        format=f"%(asctime)s %(levelname)s tp-worker-{args.rank} %(name)s: %(message)s")
    code = 0
    try:
        if args.device_type == "cuda":
            device = torch.device("cuda", args.rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)  # ranks share the machine's cores; one thread each
        try:
            hf_config = load_hf_config(args.model_dir)
            torch.manual_seed(args.seed)
            model = load_model(args.model_dir, hf_config, args.dtype, device, args.load_format, args.seed,
                               args.tp_size, args.rank)
        except Exception as e:
            _reply_error(conn, e)
            code = 1
            return
        _reply(conn)
        store = dist.TCPStore("127.0.0.1", args.store_port, args.tp_size, is_master=False,
                              timeout=datetime.timedelta(seconds=_START_TIMEOUT_S))
        group = _make_group(store, args.rank, args.tp_size, device)
        attach_tp_group(model, group)
        _reply(conn)
        with torch.inference_mode():
            _serve(Executor(model, device), group, conn, device)
    except (EOFError, OSError):
        pass  # the core closed its end: nothing left to serve
    except Exception:
        logging.getLogger(__name__).error("tensor-parallel worker %d failed:\n%s", args.rank, traceback.format_exc())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown (process group, CUDA context): nothing waits on it.
        os._exit(code)


def _serve(local: Executor, group: TPGroup, conn: Connection, device: torch.device) -> None:
    """Run rank 0's commands until `close` (or until the pipe closes: EOFError)."""
    while True:
        command = pickle.loads(conn.recv_bytes())
        kind = command[0]
        if kind == "step":
            _, query_lens, seq_lens, page_tables, num_decodes = command
            tokens = torch.empty(3, sum(query_lens), dtype=torch.int64, device=device)
            group.broadcast(tokens)
            batch = AttentionBatch(query_lens=query_lens, seq_lens=seq_lens, page_tables=page_tables,
                                   slot_mapping=tokens[2], num_decodes=num_decodes)
            local.execute_model(tokens[0], tokens[1], batch)
        elif kind == "logits":
            _, shape, dtype = command
            hidden = torch.empty(shape, dtype=dtype, device=device)
            group.broadcast(hidden)
            local.compute_logits(hidden)
        elif kind == "init_kv":
            _, backend, spec, num_pages = command
            try:
                local.init_kv_cache(backend, spec, num_pages)
            except Exception as e:
                _reply_error(conn, e)
                raise
            _reply(conn)
        elif kind == "profile":
            _, backend, spec, num_tokens, num_rows = command
            local.profile_run(backend, spec, num_tokens, num_rows)
        elif kind == "graphs":
            _, batch_sizes, max_pages_per_seq, piecewise_sizes = command
            try:
                local.capture_graphs(batch_sizes, max_pages_per_seq, piecewise_sizes)
            except Exception as e:
                _reply_error(conn, e)
                raise
            _reply(conn)
        elif kind == "close":
            return
        else:
            raise ValueError(f"unknown tensor-parallel command {kind!r}")

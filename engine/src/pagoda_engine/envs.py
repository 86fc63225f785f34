"""Every PAGODA_* environment variable the engine reads, each through a function of its own
here (no other module reads one), and the one way to read a number: `env_seconds` (a finite
number of seconds > 0) or `env_count` (a whole number >= 1). A value that is not one (not a
number, zero or negative, nan or inf, empty) is refused with an `InvalidEnvironmentError` naming
the variable and what it must be, never crashes on a bare ValueError nor is bent into range. `env_switch` reads an on/off switch: "1" or "0", nothing else.

Each is read when used, never at import: every `pagoda` verb imports the modules that use them.
`pagoda serve` reads every number first (`check_environment`), so a bad value stops it, exit 2,
before anything starts. A base module: it imports no layer of the engine."""

from __future__ import annotations

import math
import os
from pathlib import Path

from pagoda_engine.errors import InvalidEnvironmentError


def _raw(names: tuple[str, ...]) -> tuple[str, str] | None:
    """(the first of `names` that is set, its value), or None."""
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return name, value
    return None


def env_seconds(name: str, default: float, *, older_name: str | None = None) -> float:
    """Seconds from `name` (or its `older_name`, when only that is set), `default` when neither is set."""
    found = _raw((name,) if older_name is None else (name, older_name))
    if found is None:
        return default
    name, raw = found
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidEnvironmentError(f"{name} must be a number of seconds > 0, got {raw!r}")
    return seconds


def env_count(name: str, default: int | None) -> int | None:
    """A whole number >= 1 from `name`, `default` when it is not set."""
    found = _raw((name,))
    if found is None:
        return default
    raw = found[1]
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise InvalidEnvironmentError(f"{name} must be a whole number >= 1, got {raw!r}")
    return count


def env_switch(name: str, default: bool) -> bool:
    """On ("1") or off ("0") from `name`, `default` when it is not set."""
    found = _raw((name,))
    if found is None:
        return default
    if found[1] not in ("0", "1"):
        raise InvalidEnvironmentError(f"{name} must be 0 or 1, got {found[1]!r}")
    return found[1] == "1"


def tp_start_timeout_s() -> float:
    """How long a worker rank may take to start: spawning, importing torch and loading a shard of
    a large checkpoint."""
    return env_seconds("PAGODA_TP_START_TIMEOUT_S", 900.0)


def dist_timeout_s() -> float:
    """Every rank joins within this: spawning and importing torch here, or a headless node starting
    elsewhere (a headless node waits as long for the leader). PAGODA_TP_JOIN_TIMEOUT_S is its older name."""
    return env_seconds("PAGODA_DIST_TIMEOUT_S", 300.0, older_name="PAGODA_TP_JOIN_TIMEOUT_S")


def tp_collective_timeout_s() -> float:
    """A collective that waits longer than this means a rank is gone."""
    return env_seconds("PAGODA_TP_COLLECTIVE_TIMEOUT_S", 600.0)


def cpu_threads() -> int | None:
    """Torch's CPU threads in an engine core (on CPU or GPU) and in a worker rank on a GPU; None:
    the engine chooses (`processes.set_torch_threads`). Worker ranks on CPU run one thread each."""
    return env_count("PAGODA_CPU_THREADS", None)


def programmatic_dependent_launch() -> bool:
    """The engine's Triton kernels start while the kernel before them ends, on GPUs that can
    (`worker/pdl.py`); PAGODA_PDL=0 turns it off."""
    return env_switch("PAGODA_PDL", True)


def allow_runtime_lora_updating() -> bool:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter are served (vLLM's
    VLLM_ALLOW_RUNTIME_LORA_UPDATING rule): PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1; off by default."""
    return env_switch("PAGODA_ALLOW_RUNTIME_LORA_UPDATING", False)


def _key(name: str) -> str | None:
    found = _raw((name,))
    if found is None:
        return None
    key = found[1].strip()  # a Secret made from a file often ends in a newline no header can carry
    if not key:
        raise InvalidEnvironmentError(f"{name} is set but empty: give the key, or unset it")
    return key


def api_key() -> str | None:
    """The key `pagoda serve` requires on its API when --api-key is not given (vLLM reads
    VLLM_API_KEY the same way); None: no key."""
    return _key("PAGODA_API_KEY")


def backend_api_key() -> str | None:
    """The key `pagoda route` sends the engines when --backend-api-key is not given."""
    return _key("PAGODA_BACKEND_API_KEY")


# The Redis password of the remote KV tier (the operator renders it from the Secret the spec names).
KV_REMOTE_PASSWORD_ENV = "PAGODA_KV_REMOTE_PASSWORD"
KV_REMOTE_READ_CONNECTIONS_ENV = "PAGODA_KV_REMOTE_READ_CONNECTIONS"
# An explicit split of the layers over the pipeline stages, as vLLM's VLLM_PP_LAYER_PARTITION: "a,b,...".
PP_LAYER_PARTITION_ENV = "PAGODA_PP_LAYER_PARTITION"
DIST_BACKEND_ENV = "PAGODA_DIST_BACKEND"


def kv_remote_timeout_s() -> float:
    """How long one Redis call of the remote KV tier may take."""
    return env_seconds("PAGODA_KV_REMOTE_TIMEOUT_S", 1.0)


def kv_remote_backoff_s() -> float:
    """How long a failed Redis server of the remote KV tier is skipped."""
    return env_seconds("PAGODA_KV_REMOTE_BACKOFF_S", 5.0)


def kv_remote_read_connections() -> int:
    """How many connections a read from one Redis server spreads over (default 4)."""
    return env_count(KV_REMOTE_READ_CONNECTIONS_ENV, 4)


def kv_remote_password() -> str | None:
    """The remote KV tier's Redis password; None when unset or empty."""
    return os.environ.get(KV_REMOTE_PASSWORD_ENV) or None


def pp_layer_partition() -> str | None:
    """Each pipeline stage's layer count, "a,b,...", as given (`worker.parallel_state` checks it
    against the model); None: vLLM's even split."""
    return os.environ.get(PP_LAYER_PARTITION_ENV) or None


def dist_backend() -> str:
    """The process groups' backend asked for, lower case ("" when unset): nccl or gloo
    (`worker.parallel_state.dist_backend` checks it, knowing the device)."""
    return os.environ.get(DIST_BACKEND_ENV, "").strip().lower()


def cache_dir() -> Path:
    """Where Pagoda keeps built artefacts: $PAGODA_CACHE_DIR, else ~/.cache/pagoda."""
    return Path(os.environ.get("PAGODA_CACHE_DIR") or Path.home() / ".cache" / "pagoda").expanduser()


def bench_server_timeout_s() -> float:
    """How long `pagoda bench serve` waits for the server it starts to answer /health."""
    return env_seconds("PAGODA_BENCH_SERVER_TIMEOUT_S", 900.0)


def bench_kv_share_store_timeout_s() -> float:
    """How long `pagoda bench kv-share` waits for an engine's pages to reach Redis."""
    return env_seconds("PAGODA_BENCH_KV_SHARE_STORE_TIMEOUT_S", 120.0)


def check_environment() -> None:
    """Read every number above and the API key, so that a bad one is refused at start-up rather
    than when (and in whichever process) it is first used."""
    for read in (tp_start_timeout_s, dist_timeout_s, tp_collective_timeout_s, cpu_threads, programmatic_dependent_launch,
                 allow_runtime_lora_updating, api_key, kv_remote_read_connections, kv_remote_timeout_s, kv_remote_backoff_s):
        read()

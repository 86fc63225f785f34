"""The numbers the engine reads from PAGODA_* environment variables, and the one way to read
one: `env_seconds` (a finite number of seconds > 0) or `env_count` (a whole number >= 1). A value
that is not one (not a number, zero or negative, nan or inf, empty) is refused with an
`InvalidEnvironmentError` naming the variable and what it must be, never crashes on a bare
ValueError nor is bent into range. `env_switch` reads an on/off switch: "1" or "0", nothing else.

Each is read when used, never at import: every `pagoda` verb imports the modules that use them.
`pagoda serve` reads them all first (`check_environment`), so a bad value stops it, exit 2,
before anything starts."""

from __future__ import annotations

import math
import os

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


def check_environment() -> None:
    """Read every number above, the API key and the KV store's numbers, so that a bad one is refused
    at start-up rather than when (and in whichever process) it is first used."""
    from pagoda_engine.worker.kv_stores import remote_backoff_s, remote_read_connections, remote_timeout_s

    for read in (tp_start_timeout_s, dist_timeout_s, tp_collective_timeout_s, cpu_threads, programmatic_dependent_launch,
                 api_key, remote_read_connections, remote_timeout_s, remote_backoff_s):
        read()

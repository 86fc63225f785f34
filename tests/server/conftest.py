"""Server tests run `pagoda serve` for real (a subprocess on 127.0.0.1 with the built-in tiny
model, `--model pagoda-tiny`), one per test module, through the process harness shared with e2e/local and the router."""

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "local"))

from pagoda_e2e import Proc, free_port, start_engine  # noqa: E402


@dataclass
class Server:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def launch(tmp_path: Path, *extra: str) -> Server:
    port = free_port()
    proc = start_engine(port, tmp_path / "serve.log", extra=list(extra))
    return Server(proc, port)


# The built-in tiny model, named (no --model serves the default SmolLM2); a small KV pool and
# context: start-up stays fast and every request stays bounded.
DEFAULT_ARGS = ("--model", "pagoda-tiny", "--num-kv-pages", "512", "--max-model-len", "512", "--max-num-seqs", "64")


@contextlib.contextmanager
def served_client(tmp_path: Path, *args: str, timeout: float = 60):
    """The official openai client of a `pagoda serve` started with `args` (stopped after)."""
    import openai

    srv = launch(tmp_path, *args)
    try:
        with openai.OpenAI(base_url=srv.base_url, api_key="unused", max_retries=0, timeout=timeout) as c:
            yield c
    finally:
        srv.proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = launch(tmp_path_factory.mktemp("serve"), *DEFAULT_ARGS)
    yield srv
    srv.proc.stop()


def scrape(url: str, per_engine: bool = False) -> dict[str, float]:
    """GET /metrics as {sample name with sorted labels except model_name: value}: the pod's figure,
    summed over the engine cores' `engine` label, or with `per_engine` one sample per core."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert "engine" in s.labels, s  # every engine series names its core
            dropped = {"model_name"} if per_engine else {"model_name", "engine"}
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in dropped)
            key = f"{s.name}{{{labels}}}" if labels else s.name
            samples[key] = samples.get(key, 0.0) + s.value
    return samples


def child_pids(pid: int) -> list[int]:
    """Live direct children of `pid` (Linux /proc), e.g. the engine core under `pagoda serve`."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may contain spaces, so split after ")".
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def process_name(pid: int) -> str:
    """/proc/PID/comm: `pagoda-api-<i>` for an API server process under `--api-server-count`."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def core_pids(server_pid: int) -> list[int]:
    """The engine core processes of a `pagoda serve` (its spawned children, not multiprocessing's
    resource tracker nor the API server processes): one per data-parallel rank."""
    pids = []
    for pid in child_pids(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and not process_name(pid).startswith("pagoda-api-"):
            pids.append(pid)
    return pids


def api_server_pids(server_pid: int) -> list[int]:
    """The API server processes of a `pagoda serve --api-server-count N`, in start order."""
    return sorted(p for p in child_pids(server_pid) if process_name(p).startswith("pagoda-api-"))


def core_pid(server_pid: int) -> int:
    """The engine core process of a `pagoda serve` with one core."""
    pids = core_pids(server_pid)
    if len(pids) != 1:
        raise LookupError(f"{len(pids)} engine core processes under pid {server_pid}, expected one")
    return pids[0]


def kill_core_and_wait_unhealthy(srv: Server, pid: int, timeout: float = 10) -> dict:
    """SIGKILL one engine core of `srv`; wait for /health to answer 503 and return its body."""
    import os
    import signal
    import time

    import httpx

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while (health := httpx.get(f"{srv.url}/health", timeout=10)).status_code != 503:
        assert time.monotonic() < deadline, "a dead core left /health at 200"
        time.sleep(0.1)
    return health.json()

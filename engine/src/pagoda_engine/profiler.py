"""The torch-profiler settings of an engine (vLLM's `--profiler-config`), checked where they enter.

    pagoda serve --profiler-config '{"profiler": "torch", "torch_profiler_dir": "./traces"}'
    LLM(model, profiler_config={"profiler": "torch", "torch_profiler_dir": "./traces"})

With a config the server registers POST /start_profile and /stop_profile, and every rank of every
engine core writes its own trace into the directory (`worker/profiler.py`). The field names and
defaults are vLLM's (ignore_frontend's aside); the fields vLLM has that Pagoda cannot honour are
refused, never ignored.
`ProfileSession` is one start ... stop of an engine core: it counts the core's steps for
delay_iterations and max_iterations. No torch here: the CLI checks a config before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, fields

from pagoda_engine.errors import PagodaError
from pagoda_engine.json_config import json_object


class InvalidProfilerConfigError(PagodaError, ValueError):
    """A profiler config that names an unknown field, or a value Pagoda cannot honour."""


class ProfilerStateError(PagodaError):
    """/start_profile while profiling, /stop_profile while not, or either without a profiler config."""


class ProfilerAlreadyError(ProfilerStateError):
    """The profiler already is as asked: running at a start, stopped at a stop."""


@dataclass(frozen=True)
class ProfilerConfig:
    profiler: str | None = None  # "torch"; None: off. (vLLM's "cuda", for nsys, is not built.)
    torch_profiler_dir: str = ""  # absolute after `parse_profiler_config`
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    # vLLM dumps a key-averages table; Pagoda writes the summary (`*.summary.txt`) beside each trace.
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    # vLLM also profiles its API process unless this is set; Pagoda profiles the engine cores'
    # ranks only, so only true is accepted (and is the default here).
    ignore_frontend: bool = True
    delay_iterations: int = 0  # engine steps after /start_profile before recording starts
    max_iterations: int = 0  # steps recorded before the profiler stops by itself (0: until /stop_profile)

    @property
    def enabled(self) -> bool:
        return self.profiler is not None


_FIELDS = {f.name: f for f in fields(ProfilerConfig)}
_TYPE_WORDS = {"bool": "true or false", "int": "a whole number >= 0", "str": "a string", "str | None": "a string"}


def parse_profiler_config(value) -> ProfilerConfig:
    """A checked ProfilerConfig from JSON text, a dict or a ProfilerConfig (None or `profiler`
    null: off, as vLLM's default). Raises InvalidProfilerConfigError (a ValueError) naming the
    field that is wrong."""
    if value is None:
        return ProfilerConfig()
    if not isinstance(value, ProfilerConfig):
        value = ProfilerConfig(**json_object(value, InvalidProfilerConfigError, flag="--profiler-config",
                                             name="profiler config", known=_FIELDS))
    return _checked(value)


def _checked(config: ProfilerConfig) -> ProfilerConfig:
    for f in fields(config):
        given = getattr(config, f.name)
        ok = {"bool": isinstance(given, bool),
              "int": isinstance(given, int) and not isinstance(given, bool) and given >= 0,
              "str": isinstance(given, str),
              "str | None": given is None or isinstance(given, str)}[f.type]
        if not ok:
            raise InvalidProfilerConfigError(f"profiler config: {f.name} must be {_TYPE_WORDS[f.type]}, got {given!r}")
    if not config.enabled:
        if config != ProfilerConfig():
            raise InvalidProfilerConfigError('profiler config: set "profiler": "torch" to use the other fields')
        return config
    if config.profiler != "torch":
        raise InvalidProfilerConfigError(f"profiler config: profiler must be \"torch\", got {config.profiler!r} "
                                         "(vLLM's CUDA profiler is not built in Pagoda)")
    if not config.torch_profiler_dir.strip():
        raise InvalidProfilerConfigError('profiler config: torch_profiler_dir must be set when profiler is "torch"')
    if "://" in config.torch_profiler_dir:
        raise InvalidProfilerConfigError(f"profiler config: torch_profiler_dir must be a local directory, got "
                                         f"{config.torch_profiler_dir!r}")
    if not config.ignore_frontend:
        raise InvalidProfilerConfigError("profiler config: ignore_frontend must be true: Pagoda profiles the engine "
                                         "cores' ranks, not the API server process")
    path = os.path.abspath(os.path.expanduser(config.torch_profiler_dir))
    return dataclasses.replace(config, torch_profiler_dir=path)


def profile_tag() -> str:
    """The tag every rank's files of one profile share: the start time in milliseconds."""
    return str(time.time_ns() // 1_000_000)


class ProfileSession:
    """One start ... stop of an engine core's profiling: every rank's profiler starts after
    `delay_iterations` steps and stops after `max_iterations` recorded steps or at `stop()`,
    whichever comes first; the files written stay listed until `stop()` returns them."""

    def __init__(self, executor, config: ProfilerConfig, tag: str, dp_rank: int):
        self.executor, self.config, self.tag, self.dp_rank = executor, config, tag, dp_rank
        self.steps_to_skip = config.delay_iterations
        self.recorded_steps = 0
        self.recording = False
        self.finished = False
        self.written: list[str] = []
        if self.steps_to_skip == 0:
            self._start()

    def before_step(self) -> None:
        if self.recording or self.finished:
            return
        if self.steps_to_skip == 0:
            self._start()
        else:
            self.steps_to_skip -= 1

    def after_step(self) -> None:
        if self.recording and self.config.max_iterations:
            self.recorded_steps += 1
            if self.recorded_steps >= self.config.max_iterations:
                self._stop()

    def stop(self) -> list[str]:
        """Stop the ranks still recording; every trace and summary path of this session."""
        if self.recording:
            self._stop()
        self.finished = True
        return self.written

    def _start(self) -> None:
        self.executor.collective_rpc("start_profile", self.config, self.tag, self.dp_rank)
        self.recording = True

    def _stop(self) -> None:
        self.recording, self.finished = False, True
        for paths in self.executor.collective_rpc("stop_profile"):
            self.written.extend(paths)

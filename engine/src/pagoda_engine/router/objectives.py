"""The priority of each `InferenceObjective` a request may name (`x-llm-d-inference-objective`),
for the Endpoint Picker's flow control: from `--objective NAME=PRIORITY` flags, or from
`--objectives-file PATH`, a JSON object `{"<objective>": <priority>, ...}`.

The file is what the operator writes into a ConfigMap from the cluster's InferenceObjectives
(llm-d.ai/v1alpha2) whose poolRef names the service's InferencePool, mounted into the picker's
pod. It is re-read when it changes, checked at most once per `check_interval_s` on the request
path: kubelet swaps a mounted ConfigMap's files atomically, so a new or changed objective takes
effect within about a second of the kubelet's sync, without a restart. A file that turns
unreadable or malformed keeps the priorities read last (logged); one that is so at start-up
refuses the start (exit 2). An objective named nowhere, or no objective, has priority 0 (the
InferenceObjective API's default).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pagoda_engine.json_config import json_object
from pagoda_engine.router.reread import Reread

log = logging.getLogger("pagoda.epp")


class ObjectivesError(ValueError):
    """--objective / --objectives-file cannot be used: the picker refuses to start (exit 2)."""


def parse_flags(items: list[str]) -> dict[str, int]:
    """`--objective NAME=PRIORITY` flags as a map."""
    out = {}
    for item in items:
        name, eq, priority = item.partition("=")
        if not eq or not name.strip():
            raise ObjectivesError(f"--objective {item!r}: expected NAME=PRIORITY")
        try:
            out[name.strip()] = int(priority)
        except ValueError:
            raise ObjectivesError(f"--objective {item!r}: expected NAME=PRIORITY with a whole number") from None
    return out


def parse_file_text(text: str, where: str) -> dict[str, int]:
    """An objectives file's JSON object, checked: names map to whole numbers."""
    value = json_object(text, ObjectivesError, flag=f"--objectives-file {where}", name=f"--objectives-file {where}")
    for name, priority in value.items():
        if not name or not isinstance(priority, int) or isinstance(priority, bool):
            raise ObjectivesError(f"--objectives-file {where}: {name!r}: the priority must be a whole number, "
                                  f"got {priority!r}")
    return value


def _signature(path: Path) -> tuple:
    st = path.stat()  # follows a mounted ConfigMap's links, so a swap changes the inode
    return st.st_ino, st.st_size, st.st_mtime_ns


class Objectives:
    """Priorities by objective name: fixed (`flags`) or kept current from `path`."""

    def __init__(self, flags: dict[str, int] | None = None, path: str | None = None,
                 check_interval_s: float = 1.0, clock=time.monotonic):
        self._fixed = dict(flags or {})
        self._file = None
        if path is not None:
            where = Path(path)
            try:
                self._file = Reread(f"--objectives-file {path}", lambda: _signature(where),
                                    lambda: parse_file_text(where.read_text(encoding="utf-8"), path),
                                    check_interval_s, clock, errors=(OSError, UnicodeDecodeError, ObjectivesError),
                                    on_change=lambda old, new: log.info("objectives re-read from %s: %s", path, new))
            except (OSError, UnicodeDecodeError) as e:
                raise ObjectivesError(f"--objectives-file {path}: cannot read it ({e})") from None

    def priority(self, name: str | None) -> int:
        priorities = self._file.current() if self._file is not None else self._fixed
        return priorities.get(name or "", 0)

"""Files a router process reads at start and keeps current while it runs (`--api-key-file`,
`--objectives-file`): kubelet swaps a mounted Secret's or ConfigMap's files atomically, so what
they hold changes under a running process, which takes it up within about a second, without a
restart."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger("pagoda.router")


class Reread:
    """What `load()` makes of some files, kept current. `current()` looks at them at most once per
    `check_interval_s` (on the request path) and loads again when `signature()` (what changes
    when a file is written, replaced, added or removed) changed; `on_change(old, new)` hears of
    each new load. A look or a load that raises one of `errors` keeps what was loaded last
    (logged as `what`); at construction it raises."""

    def __init__(self, what: str, signature: Callable[[], Any], load: Callable[[], Any],
                 check_interval_s: float = 1.0, clock=time.monotonic,
                 errors: tuple[type[Exception], ...] = (OSError, UnicodeDecodeError),
                 on_change: Callable[[Any, Any], None] | None = None):
        self.what = what
        self._signature_of, self._load, self._errors, self._on_change = signature, load, errors, on_change
        self.check_interval_s, self._clock = check_interval_s, clock
        self._signature = signature()
        self.value = load()
        self._checked = clock()

    def current(self) -> Any:
        now = self._clock()
        if now - self._checked < self.check_interval_s:
            return self.value
        self._checked = now
        try:
            signature = self._signature_of()
            if signature == self._signature:
                return self.value
            new = self._load()
        except self._errors as e:
            # Mid-swap or briefly unreadable: what was read last stays in force until it reads again.
            log.warning("%s: cannot read it (%s); keeping what was read before", self.what, e)
            return self.value
        old, self.value, self._signature = self.value, new, signature
        if self._on_change is not None:
            self._on_change(old, new)
        return new

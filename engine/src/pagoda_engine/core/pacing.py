"""When to schedule the next step under async scheduling, so that requests arriving while a step
runs join the step that follows it (`EngineCore.launch_delay`, `--step-launch-pacing`).

Async scheduling schedules and launches step N+1 as soon as step N is launched, so that the host's
work hides behind the device's. A request that arrives while N+1 runs then misses N+2, which was
scheduled early in N+1, and waits for N+3: a whole step more than it must. With pacing, the core's
loop keeps reading its input while N+1 runs and schedules N+2 only when N+1 is about to end (its
predicted end less a margin for the host's own work), so an arrival waits for the rest of the step
in flight only. It applies only while nothing is left waiting after a schedule: a backlog is
admitted as fast as the pool allows, and then late scheduling could only idle the device.

The prediction is a least-squares line of a step's device time against its scheduled tokens,
with older steps weighing less (`_FORGET`), fitted on the steps the host actually waited for (a
step already done when resolved gives only an upper bound). The margin grows when a launch finds
the step in flight already done (the device idled: it was late) and shrinks slowly otherwise.
"""

from __future__ import annotations

_FORGET = 0.95  # weight of the fit's past at each new step
_MIN_STEPS = 8  # steps observed before any prediction
_MARGIN_S = (0.002, 0.004, 0.030)  # the margin: least, first, most
_GROW, _SHRINK = 1.5, 0.98


class LaunchPacer:
    def __init__(self) -> None:
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._steps = 0
        self.margin = _MARGIN_S[1]
        self.late_launches = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A step of `num_tokens` took `seconds` on the device."""
        x, y = float(num_tokens), seconds
        self._n = _FORGET * self._n + 1.0
        self._x = _FORGET * self._x + x
        self._y = _FORGET * self._y + y
        self._xx = _FORGET * self._xx + x * x
        self._xy = _FORGET * self._xy + x * y
        self._steps += 1

    def predict(self, num_tokens: int) -> float | None:
        """Device seconds of a step of `num_tokens`; None until enough steps were seen."""
        if self._steps < _MIN_STEPS:
            return None
        var = self._n * self._xx - self._x * self._x
        if var <= 1e-9 * max(self._n * self._xx, 1.0):  # every step the same size: their mean
            return self._y / self._n
        slope = (self._n * self._xy - self._x * self._y) / var
        slope = max(slope, 0.0)
        return max((self._y - slope * self._x) / self._n + slope * num_tokens, 0.0)

    def launched(self, late: bool) -> None:
        """A step was launched; `late`: the step before it had already ended (the device idled)."""
        if late:
            self.late_launches += 1
            self.margin = min(self.margin * _GROW + 0.001, _MARGIN_S[2])
        else:
            self.margin = max(self.margin * _SHRINK, _MARGIN_S[0])

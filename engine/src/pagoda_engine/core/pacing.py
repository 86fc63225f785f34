"""When to schedule the next step under async scheduling, so that a request arriving while a
decode step runs joins the step that follows it (`StepsInFlight.launch_delay`,
`--step-launch-pacing`).

Async scheduling schedules and launches step N+1 as soon as step N is launched, so that the host's
work hides behind the device's. A request that arrives while N+1 runs then misses N+2, which was
scheduled as N+1 began, and waits for N+3: a whole step more than it must. At a few requests a
second that step is a sixth of the time to the first token (a 7 ms decode step against a 25 ms
prefill of 1,024 tokens on an H100). With pacing the core's loop keeps reading its input while
N+1 runs and schedules N+2 only when N+1 is about to end, so an arrival waits for the rest of the
step in flight only.

Pacing applies only where the end is predictable and nothing is lost by waiting:
- the step in flight decodes only (one token a row): a CUDA graph of a given row count runs in
  nearly the same time step after step. A step with prompt tokens is never waited on: pacing
  that predicted those too, from a fit on tokens, idled the device where its errors ran long
  (docs/benchmarks.md, 2026-11-24).
- no request is waiting: a backlog is admitted as fast as the pool allows.

The prediction for a row count is a moving average of the device time of decode steps of that
many rows, taken only from steps the host waited for (a step already done when resolved gives an
upper bound only, and learning from it would lengthen every later wait). The next step is
scheduled that long after the step in flight started, less the host's own time to schedule and
launch a decode step (its moving average plus three moving mean deviations: the host's time varies
more than the device's) and a slack. The slack grows when a paced launch finds the step in
flight already ended (the device idled) and shrinks slowly otherwise.
"""

from __future__ import annotations

_AVERAGE = 0.25  # weight of a new observation in the moving averages
_MIN_OBSERVED = 3  # decode steps of a row count seen before predicting it
_SLACK_S = (0.0002, 0.001, 0.004)  # the slack: least, first, most
_HOST_DEVIATIONS = 3.0  # the host's time counted as its mean plus this many mean deviations
_GROW, _SHRINK = 2.0, 0.97
_MAX_ROW_COUNTS = 4096  # row counts remembered (a server's max_num_seqs is at most this in practice)


class LaunchPacer:
    def __init__(self) -> None:
        self._device_s: dict[int, tuple[int, float]] = {}  # rows -> (steps seen, mean device seconds)
        self.host_s = 0.0  # mean host seconds to schedule and launch a decode step
        self.host_dev_s = 0.0  # their mean absolute deviation
        self.slack = _SLACK_S[1]
        self.paced_launches = 0
        self.late_launches = 0

    def observe_decode(self, rows: int, seconds: float) -> None:
        """A decode-only step of `rows` rows ran `seconds` on the device (the host waited for it)."""
        seen, mean = self._device_s.get(rows, (0, seconds))
        if seen == 0 and len(self._device_s) >= _MAX_ROW_COUNTS:
            return
        self._device_s[rows] = (seen + 1, mean + _AVERAGE * (seconds - mean) if seen else seconds)

    def observe_host(self, seconds: float) -> None:
        """The host took `seconds` to schedule and launch a decode step."""
        if self.host_s == 0.0:
            self.host_s = seconds
            return
        self.host_dev_s += _AVERAGE * (abs(seconds - self.host_s) - self.host_dev_s)
        self.host_s += _AVERAGE * (seconds - self.host_s)

    def lead(self, rows: int) -> float | None:
        """How long after a decode step of `rows` rows starts on the device the next one should be
        scheduled; None: not known yet (schedule at once)."""
        seen, mean = self._device_s.get(rows, (0, 0.0))
        if seen < _MIN_OBSERVED:
            return None
        return mean - self.host_s - _HOST_DEVIATIONS * self.host_dev_s - self.slack

    def launched(self, late: bool) -> None:
        """A paced launch; `late`: the step in flight had already ended (the device idled)."""
        self.paced_launches += 1
        if late:
            self.late_launches += 1
            self.slack = min(self.slack * _GROW, _SLACK_S[2])
        else:
            self.slack = max(self.slack * _SHRINK, _SLACK_S[0])

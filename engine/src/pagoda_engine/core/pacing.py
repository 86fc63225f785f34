"""When to schedule the next step under async scheduling, so that a request arriving while a
decode step runs joins the step that follows it (`EngineCore.launch_delay`,
`--step-launch-pacing`).

Async scheduling schedules and launches step N+1 as soon as step N is launched, so that the host's
work hides behind the device's. A request that arrives while N+1 runs then misses N+2, which was
scheduled as N+1 began, and waits for N+3: a whole step more than it must. At a few requests a
second that step is a sixth of the time to the first token (a 7 ms decode step against a 25 ms
prefill of 1,024 tokens on an H100). With pacing the core's loop keeps reading its input while
N+1 runs and schedules N+2 only when N+1 is about to end, so an arrival waits for the rest of the
step in flight only.

Pacing applies only where the end can be known and nothing is lost by waiting:
- the step in flight decodes only (one token a row): a CUDA graph of a given row count runs in
  nearly the same time step after step, so its end is predicted (below);
- or the step in flight has prompt tokens and its launch recorded timing events before each
  layer (`runner.StepProgress`): its end is read from the device as it runs, from the layers done
  so far (`prompt_lead`). The eighth session's pacing predicted those steps from a fit on tokens,
  and its errors idled the device (benchmarks.md, "Step launch pacing"); events do not guess. Such
  a step lasts tens to hundreds of milliseconds under load (an 8,192-token step about 150 ms on an
  H100), and without pacing every prompt that arrives during it waits for it and then for the whole
  step launched after it.
- after a decode step, only where no request is waiting: a backlog is admitted as fast as the
  pool allows. After a step with prompt tokens the launch waits for its measured end either way
  (the step launched after it starts when it ends however early that launch is, so waiting only
  lets more arrivals in).

The prediction for a row count is a moving average of the device time of decode steps of that
many rows, taken only from steps the host waited for (a step already done when resolved gives an
upper bound only, and learning from it would lengthen every later wait). The next step is
scheduled that long after the step in flight started, less the host's own time to schedule and
launch a decode step (its moving average plus three moving mean deviations: the host's time varies
more than the device's) and a slack. The slack grows when a paced launch finds the step in
flight already ended (the device idled) and shrinks slowly otherwise.

After a step with prompt tokens, the next step is scheduled when the rest of the step in flight
is down to the host's time to schedule and launch a step with prompt tokens (moving average plus
three mean deviations: the next step may be one, and an eager launch of a long prompt takes 10-25
ms) and a slack of its own. That slack grows when the step in flight had ended before the launch
after it was done.
"""

from __future__ import annotations

_AVERAGE = 0.25  # weight of a new observation in the moving averages
_MIN_OBSERVED = 3  # decode steps of a row count seen before predicting it
_SLACK_S = (0.0002, 0.001, 0.004)  # the slack: least, first, most
_PROMPT_SLACK_S = (0.001, 0.002, 0.020)  # after a step with prompt tokens: least, first, most
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
        # After steps with prompt tokens (`prompt_lead`).
        self.prompt_host_s = 0.0  # mean host seconds to schedule and launch a step with prompt tokens
        self.prompt_host_dev_s = 0.0
        self.prompt_slack = _PROMPT_SLACK_S[1]
        self.prompt_paced_launches = 0
        self.prompt_late_launches = 0

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

    def observe_prompt_host(self, seconds: float) -> None:
        """The host took `seconds` to schedule and launch a step with prompt tokens."""
        if self.prompt_host_s == 0.0:
            self.prompt_host_s = seconds
            return
        self.prompt_host_dev_s += _AVERAGE * (abs(seconds - self.prompt_host_s) - self.prompt_host_dev_s)
        self.prompt_host_s += _AVERAGE * (seconds - self.prompt_host_s)

    def prompt_lead(self) -> float | None:
        """How long before a step with prompt tokens ends on the device the next one should be
        scheduled; None: no such launch seen yet (schedule at once)."""
        if self.prompt_host_s == 0.0:
            return None
        return self.prompt_host_s + _HOST_DEVIATIONS * self.prompt_host_dev_s + self.prompt_slack

    def prompt_launched(self, late: bool) -> None:
        """A launch paced by a step with prompt tokens; `late`: that step had ended before the
        launch was done (the device may have idled)."""
        self.prompt_paced_launches += 1
        if late:
            self.prompt_late_launches += 1
            self.prompt_slack = min(self.prompt_slack * _GROW, _PROMPT_SLACK_S[2])
        else:
            self.prompt_slack = max(self.prompt_slack * _SHRINK, _PROMPT_SLACK_S[0])

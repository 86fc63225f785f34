"""The engine core's steps launched and not yet resolved (`StepsInFlight`), under async
scheduling or pipeline parallelism.

With `async_scheduling` the core keeps one step in flight (`step`): each `step_async()` schedules
and launches the next step first, then resolves the one in flight and returns its outputs, so the
host's scheduling and input building overlap the device's work (vLLM's async scheduling, SGLang's
overlap scheduler). Outputs thus come one call late; a request that finished in the resolved step
has one surplus token in the launched one, which is dropped. Where the device has finished the
step in flight before the next launch has ended, its outputs leave from between two of that
launch's layers (early publishing, `_EarlyPublish`); with step launch pacing the core's loop waits
to schedule until the decode step in flight is about to end (`launch_delay`, `core.pacing`).

Under pipeline parallelism the core keeps a batch queue instead (vLLM V1's `step_with_batch_queue`):
up to `pipeline_parallel_size` batches in flight, so that the first stage works on one while the
later stages work on the ones before; `step_with_batch_queue()` launches a batch while the queue
has room (and returns nothing yet), and otherwise resolves the oldest. A request waits for its
batch before it is scheduled again.

A step after one that sampled for a request with penalties or a grammar waits for that step's
tokens first (`_must_resolve_first`): such steps run synchronously. So do the steps of speculative
decoding: the drafts of a request need its last token, and a step that verified drafts must be
resolved before the request's next step is planned (how many drafts it kept decides where that
step starts). With `disable_by_batch_size`, steps above it stay asynchronous.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from pagoda_engine.core.pacing import LaunchPacer
from pagoda_engine.core.scheduler import SchedulerOutput
from pagoda_engine.core.step_runner import LaunchedStep
from pagoda_engine.messages import EngineCoreOutput, EngineCoreOutputs

logger = logging.getLogger(__name__)


class StepsInFlight:
    """The steps `core` (an `EngineCore`: its scheduler, runner and KV pool, and how it applies a
    resolved step) has launched and not yet resolved."""

    def __init__(self, core, step_launch_pacing: bool, max_batches: int):
        self.core = core
        self.step: LaunchedStep | None = None  # async scheduling: launched, not yet resolved
        self._launched_at = self._resolved_at = 0.0  # when it was launched; when the step before it was resolved
        # Step launch pacing (`launch_delay`, core.pacing); `config.resolve_for_device` refused it
        # wherever no step is in flight on a device to time.
        self.pacer = LaunchPacer() if step_launch_pacing else None
        self._paced = False  # the core's loop waited for `launch_delay` before this step
        # Where outputs go as soon as a step has ended, before the step after it is launched in
        # full (`publish_early`); None: with the step after it.
        self.early_sink: Callable[[EngineCoreOutputs], None] | None = None
        self.early_publishes = 0  # steps whose outputs left between two layers of the next one's launch
        # Pipeline parallelism: launched batches, oldest first, at most one per stage.
        self.max_batches = max_batches
        self.batch_queue: deque[LaunchedStep] = deque()

    def log_totals(self) -> None:
        """At the core's close: what pacing and early publishing did."""
        pacer = self.pacer
        if pacer is not None and pacer.paced_launches:
            logger.info("step launch pacing: %d paced launches, %d found the device idle (slack %.2f ms)",
                        pacer.paced_launches, pacer.late_launches, pacer.slack * 1e3)
        if self.early_publishes:
            logger.info("early publishing: %d steps' outputs left during the next step's launch", self.early_publishes)

    def publish_early(self, sink: Callable[[EngineCoreOutputs], None]) -> None:
        """Under async scheduling where steps run ahead of the host, hand a step's outputs to
        `sink` as soon as the device has finished it, from between two layers of the next step's
        launch, instead of returning them from `step_async()` after that launch (`_EarlyPublish`)."""
        self.early_sink = sink
        if self.core.device_facts.steps_run_ahead:
            self.core.runner.record_ends = True  # `LaunchedStep.has_ended` answers only from its end event

    def step_async(self) -> EngineCoreOutputs:
        """Launch the next step, then resolve the one in flight (async scheduling)."""
        core = self.core
        prev, self.step = self.step, None
        outputs: list[EngineCoreOutput] = []
        spec = core.scheduler.spec
        if prev is not None and (_must_resolve_first(prev) or prev.verifying
                                 or (spec is not None and spec.active(len(core.scheduler.running)))):
            outputs = core.apply(prev.sched, prev.resolve(), advanced=True)
            prev = None
        started = time.monotonic()
        sched = core.scheduler.schedule()
        prev_launched = self._launched_at
        paced, self._paced = self._paced, False
        pacer = self.pacer
        if not sched.is_empty:
            decode = pacer is not None and _decode_only(sched)
            if paced and decode and prev is not None:
                pacer.launched(late=bool(prev.has_ended()))
            early = None
            if prev is not None and self.early_sink is not None and prev.ended is not None:
                early = _EarlyPublish(self, prev, sched, prev_launched)
            self.step = core.runner.launch(sched, prev, layer_hook=early)
            self._launched_at = time.monotonic()
            if decode:
                pacer.observe_host(self._launched_at - started - (early.spent_s if early is not None else 0.0))
            if early is not None and early.published:
                prev = None  # resolved, applied and published between two of this step's layers
            else:
                core.scheduler.advance(sched)
            core.kv.launch_stores()
        elif prev is None:
            core.check_compiled(idle=True)
            core.idle_for_offload()
        if prev is not None:
            outputs = self.resolve(prev, prev_launched)
        return EngineCoreOutputs(outputs=outputs, stats=core.get_stats(sched.num_tokens))

    def resolve(self, prev: LaunchedStep, prev_launched: float) -> list[EngineCoreOutput]:
        """Wait for the step in flight (launched at `prev_launched`), time it and apply its tokens;
        the scheduler has advanced the step launched after it."""
        core, pacer = self.core, self.pacer
        waited = pacer is not None and prev.has_ended() is False  # else its device time is a bound only
        result = prev.resolve()
        # Its device time is at most from its launch, or from the end of the step before it.
        now = time.monotonic()
        device_s = now - max(prev_launched, self._resolved_at)
        core.kv.observe_step(prev.sched.num_tokens, device_s)
        if waited and _decode_only(prev.sched):
            pacer.observe_decode(len(prev.sched.scheduled), device_s)
        self._resolved_at = now
        return core.apply(prev.sched, result, advanced=True)

    def launch_delay(self) -> float:
        """Seconds the core's loop may go on reading its input before the next `step()` (step
        launch pacing, `core.pacing`): until the decode step in flight is about to end, so that a
        request arriving meanwhile joins the next step. 0: step now (pacing off, no decode step
        in flight, requests waiting, or no prediction yet)."""
        step = self.step
        if (self.pacer is None or step is None or self.core.scheduler.waiting or not _decode_only(step.sched)
                or step.has_ended() is not False):
            return 0.0
        lead = self.pacer.lead(len(step.sched.scheduled))
        if lead is None:
            return 0.0
        delay = max(self._launched_at, self._resolved_at) + lead - time.monotonic()
        if delay <= 0.0:
            return 0.0
        self._paced = True
        return delay

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Launch a batch while the queue has room; else (or with nothing to launch) resolve the oldest."""
        core = self.core
        launched = 0
        if len(self.batch_queue) < self.max_batches:
            sched = core.scheduler.schedule(skip_in_flight=True)
            if not sched.is_empty:
                self.batch_queue.append(core.runner.launch(sched))
                core.scheduler.advance(sched)
                core.kv.launch_stores()
                launched = sched.num_tokens
                if len(self.batch_queue) < self.max_batches:
                    return EngineCoreOutputs(outputs=[], stats=core.get_stats(launched))
            elif not self.batch_queue:
                core.idle_for_offload()
        outputs: list[EngineCoreOutput] = []
        if self.batch_queue:
            oldest = self.batch_queue.popleft()
            outputs = core.apply(oldest.sched, oldest.resolve(), advanced=True)
        return EngineCoreOutputs(outputs=outputs, stats=core.get_stats(launched))


class _EarlyPublish:
    """The attention backend's layer hook while a step is launched under async scheduling. An
    eager step of a thousand prompt tokens takes 10-25 ms of host time to launch, and the step in
    flight (a decode, say) often ends well before that: its tokens would wait for the whole launch.
    At the first layer where the step in flight has ended, the hook advances the scheduler past the
    step being launched (as the core does after a launch), resolves and applies the step in flight
    and hands its outputs to the core's sink; the launch then goes on. Not in the last two layers,
    where the launch is about to end anyway. It costs the device nothing while the host launches
    ahead of it; a host slower than the device leaves it idle for the publish (about a millisecond)."""

    def __init__(self, steps: StepsInFlight, prev: LaunchedStep, sched: SchedulerOutput, prev_launched: float):
        self.steps, self.prev, self.sched, self.prev_launched = steps, prev, sched, prev_launched
        self.last_layer = steps.core.num_layers - 3
        self.published = False
        self.spent_s = 0.0  # host time the publish took out of the launch

    def __call__(self, layer_id: int) -> None:
        if self.published or layer_id > self.last_layer or not self.prev.has_ended():
            return
        started = time.monotonic()
        self.published = True
        steps = self.steps
        steps.core.scheduler.advance(self.sched)
        steps.early_sink(EngineCoreOutputs(outputs=steps.resolve(self.prev, self.prev_launched)))
        steps.early_publishes += 1
        self.spent_s = time.monotonic() - started


def _decode_only(sched: SchedulerOutput) -> bool:
    """One token a row: a decode step (or, rarely, a prompt's one-token last chunk, which costs the
    same), the steps pacing predicts."""
    return all(s.num_new_tokens == 1 for s in sched.scheduled)


def _must_resolve_first(step: LaunchedStep) -> bool:
    """Penalties count a request's output tokens on the host, and a grammar's next mask needs the
    token it sampled last: a step after one that sampled for such a request must wait for its
    tokens (it runs synchronously)."""
    return any(r.grammar is not None or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
               or p.presence_penalty != 0.0 for r, p in ((r, r.sampling_params) for r in step.sample_reqs))

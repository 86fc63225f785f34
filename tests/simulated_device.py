"""A simulated device for an `EngineCore` on CPU, for tests of what the core does while steps run
on a GPU (step launch pacing, early publishing): each step takes a fixed device time, starting
when the step before it ends; its `ended` event fires then, and reading its tokens waits for it.
A step with prompt tokens can also be given a slow host launch (a sleep before each layer's
attention), as an eager GPU step of a long prompt has."""

import time

from pagoda_engine.core.engine_core import EngineCore


class SimulatedEvent:
    def __init__(self, at: float):
        self.at = at

    def query(self) -> bool:
        return time.monotonic() >= self.at


def simulate_device(core: EngineCore, log: list, step_s: float, prompt_layer_host_s: float = 0.0) -> None:
    """Give `core`'s runner the device. `log` gets, per step, a dict: launch_start, launch_end (host),
    start, end (device), request_ids and slow (whether the launch was given the slow host time)."""
    runner, free_at = core.runner, [0.0]
    launch = runner.launch

    def launch_on_device(sched, prev=None, layer_hook=None):
        slow = prompt_layer_host_s > 0 and any(s.num_new_tokens > 1 for s in sched.scheduled)

        def hook(layer_id: int) -> None:
            if slow:
                time.sleep(prompt_layer_host_s)
            if layer_hook is not None:
                layer_hook(layer_id)

        launch_start = time.monotonic()
        step = launch(sched, prev, layer_hook=hook)
        launch_end = time.monotonic()
        start = max(launch_end, free_at[0])
        free_at[0] = end = start + step_s
        step.ended = SimulatedEvent(end)
        log.append(dict(launch_start=launch_start, launch_end=launch_end, start=start, end=end,
                        request_ids=[s.request.request_id for s in sched.scheduled], slow=slow))
        resolve = step.resolve

        def resolve_on_device():
            time.sleep(max(0.0, end - time.monotonic()))
            return resolve()

        step.resolve = resolve_on_device
        return step

    runner.launch = launch_on_device

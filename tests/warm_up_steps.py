"""The warm-up an engine core runs before it serves (`core.warm_up.warm_up_steps`; CPU engines
skip it, so tests run it by hand), with the token count of every step it launched."""

from pagoda_engine.core.warm_up import warm_up_steps


def warm_up_step_tokens(core) -> list[int]:
    """Run `core`'s warm-up; the tokens of each step it launched, in order."""
    launch, step_tokens = core.runner.launch, []

    def counting_launch(sched, *args, **kwargs):
        step_tokens.append(sched.num_tokens)
        return launch(sched, *args, **kwargs)

    core.runner.launch = counting_launch
    try:
        warm_up_steps(core)
    finally:
        del core.runner.launch
    return step_tokens

"""The warm-up an engine core runs before it serves (`EngineCore._warm_up_steps`; CPU engines skip
it, so tests run it by hand), with the token count of every step it launched."""


def warm_up_step_tokens(core) -> list[int]:
    """Run `core`'s warm-up; the tokens of each step it launched, in order."""
    launch, step_tokens = core.runner.launch, []

    def counting_launch(sched, *args, **kwargs):
        step_tokens.append(sched.num_tokens)
        return launch(sched, *args, **kwargs)

    core.runner.launch = counting_launch
    try:
        core._warm_up_steps()
    finally:
        del core.runner.launch
    return step_tokens

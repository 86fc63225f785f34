"""Step launch pacing's model (`core.pacing.LaunchPacer`): the fit of a step's device time
against its tokens, and the margin that keeps the device from idling. The pacing itself runs on
CUDA (steps end on the device); the serve benchmark measures its effect."""

import pytest

from pagoda_engine.core.pacing import LaunchPacer


def test_no_prediction_before_enough_steps():
    pacer = LaunchPacer()
    for _ in range(7):
        pacer.observe(100, 0.01)
    assert pacer.predict(100) is None
    pacer.observe(100, 0.01)
    assert pacer.predict(100) == pytest.approx(0.01)  # every step the same size: their mean


def test_the_fit_follows_the_tokens_and_forgets_the_past():
    pacer = LaunchPacer()
    for tokens in (64, 512, 2048, 8192) * 5:
        pacer.observe(tokens, 0.005 + 2e-5 * tokens)  # 5 ms a step, 20 us a token
    assert pacer.predict(1024) == pytest.approx(0.005 + 2e-5 * 1024, rel=1e-6)
    for tokens in (64, 512, 2048, 8192) * 40:
        pacer.observe(tokens, 0.010 + 1e-5 * tokens)  # the device got another load
    assert pacer.predict(1024) == pytest.approx(0.010 + 1e-5 * 1024, rel=0.02)


def test_a_step_never_takes_negative_time():
    pacer = LaunchPacer()
    for tokens, seconds in ((10, 0.05), (20, 0.04), (30, 0.03)) * 4:  # noisy: longer steps faster
        pacer.observe(tokens, seconds)
    assert pacer.predict(1000) >= 0.0 and pacer.predict(0) >= 0.0


def test_the_margin_grows_after_a_late_launch_and_shrinks_back():
    pacer = LaunchPacer()
    first = pacer.margin
    pacer.launched(late=True)
    assert pacer.margin > first and pacer.late_launches == 1
    for _ in range(10):
        pacer.launched(late=True)
    assert pacer.margin == pytest.approx(0.030)  # capped
    for _ in range(1000):
        pacer.launched(late=False)
    assert pacer.margin == pytest.approx(0.002)  # floored

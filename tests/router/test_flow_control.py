"""The Endpoint Picker's flow control, driven directly: held requests leave by priority band, in
turn between fairness ids, one per opening; a full queue sheds the lowest band first; a request
held too long is shed."""

from __future__ import annotations

import asyncio

from pagoda_engine.router.flow_control import GO, SHED, TIMED_OUT, FlowControl


def test_release_order_priority_then_fair_turns_then_arrival():
    async def scenario():
        flow, room, order = FlowControl(capacity=16, timeout=10), {"free": 0}, []

        def has_room():
            return room["free"] > 0

        async def request(name, priority, fairness):
            outcome = await flow.admit(priority, fairness, has_room)
            order.append((name, outcome))
            room["free"] -= 1  # placed: one opening used
            flow.wake()

        tasks = []
        for name, priority, fairness in (("low-a1", 0, "a"), ("low-a2", 0, "a"), ("low-b1", 0, "b"),
                                         ("high-a1", 5, "a"), ("high-a2", 5, "a"), ("high-b1", 5, "b")):
            tasks.append(asyncio.create_task(request(name, priority, fairness)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        assert order == [] and len(flow) == 6  # no room: all held
        for _ in range(6):  # one opening at a time
            room["free"] += 1
            flow.wake()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    assert [name for name, _ in order] == ["high-a1", "high-b1", "high-a2", "low-a1", "low-b1", "low-a2"]
    assert all(outcome == GO for _, outcome in order)


def test_a_full_queue_sheds_the_lowest_priority_and_a_long_wait_times_out():
    async def scenario():
        flow = FlowControl(capacity=2, timeout=0.3)
        never = lambda: False  # noqa: E731
        low1 = asyncio.create_task(flow.admit(0, "", never))
        low2 = asyncio.create_task(flow.admit(0, "", never))
        await asyncio.sleep(0.01)
        high = asyncio.create_task(flow.admit(9, "", never))  # full: pushes out the newest low
        await asyncio.sleep(0.01)
        assert low2.done() and low2.result() == SHED and not low1.done()
        assert await flow.admit(0, "", never) == SHED  # nothing lower than it to push out
        return await low1, await high

    assert asyncio.run(scenario()) == (TIMED_OUT, TIMED_OUT)


def test_a_caller_that_gives_up_leaves_the_queue():
    """A held request whose caller is cancelled (the gateway closed its stream) gives its place up:
    it counts no more, and the next release goes to the one behind it."""
    async def scenario():
        flow, room = FlowControl(capacity=2, timeout=10), {"free": False}
        gone = asyncio.create_task(flow.admit(0, "a", lambda: room["free"]))
        waiting = asyncio.create_task(flow.admit(0, "b", lambda: room["free"]))
        await asyncio.sleep(0.01)
        assert len(flow) == 2
        gone.cancel()
        await asyncio.sleep(0.01)
        assert len(flow) == 1
        room["free"] = True
        flow.wake()
        return await waiting

    assert asyncio.run(scenario()) == GO

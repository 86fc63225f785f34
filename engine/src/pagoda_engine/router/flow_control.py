"""The Endpoint Picker's flow control: while every pod a request may go to is saturated (its
waiting queue at `--queue-limit`), the request is held here instead of being sent to a full pod.

Held requests leave in order of priority band (the `InferenceObjective` the request names, by
`x-llm-d-inference-objective`, mapped to its priority with `--objective NAME=PRIORITY`), and
within a band in turn between fairness ids (`x-llm-d-inference-fairness-id`), first come first
within one id. The queue is bounded: a request arriving at a full queue pushes out the newest of
the lowest band below its own, or is itself shed if none is lower (429); a held request that
waited `timeout` seconds is shed too. One request is released at a time: the released one is
placed (and counted against its pod) before the next is looked at, so a wake-up never sends more
than there is room for.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

GO, SHED, TIMED_OUT = "go", "shed", "timed out"


@dataclass(eq=False)
class _Held:
    priority: int
    fairness: str
    has_room: Callable[[], bool]
    seq: int
    future: asyncio.Future = field(default=None)


class FlowControl:
    def __init__(self, capacity: int, timeout: float):
        self.capacity, self.timeout = capacity, timeout
        # band -> fairness id -> its held requests, oldest first; the ids in turn order (least recently served first)
        self._bands: dict[int, OrderedDict[str, deque[_Held]]] = {}
        self._count = 0
        self._seq = itertools.count()
        self._releasing = False

    def __len__(self) -> int:
        return self._count

    async def admit(self, priority: int, fairness: str, has_room: Callable[[], bool]) -> str:
        """Hold the request until there is room for it (GO), or it is shed (SHED, TIMED_OUT)."""
        held = _Held(priority, fairness, has_room, next(self._seq), asyncio.get_running_loop().create_future())
        if self._count >= self.capacity:
            victim = self._lowest()
            if victim is None or victim.priority >= priority:
                return SHED
            self._remove(victim)
            victim.future.set_result(SHED)
        self._bands.setdefault(priority, OrderedDict()).setdefault(fairness, deque()).append(held)
        self._count += 1
        self.wake()
        try:
            return await asyncio.wait_for(asyncio.shield(held.future), self.timeout)
        except asyncio.TimeoutError:
            if not held.future.done():
                self._remove(held)
                return TIMED_OUT
            return held.future.result()
        except asyncio.CancelledError:
            # The caller gave up (the gateway's stream closed): its place goes to the others.
            if not held.future.done():
                self._remove(held)
            raise

    def wake(self) -> None:
        """Release the first held request in order that has room now (call again once it is placed)."""
        for band in sorted(self._bands, reverse=True):
            ids = self._bands[band]
            for fairness in list(ids):
                queue = ids[fairness]
                if queue and queue[0].has_room():
                    held = queue[0]
                    self._remove(held)
                    ids_after = self._bands.get(band)
                    if ids_after is not None and fairness in ids_after:
                        ids_after.move_to_end(fairness)  # its turn is used: the other ids of the band go first
                    held.future.set_result(GO)
                    return

    def _lowest(self) -> _Held | None:
        """The newest request of the lowest band."""
        if not self._bands:
            return None
        band = self._bands[min(self._bands)]
        return max((q[-1] for q in band.values() if q), key=lambda h: h.seq, default=None)

    def _remove(self, held: _Held) -> None:
        ids = self._bands[held.priority]
        queue = ids[held.fairness]
        queue.remove(held)
        self._count -= 1
        if not queue:
            del ids[held.fairness]
        if not ids:
            del self._bands[held.priority]

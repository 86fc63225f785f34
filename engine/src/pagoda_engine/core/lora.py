"""Multi-LoRA in the engine core: which adapters the engine knows, which device slot holds which,
and the slot of each request in a step.

The core owns the names and the slots; every rank holds the weights (`worker/model/lora.py`):
`add` has every rank read and check an adapter into its host memory (so a bad adapter is refused
when it is added, naming the reason), and a step whose request runs under an adapter that no slot
holds loads it into the least recently used slot that no request of the step needs. The
scheduler admits a request only while the running requests' distinct adapters stay within the
slots (`Scheduler`'s `max_loras`), so such a slot always exists.

Removing an adapter forgets its name (new requests naming it are refused) and its host copies; the
requests already running under it keep their slot until they finish, so none is lost.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable

from pagoda_engine.config import EngineConfig
from pagoda_engine.errors import InvalidRequestError
from pagoda_engine.lora import LoRAAdapterError, LoRARequest
from pagoda_engine.worker.executor import Executor

logger = logging.getLogger(__name__)


class LoRASlots:
    def __init__(self, config: EngineConfig, executor: Executor):
        mc = config.model
        self.executor = executor
        self.max_loras = mc.max_loras
        self.known: dict[str, LoRARequest] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.free_slots = list(range(self.max_loras))
        executor.collective_rpc("init_lora", mc.max_loras, mc.max_lora_rank, mc.max_cpu_loras or mc.max_loras,
                                config.scheduler.max_num_batched_tokens)

    def add(self, request: LoRARequest) -> None:
        """Know `request`'s adapter; every rank reads and checks it. Raises LoRAAdapterError; an
        adapter already known under this name is kept (the same path) or refused (another)."""
        have = self.known.get(request.lora_name)
        if have is not None:
            if have.lora_path != request.lora_path:
                raise LoRAAdapterError(f"LoRA adapter {request.lora_name!r} is already loaded from "
                                       f"{have.lora_path!r}; unload it first")
            return
        refused = [reason for reason in self.executor.collective_rpc("add_lora", request) if reason is not None]
        if refused:
            self.executor.collective_rpc("remove_lora", request.lora_name)  # the ranks that took it
            raise LoRAAdapterError(refused[0])
        self.known[request.lora_name] = request
        logger.info("LoRA adapter %r added (%s)", request.lora_name, request.lora_path)

    def remove(self, name: str) -> bool:
        """Forget adapter `name`; False when it was not known."""
        if self.known.pop(name, None) is None:
            return False
        self.executor.collective_rpc("remove_lora", name)
        logger.info("LoRA adapter %r removed", name)
        return True

    def check(self, request: LoRARequest) -> None:
        """A request's adapter, added if new (the offline `LLM` names adapters by path).
        Raises InvalidRequestError."""
        try:
            self.add(request)
        except LoRAAdapterError as e:
            raise InvalidRequestError(str(e), param="model") from None

    def slots_for(self, adapters: Iterable[LoRARequest | None]) -> list[int]:
        """The device slot of each of a step's requests' adapters (-1: the base model), loading
        the ones no slot holds into slots the step does not need."""
        adapters = list(adapters)
        needed = {a.lora_name for a in adapters if a is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step names {len(needed)} adapters, more than --max-loras {self.max_loras}")
        out = []
        for a in adapters:
            if a is None:
                out.append(-1)
                continue
            slot = self.resident.get(a.lora_name)
            if slot is None:
                slot = self._take_slot(needed)
                self.executor.collective_rpc("load_lora_slot", slot, a)
                self.resident[a.lora_name] = slot
            self.resident.move_to_end(a.lora_name)
            out.append(slot)
        return out

    def _take_slot(self, needed: set[str]) -> int:
        if self.free_slots:
            return self.free_slots.pop(0)
        for name in self.resident:  # least recently used first
            if name not in needed:
                return self.resident.pop(name)
        raise RuntimeError("no LoRA slot is free")  # the scheduler's bound makes this unreachable


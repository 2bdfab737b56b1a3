"""The engine core's LoRA control: loading and unloading adapters, and filling device slots.

``EngineLoRA`` answers the ``load_lora`` / ``unload_lora`` utility calls, resolves a request's
adapter name to its load id (``core/lora_slots.py``), and before every pass has the workers load the
slots the scheduler gave out (``before_pass``) and forget drained adapters. Workers are reached only
through the executor's ``collective_rpc`` (``ModelRunner.add_lora`` / ``load_lora_slot`` /
``remove_lora``).
"""

from __future__ import annotations

import logging
import time

from tokenmill.config import LoRAConfig
from tokenmill.core.lora_slots import LoRAAdapters, LoRASlotTable
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.executor.base import Executor
from tokenmill.protocol import UtilityValue

logger = logging.getLogger(__name__)


class EngineLoRA:
    """Adapters by name, slots by adapter, for one engine core (see the module docstring)."""

    def __init__(self, config: LoRAConfig, executor: Executor, scheduler: Scheduler) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.adapters = LoRAAdapters()
        self.slots = LoRASlotTable(config.max_loras)
        scheduler.lora_slots = self.slots
        self.num_loads = 0
        self.load_seconds_total = 0.0  # reading adapters (load_lora) and filling slots
        for name, path in config.lora_modules.items():
            self.load(name, path, 0)

    def resolve(self, request: Request, lora_name: str) -> None:
        """Give ``request`` the id of adapter ``lora_name``'s current load; ValueError if not loaded."""
        request.lora_id = self.adapters.lora_id(lora_name)

    def load(self, name: str, path: str, user_id: int) -> dict[str, UtilityValue]:
        """Read and check the adapter (every worker); it can be used as soon as this returns.
        Loading a name again from the same folder changes nothing."""
        adapter = self.adapters.new_load(name, path, user_id)
        if adapter is None:
            current = self.adapters.by_name[name]
            return {"lora_name": name, "lora_id": current.lora_id, "already_loaded": True}
        started = time.perf_counter()
        try:
            ranks = self.executor.collective_rpc("add_lora", [adapter.lora_id, path])
        except RuntimeError as exc:  # a worker process reports its ValueError as a RuntimeError
            raise ValueError(str(exc)) from None
        seconds = time.perf_counter() - started
        self.adapters.register(adapter)
        self.num_loads += 1
        self.load_seconds_total += seconds
        logger.info("LoRA adapter %s (rank %s) loaded from %s in %.3f s", name, ranks[0], path, seconds)
        return {"lora_name": name, "lora_id": adapter.lora_id, "rank": int(ranks[0]), "load_seconds": seconds}  # type: ignore[call-overload]

    def unload(self, name: str) -> dict[str, UtilityValue]:
        """Stop serving ``name``: its waiting requests fail with an error saying so (their outputs go
        out with the next step), its running requests finish with the adapter, which the workers
        forget once they have (``before_pass``)."""
        adapter = self.adapters.unload(name)
        scheduler = self.scheduler
        waiting = [
            r.request_id
            for r in scheduler.requests.values()
            if r.lora_id == adapter.lora_id and r not in scheduler.running
        ]
        for request_id in waiting:
            output = scheduler.fail_request(request_id, f"LoRA adapter {name!r} was unloaded")
            if output is not None:
                scheduler._pending_outputs.append(output)
        running = sum(r.lora_id == adapter.lora_id for r in scheduler.running)
        self.before_pass()  # forget it now if nothing runs with it
        return {"lora_name": name, "failed_waiting": len(waiting), "finishing_running": running}

    def before_pass(self) -> None:
        """Have the workers load the slots the scheduler gave out, and forget drained adapters."""
        for adapter in self.adapters.drained(r.lora_id for r in self.scheduler.requests.values()):
            self.executor.collective_rpc("remove_lora", [adapter.lora_id])
            self.slots.release(adapter.lora_id)
        for slot, lora_id in self.slots.take_loads():
            seconds = self.executor.collective_rpc("load_lora_slot", [slot, lora_id])[0]
            self.load_seconds_total += float(seconds)  # type: ignore[arg-type]

    def stats(self) -> dict[str, UtilityValue]:
        """Gauges and counters for ``kv_stats`` and the server's metrics."""
        running = {r.lora_id for r in self.scheduler.running if r.lora_id is not None}
        waiting = {r.lora_id for r in self.scheduler.requests.values() if r.lora_id is not None} - running
        return {
            "lora_loaded_adapters": len(self.adapters.by_name),
            "lora_running_adapters": len(running),
            "lora_waiting_adapters": len(waiting),
            "lora_slot_swaps": self.slots.num_swaps,
            "lora_load_seconds_total": self.load_seconds_total,
            "lora_loads": self.num_loads,
        }

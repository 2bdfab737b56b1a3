"""The engine core's side of LoRA: adapter names, and which adapter sits in which device slot.

``LoRAAdapters`` maps adapter names to the id of their current load. Every load gets a fresh id, and
that id is part of the radix cache's namespace (``KVCacheManager.namespace``), so KV computed under
one adapter never serves another, nor the base, nor a reload of the same name from new weights. An
unloaded adapter drains: new requests cannot name it, its waiting requests fail, its running ones
finish, and the workers forget it once none is left.

``LoRASlotTable`` is the scheduler's rule for slots: a step never needs more distinct adapters than
there are slots. The adapters of running requests hold their slots; a waiting request is admitted
only if its adapter holds a slot or a slot is free of running adapters (the least recently used
such slot is taken), otherwise it is skipped this step like a request whose grammar compiles. The
slots newly given are collected for the engine core, which has the workers load them
(``Executor.collective_rpc("load_lora_slot")``) before the step runs. Integers only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class LoadedAdapter:
    """One load of an adapter: its name, folder, the caller's integer id, and the engine's id."""

    name: str
    path: str
    user_id: int
    lora_id: int


class LoRAAdapters:
    """Adapter names -> their current load (see the module docstring)."""

    def __init__(self) -> None:
        self.by_name: dict[str, LoadedAdapter] = {}
        self.draining: dict[int, LoadedAdapter] = {}
        self._next_id = 1

    def new_load(self, name: str, path: str, user_id: int) -> LoadedAdapter | None:
        """A new load of ``name`` from ``path`` (not yet registered: ``register`` once the workers
        accepted it), or None when ``name`` is already loaded from ``path``; ValueError when the name
        is taken by another folder."""
        if not name:
            raise ValueError("a LoRA adapter needs a name")
        current = self.by_name.get(name)
        if current is not None:
            if current.path == path:
                return None
            raise ValueError(
                f"LoRA adapter {name!r} is already loaded from {current.path!r}; unload it first"
            )
        adapter = LoadedAdapter(name=name, path=path, user_id=user_id, lora_id=self._next_id)
        self._next_id += 1
        return adapter

    def register(self, adapter: LoadedAdapter) -> None:
        self.by_name[adapter.name] = adapter

    def lora_id(self, name: str) -> int:
        """The id of adapter ``name``'s current load; ValueError when it is not loaded."""
        adapter = self.by_name.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.by_name)) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")
        return adapter.lora_id

    def unload(self, name: str) -> LoadedAdapter:
        """Stop accepting requests for ``name``; it drains (``drained``). ValueError if unknown."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        self.draining[adapter.lora_id] = adapter
        return adapter

    def drained(self, in_use: Iterable[int | None]) -> list[LoadedAdapter]:
        """The draining adapters no request uses any more (forgotten here; the caller tells the
        workers)."""
        if not self.draining:
            return []
        used = set(in_use)
        done = [a for lora_id, a in self.draining.items() if lora_id not in used]
        for adapter in done:
            del self.draining[adapter.lora_id]
        return done


class LoRASlotTable:
    """Which adapter id holds each of ``num_slots`` device slots (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        self.holder: list[int | None] = [None] * num_slots
        self._last_use = [0] * num_slots
        self._clock = 0
        self._loads: list[tuple[int, int]] = []
        self.num_swaps = 0  # slots given to an adapter that was not in them

    def slot_of(self, lora_id: int | None) -> int:
        """The slot ``lora_id`` holds, -1 for the base model (None)."""
        if lora_id is None:
            return -1
        return self.holder.index(lora_id)

    def fits(self, lora_id: int | None, running: Iterable[int | None]) -> bool:
        """Whether a request of ``lora_id`` may join the running requests (of adapters ``running``)
        without a step needing more adapters than slots."""
        if lora_id is None or lora_id in self.holder:
            return True
        used = set(running)
        return any(holder is None or holder not in used for holder in self.holder)

    def acquire(self, lora_id: int | None, running: Iterable[int | None]) -> int:
        """The slot for ``lora_id`` (which must ``fit``), given it if it holds none: the least
        recently used slot that no running request's adapter holds (empty ones first)."""
        if lora_id is None:
            return -1
        self._clock += 1
        if lora_id in self.holder:
            slot = self.holder.index(lora_id)
        else:
            used = set(running)
            free = [s for s, h in enumerate(self.holder) if h is None or h not in used]
            slot = min(free, key=lambda s: (self.holder[s] is not None, self._last_use[s]))
            self.holder[slot] = lora_id
            self._loads.append((slot, lora_id))
            self.num_swaps += 1
        self._last_use[slot] = self._clock
        return slot

    def release(self, lora_id: int) -> None:
        """Empty the slot of an adapter the workers forgot."""
        for slot, holder in enumerate(self.holder):
            if holder == lora_id:
                self.holder[slot] = None

    def take_loads(self) -> list[tuple[int, int]]:
        """The ``(slot, lora_id)`` assignments made since the last call, for the workers."""
        loads, self._loads = self._loads, []
        return loads

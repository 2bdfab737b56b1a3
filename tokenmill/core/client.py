"""The engine client seam: how a frontend talks to an engine core, wherever the core runs.

``EngineCoreClient`` is the one interface. Two implementations:

- ``InProcClient`` (here) wraps an ``EngineCore`` in this process; ``LLM`` uses it. Its coroutines
  never suspend, so synchronous code drives them with ``complete_now`` and needs no event loop.
- ``ZmqClient`` (``core/zmq_client.py``) speaks ``tokenmill.protocol`` messages to an engine process
  (``core/engine_proc.py``) over ZMQ; the server's ``AsyncLLM`` uses it.
- ``DPClient`` (``core/dp_client.py``) spreads request groups over several ``ZmqClient``s (data
  parallelism) with a dispatch policy and fans utility calls out.

Both end in the same engine-core functions: admission is ``EngineCore.add_request_group`` (all or
none, ``overloaded`` when a waiting queue is full), aborts are ``EngineCore.abort_requests`` and
utility calls are ``EngineCore.call_utility``. So whatever a client adds (fanning out over several
engines, say) changes where requests go, never what admission or a utility call means.

The server may import this module and nothing else of the core: it re-exports the helpers that
start and stop an engine process. It imports nothing heavy (no torch), so ``tokenmill serve`` can
start the engine before it imports the rest of the server.
"""

from __future__ import annotations

import os
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tokenmill.core.dp_spawn import spawn_engines, stop_engines
from tokenmill.core.engine_proc import (
    EngineProcessHandle,
    freeze_startup_objects,
    make_socket_dir,
    spawn_engine_process,
    stop_engine_process,
)
from tokenmill.protocol import AddResult, EngineCoreOutputs, EngineCoreRequest, EngineReady, UtilityValue

if TYPE_CHECKING:
    from tokenmill.core.engine_core import EngineCore

__all__ = [
    "EngineCoreClient",
    "EngineDeadError",
    "EngineProcessHandle",
    "InProcClient",
    "UtilityCallError",
    "complete_now",
    "freeze_startup_objects",
    "make_socket_dir",
    "spawn_engine_process",
    "spawn_engines",
    "stop_engine_process",
    "stop_engines",
]

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine is gone (it exited, faulted or is shutting down): no request can be served any more."""


class UtilityCallError(RuntimeError):
    """A utility call failed in the engine core (an unknown method, one not supported yet, or the
    method raised); the message is the engine's ``TypeName: message``."""


class EngineCoreClient(Protocol):
    """A frontend's handle on one engine core (or, behind the same methods, several).

    Contract:

    - ``add_request_group(requests)`` admits the n siblings of one user request all or none and
      answers with one ``AddResult``: ``error`` None when all were admitted; else none was, and
      ``overloaded`` (with ``retry_after`` seconds) tells a full waiting queue from a request that
      can never run. ``cut_step=True`` asks the engine to cut the step in flight short for them
      (``step_control.py``); it does nothing unless ``can_cut_steps``. No output of a request comes
      before its group's answer.
    - ``abort_requests(ids)`` ends requests with reason ``abort`` and frees their blocks; unknown or
      finished ids are ignored. It never waits.
    - ``get_outputs()`` returns the next step's outputs (with gauges; ``outputs`` may be empty).
    - ``call_utility(method, args)`` runs one of ``protocol.UTILITY_METHODS`` (``reset_prefix_cache``
      → ``{"success": bool}``, ``kv_stats`` → block counts and queue lengths) between steps. Room is
      kept for ``update_weights``, ``pause``/``resume``, ``load_lora``/``unload_lora``
      (``protocol.RESERVED_UTILITY_METHODS``): until implemented they fail with "not supported yet".
      Any failure raises ``UtilityCallError``.
    - Once the engine is gone every call raises ``EngineDeadError`` (``abort_requests`` excepted);
      ``dead_reason`` says why. ``shutdown()`` stops the engine and waits for it; it is idempotent.
    - ``info`` is the engine's ``EngineReady``: context window, KV blocks, block size, pid.
    """

    info: EngineReady

    @property
    def can_cut_steps(self) -> bool: ...

    @property
    def is_alive(self) -> bool: ...

    @property
    def dead_reason(self) -> str | None: ...

    async def add_request_group(
        self, requests: list[EngineCoreRequest], *, cut_step: bool = False
    ) -> AddResult: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    async def get_outputs(self) -> EngineCoreOutputs: ...

    async def call_utility(
        self, method: str, args: dict[str, UtilityValue] | None = None
    ) -> dict[str, UtilityValue]: ...

    async def shutdown(self, timeout: float = 10.0) -> None: ...


class InProcClient:
    """``EngineCoreClient`` over an ``EngineCore`` in this process: each call runs at once, in the
    caller's thread, and ``get_outputs`` runs one engine step. It never dies on its own; a step
    that raises propagates to the caller."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = EngineReady(
            max_model_len=core.max_model_len,
            num_blocks=core.kv_manager.num_blocks,
            block_size=core.kv_manager.block_size,
            pid=os.getpid(),
            kv_cache_bytes=core.executor.kv_cache_bytes,
        )

    @property
    def can_cut_steps(self) -> bool:
        return False  # the caller's thread runs the step: none is ever in flight while it calls

    @property
    def is_alive(self) -> bool:
        return True

    @property
    def dead_reason(self) -> str | None:
        return None

    async def add_request_group(
        self, requests: list[EngineCoreRequest], *, cut_step: bool = False
    ) -> AddResult:
        return self.core.add_request_group(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    async def get_outputs(self) -> EngineCoreOutputs:
        return self.core.step()

    async def call_utility(
        self, method: str, args: dict[str, UtilityValue] | None = None
    ) -> dict[str, UtilityValue]:
        try:
            return self.core.call_utility(method, args)
        except Exception as exc:
            # The same error, with the same message, as the engine process gives.
            raise UtilityCallError(f"{type(exc).__name__}: {exc}") from exc

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core's executor (its worker processes, if any); the engine core is kept."""
        self.core.shutdown()

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work (only an in-process caller, which drives the steps, needs it)."""
        return self.core.has_unfinished_requests()


def complete_now(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that finishes without suspending, such as every ``InProcClient``
    method: lets synchronous code use the one async client interface without an event loop (and
    inside one, as in a notebook). Raises RuntimeError if the coroutine suspends."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("an engine client call waited for something; await it in an event loop instead")

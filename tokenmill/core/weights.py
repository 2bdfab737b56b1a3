"""The engine core's side of weight updates in place: the weight version and the stale cache.

RL trainers push new weights into the rollout engine after each training step (``update_weights_*``
utility calls). The tensors travel to every worker through ``Executor.collective_rpc`` into the
``ModelRunner``'s public methods (``worker/weight_update.py`` checks and loads them). Here, around
that call:

- The step under way ends first (``settle``: a step paused between layers, or the second pass of a
  split step, runs to the end), so no step mixes two sets of weights.
- A successful update starts a new weight *generation*: the radix namespace includes it
  (``KVCacheManager.start_weight_generation``), so KV computed under the old weights is never
  matched again, and the tree's old blocks are freed at once. Requests in flight go on under the
  new weights from their next token and publish nothing more to the cache.
- The weight *version* (a string, ``get_weight_version``) is the update's ``weight_version`` when
  given, else the generation's number ("default" before any update). Every output token carries
  the version of the step that produced it (``EngineCoreOutput.weight_version``).

A failed update (ValueError from the worker: unknown name, wrong shape, missing group) changes
nothing: the old weights, version and cache stay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tokenmill.core.kv.manager import KVCacheManager
from tokenmill.executor.base import Executor
from tokenmill.protocol import UtilityBytes, UtilityValue

INITIAL_WEIGHT_VERSION = "default"
UtilityArgs = dict[str, UtilityValue]
UtilityHandler = Callable[[UtilityArgs], dict[str, UtilityValue]]


class EngineWeights:
    """Weight updates, the weight version and weight-group membership for one engine core.

    Contract: each ``update_*`` handler either loads every tensor on every worker and starts a new
    generation (returning ``success``, ``num_tensors`` and the new ``weight_version``), or raises
    ValueError having changed nothing. ``settle`` is called before anything reaches a worker;
    ``abort_all`` ends every request in flight first when the call asks (``abort_all_requests``).
    """

    def __init__(
        self,
        executor: Executor,
        kv_manager: KVCacheManager,
        settle: Callable[[], None],
        abort_all: Callable[[], int],
    ) -> None:
        self.executor = executor
        self.kv = kv_manager
        self.settle = settle
        self.abort_all = abort_all
        self.version = INITIAL_WEIGHT_VERSION
        self.generation = 0
        self.num_updates = 0
        self.last_update_seconds = 0.0

    def handlers(self) -> dict[str, UtilityHandler]:
        return {
            "update_weights_from_disk": self.update_from_disk,
            "update_weights_from_tensor": self.update_from_tensor,
            "init_weights_update_group": self.init_group,
            "update_weights_from_distributed": self.update_from_distributed,
            "destroy_weights_update_group": self.destroy_group,
            "get_weight_version": lambda args: {"weight_version": self.version},
        }

    # ------------------------------------------------------------------ the utility methods

    def update_from_disk(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        """``model_path``: a safetensors model folder of the same architecture."""
        path = _required(args, "model_path", str, "update_weights_from_disk")
        return self._update("update_weights_from_disk", [path], args)

    def update_from_tensor(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        """``serialized_named_tensors``: one safetensors blob (``UtilityBytes``) of named tensors."""
        blob = args.get("serialized_named_tensors")
        if not isinstance(blob, UtilityBytes):
            raise ValueError("update_weights_from_tensor needs serialized_named_tensors: safetensors bytes")
        return self._update("update_weights_from_tensor", [blob.data], args)

    def init_group(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        """Join the trainer's broadcast group: ``master_address``, ``master_port``, ``rank_offset``,
        ``world_size``, ``group_name``, ``backend`` (gloo on CPU, nccl on GPU)."""
        what = "init_weights_update_group"
        call = [
            _required(args, "master_address", str, what),
            _required(args, "master_port", int, what),
            _required(args, "rank_offset", int, what),
            _required(args, "world_size", int, what),
            _optional(args, "group_name", str, what) or "weight_update_group",
            _optional(args, "backend", str, what) or "gloo",
        ]
        self.settle()
        self._rpc("init_weights_update_group", call)
        return {"success": True, "message": f"joined weight update group {call[4]!r}"}

    def destroy_group(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        name = _optional(args, "group_name", str, "destroy_weights_update_group") or "weight_update_group"
        self._rpc("destroy_weights_update_group", [name])
        return {"success": True}

    def update_from_distributed(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        """``names``, ``dtypes``, ``shapes``: the tensors rank 0 broadcasts next, in order."""
        what = "update_weights_from_distributed"
        names = _string_list(args, "names", what)
        dtypes = _string_list(args, "dtypes", what)
        shapes = args.get("shapes")
        if not isinstance(shapes, list) or not all(
            isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape) for shape in shapes
        ):
            raise ValueError(f"{what} needs shapes: a list of lists of non-negative ints")
        group = _optional(args, "group_name", str, what)
        return self._update(what, [names, dtypes, shapes, group], args)

    # ------------------------------------------------------------------ internals

    def _update(self, method: str, call: list[Any], args: UtilityArgs) -> dict[str, UtilityValue]:
        version = _optional(args, "weight_version", str, method)
        self.settle()
        if _optional(args, "abort_all_requests", bool, method):
            self.abort_all()  # SGLang's option: no request runs across the update
        started = time.perf_counter()
        counts = self._rpc(method, call)
        self.generation += 1
        self.version = version if version is not None else str(self.generation)
        freed = self.kv.start_weight_generation(self.generation)
        self.num_updates += 1
        self.last_update_seconds = time.perf_counter() - started
        return {
            "success": True,
            "message": f"loaded {counts[0]} tensors",
            "num_tensors": int(counts[0]),
            "weight_version": self.version,
            "num_freed_cache_blocks": freed,
        }

    def _rpc(self, method: str, call: list[Any]) -> list[Any]:
        """``collective_rpc``; a worker's ValueError (passed as text by a worker process) stays one."""
        try:
            return self.executor.collective_rpc(method, call)
        except RuntimeError as exc:
            _, marker, message = str(exc).partition("failed: ValueError: ")
            if marker:
                raise ValueError(message) from None
            raise


def _required(args: UtilityArgs, name: str, kind: type, what: str) -> Any:
    value = _optional(args, name, kind, what)
    if value is None:
        raise ValueError(f"{what} needs {name} ({kind.__name__})")
    return value


def _optional(args: UtilityArgs, name: str, kind: type, what: str) -> Any:
    value = args.get(name)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{what}: {name} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _string_list(args: UtilityArgs, name: str, what: str) -> list[str]:
    value = args.get(name)
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{what} needs {name}: a list of strings")
    return [str(item) for item in value]

"""Pausing generation and releasing memory, for RL trainers that share the engine's machine.

Between rollout phases a trainer pauses the engine (``pause_generation``), pushes new weights and
lets it go on (``continue_generation``); colocated on one machine it also takes the engine's memory
for a while (``release_memory_occupation`` / ``resume_memory_occupation``). The modes of a pause
(SGLang's):

- ``abort``: every request in flight ends now with its partial output and finish reason ``abort``.
- ``in_place``: running requests stay frozen with their KV; after an update they go on under the
  new weights from their next token (partial rollouts; each token's weight version tells which).
- ``retract``: running requests give their KV back (preempted, ``core/preemption.py``) and wait at
  the front of their class; on continue they are recomputed under the weights of that time.

While paused or released the engine takes no step; requests that arrive meanwhile are admitted and
wait (as SGLang's do) until ``continue_generation``. A pause first lets the step under way end
(``EngineCore.settle_step``), so nothing is half computed. Memory can only be released while no
request holds KV blocks (pause with ``abort`` or ``retract`` first); the prefix cache is emptied
then, as its blocks' contents go with the KV tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.core.preemption import preempt
from tokenmill.core.weights import UtilityArgs, UtilityHandler
from tokenmill.protocol import EngineCoreOutput, FinishReason, UtilityValue

if TYPE_CHECKING:
    from tokenmill.core.engine_core import EngineCore

PAUSE_MODES = ("abort", "in_place", "retract")
MEMORY_TAGS = ("kv_cache", "weights")


class PauseControl:
    """Whether the engine may take steps, and the utility methods that change it.

    Contract: ``blocks_steps`` is True from a ``pause_generation`` until ``continue_generation``,
    and while any memory is released; the engine core then returns no outputs but those queued by
    these methods (the ``abort`` mode's finished requests). Every method leaves each block free,
    held by a request or held by the tree (``KVCacheManager.check_integrity``).
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.paused = False
        self.mode: str | None = None
        self.released: set[str] = set()

    @property
    def blocks_steps(self) -> bool:
        return self.paused or bool(self.released)

    def handlers(self) -> dict[str, UtilityHandler]:
        return {
            "pause_generation": self.pause,
            "continue_generation": self.resume,
            "release_memory_occupation": self.release_memory,
            "resume_memory_occupation": self.resume_memory,
        }

    def pause(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        """``mode``: abort (the default, as SGLang's), in_place or retract."""
        mode = args.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode must be one of {', '.join(PAUSE_MODES)}; got {mode!r}")
        core = self.core
        core.settle_step()
        scheduler = core.scheduler
        num_aborted = num_retracted = 0
        if mode == "abort":
            num_aborted = self.abort_all()
        elif mode == "retract":
            # From the last to the first, each to the front: the waiting order keeps the running one.
            for request in reversed(list(scheduler.running)):
                preempt(request, scheduler.running, scheduler.kv, scheduler.waiting)
                num_retracted += 1
            scheduler.num_preemptions_total += num_retracted
        self.paused, self.mode = True, str(mode)
        return {
            "success": True,
            "mode": str(mode),
            "num_aborted": num_aborted,
            "num_retracted": num_retracted,
            "num_frozen": scheduler.num_running,
        }

    def abort_all(self) -> int:
        """End every request in flight with reason ``abort`` (their outputs so far stand); returns
        how many. The step under way must have been settled."""
        aborted = self.core.abort_requests(list(self.core.scheduler.requests))
        self.core.queue_outputs(
            [
                EngineCoreOutput(request_id=i, new_token_ids=[], finish_reason=FinishReason.ABORT)
                for i in aborted
            ]
        )
        return len(aborted)

    def resume(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        was_paused, self.paused, self.mode = self.paused, False, None
        return {"success": True, "was_paused": was_paused}

    def release_memory(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        """``tags``: which of kv_cache and weights to free (default both)."""
        tags = _tags(args, "release_memory_occupation")
        core = self.core
        core.settle_step()
        if not core.kv_manager.all_free_or_cached():
            raise ValueError(
                "release_memory_occupation needs every request's KV back: "
                "pause_generation with mode 'abort' or 'retract' first"
            )
        core.kv_manager.reset_prefix_cache()
        core.executor.collective_rpc("release_memory", ["kv_cache" in tags, "weights" in tags])
        self.released |= set(tags)
        return {"success": True, "released": ",".join(sorted(self.released))}

    def resume_memory(self, args: UtilityArgs) -> dict[str, UtilityValue]:
        tags = _tags(args, "resume_memory_occupation")
        self.core.executor.collective_rpc("resume_memory", ["kv_cache" in tags, "weights" in tags])
        self.released -= set(tags)
        return {"success": True, "released": ",".join(sorted(self.released))}


def _tags(args: UtilityArgs, what: str) -> list[str]:
    tags = args.get("tags")
    if tags is None:
        return list(MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or any(t not in MEMORY_TAGS for t in tags):
        raise ValueError(f"{what}: tags must be a non-empty list of {', '.join(MEMORY_TAGS)}")
    return [str(t) for t in tags]

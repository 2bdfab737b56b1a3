"""Waiting-queue policies: which waiting request the scheduler admits next.

A policy only orders the waiting queue; admission limits, budgets and preemption stay in the
scheduler. Preempted requests re-enter at the front so they resume before newer work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tokenmill.core.request import Request


class WaitingPolicy:
    """Interface: a queue of waiting requests with a policy-defined order."""

    name = "base"

    def add(self, request: Request) -> None:
        raise NotImplementedError

    def prepend(self, request: Request) -> None:
        """Put a preempted request back so it is admitted before requests that never ran."""
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        raise NotImplementedError

    def ordered(self) -> Iterator[Request]:
        """Waiting requests, best first. The scheduler may stop iterating at any point."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError


class FCFSPolicy(WaitingPolicy):
    """First come, first served (preempted requests first)."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def ordered(self) -> Iterator[Request]:
        return iter(list(self._queue))

    def __len__(self) -> int:
        return len(self._queue)


POLICIES: dict[str, type[WaitingPolicy]] = {"fcfs": FCFSPolicy}


def make_policy(name: str) -> WaitingPolicy:
    """The policy registered under ``name``; ValueError lists the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None

"""Waiting-queue policies: which waiting request the scheduler admits next.

A policy only orders the waiting queue; admission limits, budgets and preemption stay in the
scheduler. Preempted requests re-enter at the front so they resume before newer work. The scheduler
keeps one policy queue per scheduling class (service tier and priority, ``core/tiers.py``), so each
policy here orders the requests of one class: ``fcfs``, ``lpm`` (longest cached prefix) or ``vtc``
(per-user fairness, ``core/fairness.py``). Fairness and prefix locality pull in different
directions, so ``vtc`` and ``lpm`` are alternatives, not a combination.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from tokenmill.core.request import Request

if TYPE_CHECKING:
    from tokenmill.core.fairness import VirtualTokenCounters

# Cached-prefix length of a waiting request in tokens, computed without side effects.
PrefixLengthFn = Callable[[Request], int]
# How many tokens past a waiting request's cached prefix name what it would compute next (``lpm``).
NEXT_TOKENS_COMPARED = 16
# What a waiting request computes next: its cache salt, LoRA adapter load, cached prefix length and next tokens (``lpm``).
NextTokens = tuple[str | None, int | None, int, tuple[int, ...]]


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

    def outranks(self, started: list[Request], fraction_done: float) -> bool:
        """Whether a waiting request should go before ``started`` (requests whose first step has done
        ``fraction_done`` of its work and is paused) although that work is then lost. Only
        ``lpm`` reorders work already started (its ranking depends on who else waits, and a burst of
        related requests may arrive just after an unrelated one started); the others never do."""
        return False

    def __len__(self) -> int:
        raise NotImplementedError


class FCFSPolicy(WaitingPolicy):
    """First come, first served (preempted requests first)."""

    name = "fcfs"

    def __init__(self, prefix_length: PrefixLengthFn | None = None) -> None:
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


class LongestPrefixMatchPolicy(FCFSPolicy):
    """Longest cached prefix first (SGLang's ``lpm``); preempted requests first.

    Serving the requests that share the most cached KV first keeps hot prefixes in the cache and
    turns a burst of related requests into cache hits. Among equal cached prefixes, the request whose
    next tokens (the ``NEXT_TOKENS_COMPARED`` past its cached prefix, same cache salt) most waiting
    requests also start with goes first: once it has computed those blocks, all of them share them
    (a burst over several new system prompts serves the largest group first), then FCFS. Ranking
    costs a tree walk per waiting request, so past ``max_ranked`` waiting requests the policy falls
    back to FCFS order, as SGLang does.
    """

    name = "lpm"

    def __init__(self, prefix_length: PrefixLengthFn | None = None, max_ranked: int = 128) -> None:
        super().__init__()
        if prefix_length is None:
            raise ValueError("the lpm policy needs the prefix cache (it ranks by cached prefix length)")
        self._prefix_length = prefix_length
        self._max_ranked = max_ranked

    def ordered(self) -> Iterator[Request]:
        queue = list(self._queue)
        if len(queue) > self._max_ranked:
            return iter(queue)
        resumed = [r for r in queue if r.num_preemptions > 0]
        fresh = [r for r in queue if r.num_preemptions == 0]
        return iter(resumed + self._ranked(fresh))

    def outranks(self, started: list[Request], fraction_done: float) -> bool:
        """Ranks ``started`` ahead of the fresh waiting requests (they came first); when one of those
        still ranks first (a longer cached prefix, or more waiting requests that would share what it
        computes next), says whether going first lowers the waiting requests' summed time to first
        token despite the lost work. Past ``max_ranked`` waiting requests (FCFS order), never.

        An exchange of two first steps, with times in proportion to the tokens they compute: the
        paused step S (``W_S`` tokens, ``fraction_done`` ``f`` of them run) and the first-ranked
        request's A (``W_A``), which ``w_S`` and ``w_A`` waiting requests share (their own short
        steps follow). Going on, A's group waits ``(1 - f) W_S`` longer; putting S back, S's group
        waits ``W_A + f W_S`` longer and the ``n_rest`` others ``f W_S`` (the lost work). So A goes
        first only when ``w_A (1 - f) W_S > w_S (W_A + f W_S) + n_rest f W_S``: a burst that took a
        while to arrive rarely pays for the work it would throw away."""
        if not started or len(self._queue) + len(started) > self._max_ranked:
            return False
        fresh = [r for r in self._queue if r.num_preemptions == 0]
        if not fresh:
            return False
        requests = [*started, *fresh]
        cached, next_tokens = self._next_tokens(requests)
        sharing = Counter(next_tokens)
        first = self._order(cached, next_tokens, sharing)[0]
        if first < len(started):
            return False
        w_first = sharing[next_tokens[first]]
        w_started = sum(sharing[k] for k in set(next_tokens[: len(started)]))
        n_rest = len(requests) - w_first - w_started
        work_started = sum(r.num_tokens - c for r, c in zip(started, cached))
        work_first = requests[first].num_tokens - cached[first]
        f = fraction_done
        gain = w_first * (1 - f) * work_started
        loss = w_started * (work_first + f * work_started) + n_rest * f * work_started
        return gain > loss

    def _next_tokens(self, requests: list[Request]) -> tuple[list[int], list[NextTokens]]:
        """Each request's cached prefix length and what it computes next (its cache salt, LoRA adapter, that length
        and the ``NEXT_TOKENS_COMPARED`` tokens past it): requests with equal keys share that work."""
        cached = [self._prefix_length(r) for r in requests]
        keys = [
            (r.cache_salt, r.lora_id, c, tuple(r.all_token_ids[c : c + NEXT_TOKENS_COMPARED]))
            for r, c in zip(requests, cached)
        ]
        return cached, keys

    def _ranked(self, requests: list[Request]) -> list[Request]:
        """``requests`` by cached prefix (longest first), then by how many of them share their next
        tokens, then in the given order."""
        cached, next_tokens = self._next_tokens(requests)
        return [requests[i] for i in self._order(cached, next_tokens, Counter(next_tokens))]

    @staticmethod
    def _order(cached: list[int], next_tokens: list[NextTokens], sharing: Counter[NextTokens]) -> list[int]:
        """Indices in ``_ranked``'s order."""
        return sorted(range(len(cached)), key=lambda i: (-cached[i], -sharing[next_tokens[i]], i))


POLICIES: tuple[str, ...] = ("fcfs", "lpm", "vtc")


def make_policy(
    name: str, prefix_length: PrefixLengthFn | None = None, counters: VirtualTokenCounters | None = None
) -> WaitingPolicy:
    """A fresh queue of the policy named ``name``; ValueError lists the known ones.

    ``lpm`` needs ``prefix_length`` (the prefix cache); ``vtc`` needs the shared ``counters``.
    """
    if name == "fcfs":
        return FCFSPolicy()
    if name == "lpm":
        return LongestPrefixMatchPolicy(prefix_length)
    if name == "vtc":
        from tokenmill.core.fairness import VTCPolicy  # fairness builds on this module

        if counters is None:
            raise ValueError("the vtc policy needs the users' virtual token counters")
        return VTCPolicy(counters)
    raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}")

"""Per-user fair scheduling with the Virtual Token Counter (VTC).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024). Every user has a
counter of the service it has received: each prompt token computed for it adds ``input_weight``,
each token generated for it adds ``output_weight``, both divided by the user's weight. The waiting
request admitted next belongs to the backlogged user (one with waiting requests) whose counter is
smallest. A user who becomes backlogged has its counter lifted to the smallest counter among the
users already backlogged (or, when none is, to the counter of the user who left the queue last), so
idling earns no credit to be spent later in a burst, and a newcomer neither jumps the queue for
long nor waits behind a heavy user's whole backlog.

Service is charged as it is delivered (``charge`` after every step), never for recomputation after
a preemption, and prompt tokens served from the prefix cache are free. The counters are shared by
every scheduling class, so a user's service in one tier counts against it in the others.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from tokenmill.core.policy import WaitingPolicy
from tokenmill.core.request import Request


class VirtualTokenCounters:
    """The users' counters and who is backlogged. Contract: every request that enters a waiting
    queue is reported with ``on_enqueue`` and every one that leaves it with ``on_dequeue``."""

    def __init__(
        self,
        input_weight: float = 1.0,
        output_weight: float = 2.0,
        user_weights: dict[str, float] | None = None,
    ) -> None:
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.user_weights = dict(user_weights or {})
        self.counters: dict[str, float] = {}
        self._backlog: dict[str, int] = {}  # user -> requests waiting
        self._last_left: str | None = None

    def counter(self, user: str) -> float:
        return self.counters.get(user, 0.0)

    def weight(self, user: str) -> float:
        return self.user_weights.get(user, 1.0)

    def is_backlogged(self, user: str) -> bool:
        return user in self._backlog

    def on_enqueue(self, user: str) -> None:
        if user not in self._backlog:
            self._lift(user)
            self._backlog[user] = 0
        self._backlog[user] += 1

    def on_dequeue(self, user: str) -> None:
        self._backlog[user] -= 1
        if self._backlog[user] == 0:
            del self._backlog[user]
            self._last_left = user

    def _lift(self, user: str) -> None:
        if self._backlog:
            floor = min(self.counter(u) for u in self._backlog)
        elif self._last_left is not None:
            floor = self.counter(self._last_left)
        else:
            floor = 0.0
        self.counters[user] = max(self.counter(user), floor)

    def cost(self, user: str, num_input_tokens: int, num_output_tokens: int) -> float:
        """What serving these tokens adds to ``user``'s counter."""
        raw = self.input_weight * num_input_tokens + self.output_weight * num_output_tokens
        return raw / self.weight(user)

    def charge(self, user: str, num_input_tokens: int, num_output_tokens: int) -> None:
        self.counters[user] = self.counter(user) + self.cost(user, num_input_tokens, num_output_tokens)


class VTCPolicy(WaitingPolicy):
    """Waiting requests in per-user FIFO queues; the user with the smallest counter goes first.

    ``ordered`` simulates the admissions it proposes: after yielding a request it adds that
    request's prompt cost to its user's counter (in a copy), so one scan admits several requests
    in the same order as admitting them one at a time would. Ties go to the earlier arrival;
    preempted requests go back to the front of their user's queue.
    """

    name = "vtc"

    def __init__(self, counters: VirtualTokenCounters) -> None:
        self.counters = counters
        self._queues: dict[str, deque[Request]] = {}
        self._seq: dict[str, int] = {}  # request id -> arrival order, for ties between users
        self._arrivals = itertools.count()
        self._resumes = itertools.count(-1, -1)
        self._size = 0

    def add(self, request: Request) -> None:
        self._enqueue(request, next(self._arrivals), front=False)

    def prepend(self, request: Request) -> None:
        self._enqueue(request, next(self._resumes), front=True)

    def _enqueue(self, request: Request, seq: int, front: bool) -> None:
        self.counters.on_enqueue(request.user)
        queue = self._queues.setdefault(request.user, deque())
        if front:
            queue.appendleft(request)
        else:
            queue.append(request)
        self._seq[request.request_id] = seq
        self._size += 1

    def remove(self, request: Request) -> None:
        queue = self._queues[request.user]
        queue.remove(request)
        if not queue:
            del self._queues[request.user]
        del self._seq[request.request_id]
        self._size -= 1
        self.counters.on_dequeue(request.user)

    def ordered(self) -> Iterator[Request]:
        # A snapshot (the scheduler removes what it admits while iterating), walked lazily with a
        # heap of (projected counter, arrival of the user's next request, user): the scheduler
        # usually stops after a few requests, so the whole order is rarely needed.
        queues = {user: [(self._seq[r.request_id], r) for r in queue] for user, queue in self._queues.items()}
        heap = [(self.counters.counter(user), queue[0][0], user) for user, queue in queues.items()]
        heapq.heapify(heap)
        position = dict.fromkeys(queues, 0)
        while heap:
            projected, _, user = heapq.heappop(heap)
            _, request = queues[user][position[user]]
            position[user] += 1
            yield request
            if position[user] < len(queues[user]):
                to_compute = max(0, request.num_prompt_tokens - request.num_prompt_charged)
                projected += self.counters.cost(user, to_compute, 0)
                heapq.heappush(heap, (projected, queues[user][position[user]][0], user))

    def __len__(self) -> int:
        return self._size

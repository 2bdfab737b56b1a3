"""Structured outputs inside the engine core: compiling, per-request matchers, step bitmasks.

Grammars compile on a small thread pool, cached by constraint text, so a request whose grammar is
compiling waits in the queue (the scheduler skips it) while the batch keeps running. Each request,
each of n siblings included, gets its own matcher; it advances with every output token in
``Scheduler.update`` and never moves back, so preemption (which recomputes KV but keeps the output
tokens) leaves it consistent. Jump-forward: when the grammar allows exactly one next token, that
token is appended without sampling; the tokens appended this way are computed in the next step as a
chunk, like any other tokens the request has not computed yet.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Set
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenmill.core.step_io import GrammarBitmask
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured.backend import GrammarBackend, GrammarMatcher, constraint_key

if TYPE_CHECKING:
    from tokenmill.core.step_io import ScheduledRequest

logger = logging.getLogger(__name__)

# Compiled grammars kept for reuse; a compiled JSON schema is typically tens of kilobytes.
_CACHE_ENTRIES = 256


def check_combination(params: Any) -> None:
    """Reject sampling settings that cannot work together with a grammar (ValueError).

    ``ignore_eos`` would keep generating after the grammar ended, where no token is allowed;
    ``min_tokens`` would forbid the EOS a finished grammar requires.
    """
    if params.structured_outputs is None:
        return
    if params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with structured outputs: the grammar's end is EOS")
    if params.min_tokens > 0:
        raise ValueError(
            "min_tokens cannot be combined with structured outputs: it could forbid the EOS the grammar requires"
        )


class GrammarRequest(Protocol):
    """What the grammar code reads of a request (``core/request.py``'s ``Request`` is one).

    A protocol rather than an import: the core imports this package, so this package imports
    nothing of the core but its plan types (``core/step_io.py``).
    """

    @property
    def request_id(self) -> str: ...

    @property
    def sampling_params(self) -> SamplingParams: ...

    @property
    def eos_token_ids(self) -> Set[int]: ...

    @property
    def grammar(self) -> GrammarState | None: ...


class GrammarState:
    """One request's grammar: its compile future, then its matcher and the current mask row.

    Contract: ``poll`` is True once a matcher exists (False while compiling or after a failure,
    then ``error`` says why); ``accept`` advances by one token; ``bitmask_row`` is valid until the
    next ``accept``; ``forced_token`` is the only allowed next token, if exactly one is allowed and
    jump-forward is on for this request, else None.
    """

    def __init__(
        self,
        request_id: str,
        constraint: StructuredOutputsParams,
        future: Future[Any],
        backend: Callable[[], GrammarBackend],
        stop_token_ids: list[int],
        jump_forward: bool,
    ) -> None:
        self.request_id = request_id
        self.constraint = constraint
        self.future = future
        self._backend = backend
        self.stop_token_ids = stop_token_ids
        self.jump_forward = jump_forward
        self.matcher: GrammarMatcher | None = None
        self._filter: torch.Tensor | None = None  # [words] int32, ANDed into every mask row
        self.error: str | None = None
        self._row: torch.Tensor | None = None  # [words] int32, for the matcher's current state

    def poll(self) -> bool:
        if self.matcher is not None:
            return True
        if self.error is not None or not self.future.done():
            return False
        exc = self.future.exception()
        if exc is not None:
            self.error = str(exc) if isinstance(exc, ValueError) else f"grammar compilation failed: {exc}"
            return False
        backend = self._backend()
        self._filter = backend.token_filter(self.constraint)
        self.matcher = backend.make_matcher(self.future.result(), self.stop_token_ids)
        return True

    def accept(self, token_id: int) -> bool:
        assert self.matcher is not None, "a request samples only once its grammar is ready"
        self._row = None
        return self.matcher.accept_token(token_id)

    def bitmask_row(self) -> torch.Tensor:
        if self._row is None:
            assert self.matcher is not None
            mask = self._backend().allocate_bitmask(1)  # [1, words]
            self.matcher.fill_bitmask(mask, 0)
            if self._filter is not None:
                mask[0] &= self._filter
            self._row = mask[0]
        return self._row

    def valid_draft_prefix(self, drafts: list[int]) -> int:
        """How many leading ``drafts`` the grammar allows in a row (speculative decoding), stopping
        before a draft that would end the grammar; the matcher is left where it was."""
        assert self.matcher is not None, "a request drafts only once its grammar is ready"
        count = 0
        for token in drafts:
            if not self.matcher.accept_token(token):
                break
            if self.matcher.is_terminated():
                self.matcher.rollback(1)
                break
            count += 1
        if count:
            self.matcher.rollback(count)
        return count

    def draft_bitmask_rows(self, drafts: list[int]) -> list[torch.Tensor]:
        """The bitmask rows at the current state and after each of ``drafts`` (``1 + len(drafts)``
        rows ``[words]``), for verifying them; ``drafts`` must be allowed (``valid_draft_prefix``).
        The matcher is left where it was."""
        assert self.matcher is not None
        rows = [self.bitmask_row()]
        backend = self._backend()
        for token in drafts:
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"draft token {token} is not allowed by the request's grammar")
            mask = backend.allocate_bitmask(1)  # [1, words]
            self.matcher.fill_bitmask(mask, 0)
            if self._filter is not None:
                mask[0] &= self._filter
            rows.append(mask[0])
        if drafts:
            self.matcher.rollback(len(drafts))
        return rows

    def forced_token(self) -> int | None:
        if not self.jump_forward or self.matcher is None or self.matcher.is_terminated():
            return None
        row = self.bitmask_row()  # [words]
        nonzero = torch.nonzero(row).flatten().tolist()
        if len(nonzero) != 1:
            return None
        word = int(row[nonzero[0]]) & 0xFFFFFFFF
        if word & (word - 1):
            return None  # more than one bit set
        return nonzero[0] * 32 + word.bit_length() - 1


class StructuredOutputManager:
    """Compiles constraints off the step loop and builds each step's bitmask.

    ``backend_factory`` builds the grammar backend on first use (in a worker thread: loading the
    tokenizer and its vocabulary tables is not free), so engines that never see a constraint pay
    nothing. ``jump_forward`` turns forced-token appending on for requests without logprobs.
    """

    def __init__(
        self, backend_factory: Callable[[], GrammarBackend], jump_forward: bool = True, num_workers: int = 1
    ) -> None:
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.jump_forward = jump_forward
        self._pool: ThreadPoolExecutor | None = None
        self._num_workers = num_workers
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._pending: list[GrammarState] = []

    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def _compile(self, constraint: StructuredOutputsParams) -> Future[Any]:
        key = constraint_key(constraint)
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            return future
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_workers, thread_name_prefix="tokenmill-grammar")
        future = self._pool.submit(lambda: self.backend().compile(constraint))
        self._cache[key] = future
        while len(self._cache) > _CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return future

    def new_state(self, request: GrammarRequest) -> GrammarState:
        """Start (or reuse) the compilation of ``request``'s constraint; its state for the scheduler."""
        params = request.sampling_params
        assert params.structured_outputs is not None
        check_combination(params)
        state = GrammarState(
            request.request_id,
            params.structured_outputs,
            self._compile(params.structured_outputs),
            self.backend,
            sorted(request.eos_token_ids),
            # Forced tokens skip the sampler, which computes logprobs; such requests sample every token.
            jump_forward=self.jump_forward and params.logprobs is None,
        )
        self._pending.append(state)
        return state

    def has_pending(self) -> bool:
        return any(not state.future.done() for state in self._pending)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some pending compilation finishes or ``timeout`` seconds pass (an idle engine)."""
        futures = [state.future for state in self._pending if not state.future.done()]
        if futures:
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def take_failures(self) -> list[tuple[str, str]]:
        """``(request_id, error)`` for every request whose compilation failed since the last call."""
        failures: list[tuple[str, str]] = []
        still_pending: list[GrammarState] = []
        for state in self._pending:
            if not state.future.done():
                still_pending.append(state)
            elif not state.poll() and state.error is not None:
                failures.append((state.request_id, state.error))
        self._pending = still_pending
        return failures

    def step_bitmask(
        self, scheduled: Iterable[ScheduledRequest], requests: Mapping[str, GrammarRequest]
    ) -> GrammarBitmask | None:
        """The bitmask rows of this step's constrained sampling rows, or None when there are none. A
        request with speculative drafts gets ``1 + len(drafts)`` consecutive rows from its index on
        (the mask at each verified position)."""
        rows: dict[str, int] = {}
        masks: list[torch.Tensor] = []
        for entry in scheduled:
            if not entry.sample:
                continue
            request = requests.get(entry.request_id)
            if request is None or request.grammar is None:
                continue
            rows[entry.request_id] = len(masks)
            if entry.draft_token_ids:
                masks.extend(request.grammar.draft_bitmask_rows(entry.draft_token_ids))
            else:
                masks.append(request.grammar.bitmask_row())
        if not masks:
            return None
        return GrammarBitmask(rows=rows, bitmask=torch.stack(masks))  # [num_constrained, words]

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

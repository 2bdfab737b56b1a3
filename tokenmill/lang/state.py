"""``ProgramState``: the growing text of one program run, the variables its calls set, and the
worker that runs its expressions in order.

``s += expr`` only queues ``expr``; the state's worker thread runs the queue in order, so two forks
(or two programs of a batch) run their model calls at the same time. Reading ``s["name"]``,
``s.text()`` or ``s.messages()`` waits for what it needs. A failed call stops the state: the
expressions after it are dropped and every later read raises ``ProgramError`` with the cause.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tokenmill.lang.backend import Backend
from tokenmill.lang.expr import ROLES, Expr, Gen, RoleBegin, RoleBlock, RoleEnd, Select
from tokenmill.lang.trace import CallTimer, Trace


class ProgramError(RuntimeError):
    """A program's model call or tool loop failed; ``__cause__`` is the original error."""


class ProgramState:
    """The state ``s`` a program function receives. See the module docstring for the contract."""

    def __init__(
        self, backend: Backend, trace: Trace | None = None, lane: str = "0", streaming: bool = False
    ) -> None:
        self.backend = backend
        # Ask backends to stream generations (for ``text_iter``); off, remote calls are plain requests.
        self.streaming = streaming
        self.trace = trace or Trace()
        self.lane = lane
        self.ret_value: Any = None
        self._text = ""
        self._variables: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._messages: list[dict[str, Any]] = []
        self._open_role: str | None = None
        self._open_role_at_start = False
        self._error: BaseException | None = None
        self._queue: deque[Expr] = deque()
        self._running = False
        # The thread of a ``run(stream=True)`` body still adding expressions (None: no such body).
        self._body_thread: int | None = None
        self._cond = threading.Condition()
        # Streaming: every piece of text appended, with the variable it belongs to (None: plain text).
        self._pieces: list[tuple[str | None, str]] = []
        self._finished_vars: set[str] = set()
        self._fork_ids = itertools.count(1)

    # ------------------------------------------------------------------ building

    def __iadd__(self, expr: Expr) -> ProgramState:
        if not isinstance(expr, (str, Gen, Select, RoleBlock, RoleBegin, RoleEnd)):
            raise ValueError(f"a state takes text, gen, select and role blocks, got {type(expr).__name__}")
        with self._cond:
            if self._error is not None:
                raise ProgramError(f"the program already failed: {self._error}") from self._error
            self._queue.append(expr)
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, name=f"lang-state-{self.lane}", daemon=True).start()
        return self

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self += RoleBegin(role)
        yield
        self += RoleEnd(role)

    def system(self) -> Any:
        """``with s.system(): s += ...`` — the same as ``s += system(...)``."""
        return self._role_scope("system")

    def user(self) -> Any:
        return self._role_scope("user")

    def assistant(self) -> Any:
        return self._role_scope("assistant")

    # ------------------------------------------------------------------ reading

    def __getitem__(self, name: str) -> Any:
        """The value of variable ``name``, waiting until the call that sets it has run."""
        with self._cond:
            self._cond.wait_for(
                lambda: name in self._variables or self._error is not None or not self._running
            )
            self._raise_if_failed()
            if name not in self._variables:
                raise KeyError(f"the program set no variable {name!r}; it set {sorted(self._variables)}")
            return self._variables[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        """Set a variable directly (after everything queued so far has run)."""
        self.sync()
        with self._cond:
            self._variables[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """The call behind variable ``name``: token counts, finish reason, select's scores, tool calls."""
        self[name]
        with self._cond:
            return dict(self._meta.get(name, {}))

    def sync(self) -> None:
        """Wait until everything queued has run; ProgramError if something failed."""
        with self._cond:
            self._cond.wait_for(self._idle)
            self._raise_if_failed()

    def text(self) -> str:
        """The whole text so far (after everything queued has run)."""
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, Any]]:
        """The role blocks so far as chat messages (``{"role", "content"}``, plus tool calls)."""
        self.sync()
        with self._cond:
            return [dict(m) for m in self._messages]

    def variables(self) -> dict[str, Any]:
        self.sync()
        with self._cond:
            return dict(self._variables)

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """Yield text as it is produced: that of variable ``name``, or (None) everything appended."""
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda seen=seen: len(self._pieces) > seen or self._stream_over(name))  # type: ignore[misc]
                new = self._pieces[seen:]
                seen = len(self._pieces)
                over = self._stream_over(name)
            for var, piece in new:
                if name is None or var == name:
                    yield piece
            if over and not new:
                with self._cond:
                    self._raise_if_failed()
                return

    def fork(self, n: int) -> Forks:
        """``n`` copies of this state that continue independently and in parallel.

        The shared text is computed into the prefix cache once (one prompt-only call) before the
        copies run, so each branch starts with its prefix cached.
        """
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        self.sync()
        if n > 1 and self._text:
            with CallTimer(self.trace, self.lane, "prime", None) as timer:
                result = self.backend.prime(self._text)
                timer.counts(result.prompt_tokens, 0, result.cached_tokens)
        branches = []
        for _ in range(n):
            lane = f"{self.lane}.{next(self._fork_ids)}"
            child = ProgramState(self.backend, self.trace, lane=lane, streaming=self.streaming)
            with self._cond:
                child._text = self._text
                child._variables = dict(self._variables)
                child._meta = {k: dict(v) for k, v in self._meta.items()}
                child._messages = [dict(m) for m in self._messages]
                child._open_role = self._open_role
                child._open_role_at_start = self._open_role_at_start
            branches.append(child)
        return Forks(branches)

    def __repr__(self) -> str:
        return (
            f"ProgramState(lane={self.lane}, text={self._text[-60:]!r}, variables={sorted(self._variables)})"
        )

    # ------------------------------------------------------------------ the worker

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ProgramError(f"a call of the program failed: {self._error}") from self._error

    def _idle(self) -> bool:
        body_busy = self._body_thread is not None and self._body_thread != threading.get_ident()
        return not self._running and not body_busy

    def body_running(self, thread_id: int | None) -> None:
        """Mark that the program body runs in thread ``thread_id`` (None: it ended); reads from other
        threads wait for it to end before deciding that a variable was never set."""
        with self._cond:
            self._body_thread = thread_id
            self._cond.notify_all()

    def _stream_over(self, name: str | None) -> bool:
        if self._error is not None or self._idle():
            return True
        return name is not None and name in self._finished_vars

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue or self._error is not None:
                    self._queue.clear()
                    self._running = False
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            try:
                self._run(expr)
            except BaseException as exc:  # a failed call stops this state, never the caller's thread
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()

    def _append(self, piece: str, var: str | None = None) -> None:
        with self._cond:
            self._text += piece
            if self._open_role is not None and self._messages:
                self._messages[-1]["content"] += piece
            self._pieces.append((var, piece))
            self._cond.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        if name is None:
            return
        with self._cond:
            self._variables[name] = value
            self._meta[name] = meta
            self._finished_vars.add(name)
            self._cond.notify_all()

    def _run(self, expr: Expr) -> None:
        if isinstance(expr, str):
            self._append(expr)
        elif isinstance(expr, RoleBlock):
            self._begin_role(expr.role)
            for part in expr.parts:
                self._run(part)
            self._end_role(expr.role)
        elif isinstance(expr, RoleBegin):
            self._begin_role(expr.role)
        elif isinstance(expr, RoleEnd):
            self._end_role(expr.role)
        elif isinstance(expr, Select):
            self._select(expr)
        elif expr.tools:
            from tokenmill.lang.tools import run_tool_loop

            run_tool_loop(self, expr)
        else:
            self._gen(expr)

    def _begin_role(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        if self._open_role is not None:
            raise ValueError(f"a {role} block cannot start inside the open {self._open_role} block")
        at_start = not self._text
        prefix, _ = self.backend.chat_roles().wrap(role, at_start=at_start)
        self._append(prefix)
        with self._cond:
            self._open_role = role
            self._open_role_at_start = at_start
            self._messages.append({"role": role, "content": ""})

    def _end_role(self, role: str) -> None:
        if self._open_role != role:
            raise ValueError(f"ending a {role} block, but the open block is {self._open_role}")
        _, suffix = self.backend.chat_roles().wrap(role, at_start=self._open_role_at_start)
        with self._cond:
            self._open_role = None
        self._append(suffix)

    def _gen(self, gen: Gen) -> None:
        streamed: list[str] = []

        def on_text(piece: str) -> None:
            if piece:
                streamed.append(piece)
                self._stream(gen.name, piece)

        with CallTimer(self.trace, self.lane, "gen", gen.name) as timer:
            result = self.backend.generate(self._text, gen, on_text=on_text if self.streaming else None)
            timer.counts(result.prompt_tokens, result.completion_tokens, result.cached_tokens)
        self._commit_text(result.text, gen.name, streamed="".join(streamed))
        meta = {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cached_tokens": result.cached_tokens,
            "finish_reason": result.finish_reason,
        }
        self._set_var(gen.name, result.text, meta)

    def _stream(self, name: str | None, piece: str) -> None:
        """A streamed piece goes to the listeners only; the text is committed when the call ends."""
        if piece:
            with self._cond:
                self._pieces.append((name, piece))
                self._cond.notify_all()

    def _commit_text(self, text: str, name: str | None, streamed: str) -> None:
        with self._cond:
            self._text += text
            if self._open_role is not None and self._messages:
                self._messages[-1]["content"] += text
            if not streamed:
                self._pieces.append((name, text))
            elif text.startswith(streamed) and len(text) > len(streamed):
                self._pieces.append((name, text[len(streamed) :]))
            self._cond.notify_all()

    def _select(self, select: Select) -> None:
        with CallTimer(self.trace, self.lane, "select", select.name) as timer:
            scores = self.backend.score_choices(self._text, select.choices)
            timer.counts(scores.call.prompt_tokens, 0, scores.call.cached_tokens)
        choice = select.choices[scores.best()]
        self._commit_text(choice, select.name, streamed="")
        meta = {
            "normalized_logprobs": scores.normalized_logprobs,
            "token_logprobs": scores.token_logprobs,
            "prompt_tokens": scores.call.prompt_tokens,
            "cached_tokens": scores.call.cached_tokens,
        }
        self._set_var(select.name, choice, meta)


class Forks(list[ProgramState]):
    """The branches of ``s.fork(n)``; ``join()`` waits for all of them."""

    def join(self) -> None:
        for branch in self:
            branch.sync()

    def __iadd__(self, expr: Any) -> Forks:  # type: ignore[override,misc]
        """``forks += gen(...)`` appends the same expression to every branch."""
        for branch in self:
            branch += expr
        return self

"""``@function`` programs: ``prog.run(**args)`` and ``prog.run_batch([...])``.

A program is a Python function whose first parameter is the state. ``run`` executes its body in the
calling thread (model calls run on the state's worker, so ``s["x"]`` waits for them) and returns the
state once everything has run. ``run_batch`` runs many programs on a thread pool, ordered so that
programs sharing a prefix run next to each other, with each shared prefix computed once first.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from tqdm.auto import tqdm

from tokenmill.lang.backend import Backend
from tokenmill.lang.prefix_groups import plan_batch
from tokenmill.lang.state import ProgramState
from tokenmill.lang.trace import CallTimer, Trace


class _Defaults:
    """The backend ``set_default_backend`` chose (read by every ``run`` without ``backend=``)."""

    backend: Backend | None = None
    lock = threading.Lock()


def set_default_backend(backend: Backend | None) -> None:
    """Make ``backend`` the one ``run``/``run_batch`` use when given none."""
    with _Defaults.lock:
        _Defaults.backend = backend


def get_default_backend() -> Backend | None:
    with _Defaults.lock:
        return _Defaults.backend


def _pick(backend: Backend | None) -> Backend:
    chosen = backend or get_default_backend()
    if chosen is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(Runtime(...))")
    return chosen


class Program:
    """A program function made runnable; see the module docstring."""

    def __init__(self, body: Callable[..., Any]) -> None:
        self.body = body
        functools.update_wrapper(self, body)  # type: ignore[arg-type]

    def run(
        self, *args: Any, backend: Backend | None = None, stream: bool = False, **kwargs: Any
    ) -> ProgramState:
        """Run the program on ``backend`` (else the default) with ``args``; returns its state.

        ``stream=True`` returns at once with the body running in a thread and its generations
        streamed, for ``text_iter`` (without it, ``text_iter`` yields each generation whole).
        The body's return value is ``state.ret_value``; a failure raises ``ProgramError`` (or the
        body's own exception), unless ``stream`` is set, then it surfaces on the state's reads.
        """
        state = ProgramState(_pick(backend), streaming=stream)
        if stream:
            thread = threading.Thread(target=self._streamed_body, args=(state, args, kwargs), daemon=True)
            with state._cond:  # reads wait from now on, before the thread has even started
                thread.start()
                assert thread.ident is not None
                state._body_thread = thread.ident
            return state
        self._body_then_sync(state, args, kwargs)
        return state

    def _streamed_body(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            state.ret_value = self.body(state, *args, **kwargs)
        except BaseException as exc:  # surfaces on the state's reads
            with state._cond:
                state._error = state._error or exc
        finally:
            state.body_running(None)

    def _body_then_sync(self, state: ProgramState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.ret_value = self.body(state, *args, **kwargs)
        state.sync()

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        prime_prefixes: bool = True,
    ) -> list[ProgramState]:
        """Run the program once per argument dict; the states come back in input order.

        Programs are started in the order of the text they build before their first model call, so
        those sharing a prefix run together; with ``prime_prefixes`` each prefix two or more programs
        share is computed into the cache once (a prompt-only call) before they start. A program
        that fails raises its error here after the others have finished.
        """
        chosen = _pick(backend)
        if num_threads == "auto":
            threads = max(1, min(64, len(batch_kwargs)))
        elif isinstance(num_threads, int) and num_threads >= 1:
            threads = num_threads
        else:
            raise ValueError(f"num_threads must be 'auto' or an integer >= 1, got {num_threads!r}")
        plan = plan_batch(self.body, chosen, batch_kwargs)
        trace = Trace()
        if prime_prefixes:
            for prefix in plan.shared_prefixes:
                with CallTimer(trace, "0", "prime", None) as timer:
                    result = chosen.prime(prefix)
                    timer.counts(result.prompt_tokens, 0, result.cached_tokens)
        states: list[ProgramState | None] = [None] * len(batch_kwargs)
        errors: list[tuple[int, BaseException]] = []

        def one(index: int) -> ProgramState:
            state = ProgramState(chosen, trace, lane=str(index + 1))
            self._body_then_sync(state, (), dict(batch_kwargs[index]))
            return state

        with (
            ThreadPoolExecutor(max_workers=threads) as pool,
            tqdm(
                total=len(batch_kwargs),
                desc=getattr(self.body, "__name__", "program"),
                unit="prog",
                disable=not progress_bar,
            ) as bar,
        ):
            futures = {pool.submit(one, index): index for index in plan.order}
            for future in as_completed(futures):
                index = futures[future]
                try:
                    states[index] = future.result()
                except BaseException as exc:
                    errors.append((index, exc))
                bar.update(1)
        if errors:
            first, error = min(errors, key=lambda item: item[0])
            raise RuntimeError(f"program {first} of the batch failed: {error}") from error
        return [state for state in states if state is not None]

    def __call__(self, state: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Call the program inside another one, on the caller's state."""
        return self.body(state, *args, **kwargs)


def function(body: Callable[..., Any]) -> Program:
    """Decorator: ``@function def prog(s, question): s += ...`` makes a runnable ``Program``."""
    return Program(body)

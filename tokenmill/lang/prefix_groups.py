"""How ``run_batch`` orders programs: by the text each builds before its first model call.

A program's static prefix is found by running its body on a ``PrefixProbe``, a stand-in state that
records text and role blocks and stops the body at the first thing that needs the model (``gen``,
``select``, ``fork``, reading a variable). Bodies therefore run twice up to that point: keep them
free of side effects there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from tokenmill.lang.backend import Backend
from tokenmill.lang.expr import Gen, RoleBegin, RoleBlock, RoleEnd, Select

# Programs sharing fewer characters than this are not worth a priming call.
MIN_SHARED_CHARS = 64


class _FirstCall(Exception):
    """The probed body reached its first model call."""


class PrefixProbe:
    """Records a program's text up to its first model call (see the module docstring)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.prefix = ""
        self._role: tuple[str, bool] | None = None

    def __iadd__(self, expr: Any) -> PrefixProbe:
        if isinstance(expr, str):
            self.prefix += expr
        elif isinstance(expr, RoleBlock):
            self._begin(expr.role)
            for part in expr.parts:
                self += part
            self._end()
        elif isinstance(expr, RoleBegin):
            self._begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._end()
        elif isinstance(expr, (Gen, Select)):
            raise _FirstCall
        return self

    def _begin(self, role: str) -> None:
        at_start = not self.prefix
        self.prefix += self.backend.chat_roles().wrap(role, at_start)[0]
        self._role = (role, at_start)

    def _end(self) -> None:
        if self._role is not None:
            self.prefix += self.backend.chat_roles().wrap(*self._role)[1]
        self._role = None

    @contextmanager
    def _scope(self, role: str) -> Any:
        self._begin(role)
        yield
        self._end()

    def system(self) -> Any:
        return self._scope("system")

    def user(self) -> Any:
        return self._scope("user")

    def assistant(self) -> Any:
        return self._scope("assistant")

    def __getattr__(self, name: str) -> Any:
        raise _FirstCall  # fork, text, reading a variable: the prefix ends here

    def __getitem__(self, name: str) -> Any:
        raise _FirstCall


def static_prefix(body: Callable[..., Any], backend: Backend, kwargs: dict[str, Any]) -> str:
    probe = PrefixProbe(backend)
    # _FirstCall, or the body needing a real state: the prefix recorded so far is still right.
    with suppress(Exception):
        body(probe, **kwargs)
    return probe.prefix


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass
class BatchPlan:
    order: list[int]  # indices of the batch in the order to start them
    shared_prefixes: list[str]  # prefixes that two or more neighbouring programs share


def plan_batch(body: Callable[..., Any], backend: Backend, batch: Sequence[dict[str, Any]]) -> BatchPlan:
    """Sort the batch by static prefix; each run of neighbours sharing at least ``MIN_SHARED_CHARS``
    characters contributes its longest common prefix (one per group) to prime."""
    prefixes = [static_prefix(body, backend, dict(kwargs)) for kwargs in batch]
    order = sorted(range(len(batch)), key=lambda i: prefixes[i])
    shared: list[str] = []
    group_prefix: str | None = None
    for previous, current in zip(order, order[1:]):
        common = prefixes[current][: _common_prefix(prefixes[previous], prefixes[current])]
        if len(common) < MIN_SHARED_CHARS:
            if group_prefix:
                shared.append(group_prefix)
            group_prefix = None
            continue
        group_prefix = (
            common if group_prefix is None else group_prefix[: _common_prefix(group_prefix, common)]
        )
    if group_prefix and len(group_prefix) >= MIN_SHARED_CHARS:
        shared.append(group_prefix)
    return BatchPlan(order=order, shared_prefixes=shared)

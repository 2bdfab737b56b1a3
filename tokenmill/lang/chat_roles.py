"""Role blocks from the model's own chat template: the text before and after a turn's content.

A template is a function of the whole conversation, so each role's prefix and suffix are read off
by rendering a marker as the content, once as the first turn (which carries anything the template
writes at the start: a BOS token, a default system prompt) and once after earlier turns (the text
the template adds for this turn alone).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_MARKER = "TOKENMILLLANGMARKER"
# Earlier turns that make ``role`` a valid next turn for strict templates (alternating user/assistant).
_BEFORE = {
    "system": [],
    "user": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    "assistant": [{"role": "user", "content": "a"}],
    "tool": [{"role": "user", "content": "a"}],
}

Renderer = Callable[[list[dict[str, Any]]], str]


class ChatRoles:
    """Role prefixes and suffixes of one chat template; thread-safe, each computed once.

    ``render(messages)`` must apply the template with ``add_generation_prompt=False``. Contract:
    ``wrap(role, at_start)`` returns ``(prefix, suffix)`` or raises ValueError naming the role when the
    template cannot be cut into per-turn pieces (it rewrites earlier turns, or drops the content).
    """

    def __init__(self, render: Renderer) -> None:
        self._render = render
        self._cache: dict[tuple[str, bool], tuple[str, str]] = {}
        self._lock = threading.Lock()

    def wrap(self, role: str, at_start: bool) -> tuple[str, str]:
        key = (role, at_start)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = self._compute(role, at_start)
            return self._cache[key]

    def _compute(self, role: str, at_start: bool) -> tuple[str, str]:
        turn = {"role": role, "content": _MARKER}
        if at_start or role == "system":
            before: list[dict[str, Any]] = []
        else:
            before = _BEFORE.get(role, _BEFORE["tool"])
        try:
            previous = self._render(before) if before else ""
            full = self._render([*before, turn])
        except Exception as exc:  # jinja raises its own errors for turns a template refuses
            raise ValueError(f"the chat template cannot render a {role!r} turn here: {exc}") from exc
        if not full.startswith(previous) or full.count(_MARKER) != 1:
            raise ValueError(
                f"the chat template cannot be cut into role blocks for {role!r} (it rewrites earlier turns "
                "or the content); build the prompt as plain text instead"
            )
        prefix, suffix = full[len(previous) :].split(_MARKER)
        return prefix, suffix

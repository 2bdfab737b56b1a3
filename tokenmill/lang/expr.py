"""The expressions a program appends to its state: text, role blocks, ``gen`` and ``select``.

They are plain values; a ``ProgramState`` runs them in order on its own worker (``state.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass
class Gen:
    """Generate text into variable ``name`` (see ``gen``)."""

    name: str | None
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    regex: str | None = None
    json_schema: str | None = None
    ignore_eos: bool = False
    seed: int | None = None
    tools: list[Callable[..., Any]] | None = None
    tool_choice: str = "auto"
    tool_parser: str | None = None
    max_tool_steps: int = 4


@dataclass
class Select:
    """Pick the most likely of ``choices`` into variable ``name`` (see ``select``)."""

    name: str | None
    choices: list[str]


@dataclass
class RoleBlock:
    """A chat turn: ``role``'s prefix from the chat template, ``parts``, then the role's suffix."""

    role: str
    parts: list[Expr]


@dataclass
class RoleBegin:
    role: str


@dataclass
class RoleEnd:
    role: str


Expr = str | Gen | Select | RoleBlock | RoleBegin | RoleEnd


def gen(
    name: str | None = None,
    *,
    max_tokens: int = 128,
    stop: str | Sequence[str] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    choices: Sequence[str] | None = None,
    ignore_eos: bool = False,
    seed: int | None = None,
    tools: Sequence[Callable[..., Any]] | None = None,
    tool_choice: str = "auto",
    tool_parser: str | None = None,
    max_tool_steps: int = 4,
) -> Gen | Select:
    """Generate a completion of the state's text and store it as ``state[name]``.

    ``regex`` or ``json_schema`` (a schema object or its JSON text) constrain the output (at most
    one); ``choices`` makes this a ``select``. ``tools`` (plain Python functions) runs a tool loop: the
    model's calls are parsed by the model's tool-call format (or ``tool_parser``), the functions run
    and their results (or errors) go back as ``tool`` messages, up to ``max_tool_steps`` rounds, and
    ``state[name]`` is the final answer. ``tool_choice="required"`` makes the first round a call by a
    JSON-schema grammar. Bad values raise ValueError here, before anything runs.
    """
    if choices is not None:
        if regex is not None or json_schema is not None or tools:
            raise ValueError(
                "gen(choices=...) is a select; it cannot be combined with regex, json_schema or tools"
            )
        return select(name, list(choices))
    if max_tokens < 1:
        raise ValueError(f"gen max_tokens must be >= 1, got {max_tokens}")
    if regex is not None and json_schema is not None:
        raise ValueError("gen takes at most one of regex and json_schema")
    if tools is not None:
        if not tools:
            raise ValueError("gen(tools=...) needs at least one function")
        if regex is not None or json_schema is not None:
            raise ValueError("gen(tools=...) cannot be combined with regex or json_schema")
        if tool_choice not in ("auto", "required"):
            raise ValueError(f"tool_choice must be 'auto' or 'required', got {tool_choice!r}")
        if max_tool_steps < 1:
            raise ValueError(f"max_tool_steps must be >= 1, got {max_tool_steps}")
    schema_text = (
        json_schema if json_schema is None or isinstance(json_schema, str) else json.dumps(json_schema)
    )
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return Gen(
        name=name,
        max_tokens=max_tokens,
        stop=stops,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        regex=regex,
        json_schema=schema_text,
        ignore_eos=ignore_eos,
        seed=seed,
        tools=list(tools) if tools is not None else None,
        tool_choice=tool_choice,
        tool_parser=tool_parser,
        max_tool_steps=max_tool_steps,
    )


def select(name: str | None = None, choices: Sequence[str] = ()) -> Select:
    """Append the choice the model finds most likely and store it as ``state[name]``.

    Each choice is scored by the mean logprob of its tokens after the state's text (token-length
    normalised), all choices in one prompt-only request: nothing is generated.
    """
    options = list(choices)
    if not options or any(not isinstance(c, str) or not c for c in options):
        raise ValueError("select needs a non-empty list of non-empty strings")
    return Select(name=name, choices=options)


def _role(role: str, parts: tuple[Expr, ...]) -> RoleBlock:
    for part in parts:
        if not isinstance(part, (str, Gen, Select)):
            raise ValueError(f"{role}(...) takes text, gen and select, got {type(part).__name__}")
    return RoleBlock(role=role, parts=list(parts))


def system(*parts: Expr) -> RoleBlock:
    """A system turn rendered with the model's chat template."""
    return _role("system", parts)


def user(*parts: Expr) -> RoleBlock:
    """A user turn rendered with the model's chat template."""
    return _role("user", parts)


def assistant(*parts: Expr) -> RoleBlock:
    """An assistant turn rendered with the model's chat template (``assistant(gen("answer"))``)."""
    return _role("assistant", parts)

"""OpenAI ``response_format`` and vLLM's ``guided_*`` fields → ``StructuredOutputsParams``.

Chat takes ``response_format`` (``text``, ``json_object``, ``json_schema``); chat and completions both
take SGLang's ``regex`` and ``ebnf``, vLLM's ``guided_json`` (an object or its JSON text), ``guided_regex``, ``guided_choice``,
``guided_grammar`` and a ``structured_outputs`` object with the fields of
:class:`~tokenmill.sampling_params.StructuredOutputsParams`. At most one may be given. The
constraint is parsed here, so a bad schema, regex or grammar is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.server.errors import bad_request
from tokenmill.structured.validate import validate_constraint

# vLLM's guided_* names, its structured_outputs object, and SGLang's regex / ebnf.
_GUIDED_FIELDS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "regex",
    "ebnf",
)


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise bad_request(
                "response_format of type 'json_schema' needs json_schema.schema (a JSON schema object)",
                param="response_format",
            )
        return StructuredOutputsParams(json=json.dumps(spec["schema"]))
    raise bad_request(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _from_guided(name: str, value: Any) -> StructuredOutputsParams:
    if name == "guided_json":
        text = value if isinstance(value, str) else json.dumps(value)
        return StructuredOutputsParams(json=text)
    if name in ("guided_regex", "regex"):
        return StructuredOutputsParams(regex=value)
    if name == "guided_choice":
        return StructuredOutputsParams(choice=list(value))
    if name in ("guided_grammar", "ebnf"):
        return StructuredOutputsParams(grammar=value)
    values = dict(value)
    if isinstance(values.get("json"), (dict, bool)):
        values["json"] = json.dumps(values["json"])
    try:
        return StructuredOutputsParams(**values)
    except TypeError as exc:
        raise ValueError(f"structured_outputs: {exc}") from None


def structured_outputs_from_request(request: Any) -> StructuredOutputsParams | None:
    """The request's one constraint, or None; ``APIError`` 400 naming the field when it is wrong."""
    given: list[tuple[str, Any]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        constraint = _from_response_format(response_format)
        if constraint is not None:
            given.append(("response_format", constraint))
    for name in _GUIDED_FIELDS:
        value = getattr(request, name, None)
        if value is None:
            continue
        try:
            given.append((name, _from_guided(name, value)))
        except ValueError as exc:
            raise bad_request(str(exc), param=name) from None
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give at most one structured output constraint, got {names}", param=given[1][0])
    name, constraint = given[0]
    try:
        validate_constraint(constraint)
    except ValueError as exc:
        raise bad_request(str(exc), param=name) from None
    return constraint

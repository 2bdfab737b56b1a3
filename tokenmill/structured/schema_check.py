"""Which JSON-schema keywords the xgrammar backend enforces, checked before compiling.

xgrammar ignores keywords it does not implement (``uniqueItems``, ``not``, ``allOf``, ``if``...),
which would let outputs through that do not validate. We accept a schema only when every keyword in
it is one the grammar enforces or a pure annotation; anything else is a ValueError naming the keyword
and where it is, so the client gets a 400 instead of an output that silently breaks its schema.
Each entry was checked against xgrammar 0.2.9 (see tests/unit/test_structured_backend.py).
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is a schema, a list of schemas or a map of schemas (walked recursively).
_SUBSCHEMA = {"items", "additionalProperties", "unevaluatedProperties"}
_SUBSCHEMA_LISTS = {"anyOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "$defs", "definitions"}

# Enforced assertions whose value is plain data.
_ENFORCED = {
    "type",
    "enum",
    "const",
    "required",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minProperties",
    "maxProperties",
    "$ref",
}

# Annotations: no effect on validity.
_ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
}

# String formats xgrammar turns into a grammar; any other format would be ignored.
SUPPORTED_FORMATS = {
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "ipv4",
    "ipv6",
    "hostname",
    "uri",
    "uri-reference",
    "uuid",
    "json-pointer",
}


def check_schema(schema: Any, path: str = "") -> None:
    """Raise ValueError if ``schema`` (a decoded JSON schema) uses a keyword that is not enforced."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"JSON schema at '{path or '/'}' must be an object or a boolean, got {schema!r}")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in _SUBSCHEMA:
            check_schema(value, where)
        elif key in _SUBSCHEMA_LISTS:
            if not isinstance(value, list):
                raise ValueError(f"JSON schema keyword '{key}' at '{where}' must be a list of schemas")
            for i, item in enumerate(value):
                check_schema(item, f"{where}/{i}")
        elif key in _SUBSCHEMA_MAPS:
            if not isinstance(value, dict):
                raise ValueError(f"JSON schema keyword '{key}' at '{where}' must map names to schemas")
            for name, item in value.items():
                check_schema(item, f"{where}/{name}")
        elif key == "format":
            if value not in SUPPORTED_FORMATS:
                raise ValueError(
                    f"JSON schema format {value!r} at '{where}' cannot be enforced; supported formats: "
                    f"{', '.join(sorted(SUPPORTED_FORMATS))}"
                )
        elif key == "multipleOf":
            if schema.get("type") != "integer":
                raise ValueError(
                    f"JSON schema keyword 'multipleOf' at '{where}' can only be enforced on integers"
                )
        elif key not in _ENFORCED and key not in _ANNOTATIONS:
            raise ValueError(
                f"JSON schema keyword '{key}' at '{where}' cannot be enforced by structured outputs; "
                "remove it or express the constraint with supported keywords"
            )

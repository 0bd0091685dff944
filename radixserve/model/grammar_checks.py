"""What a constraint must pass before it is compiled: a response that ends with "stop" must satisfy it.

xgrammar enforces most of JSON Schema, but a few keywords it ignores (``not``, ``allOf`` beyond one branch,
``uniqueItems``, ``if``/``then``/``else`` ...), and some schemas no value satisfies (``{"not": {}}``, a
``required`` property that ``additionalProperties: false`` forbids, a ``const`` of another type) compile to
grammars that accept output the schema rejects. Those are refused here, with the keyword named: a 400 before
anything runs, never an answer that breaks its own schema. Compilation time grows about cubically with a
schema's nesting (depth 200: 2 s, 400: 15 s, 2,000: 14 minutes), and a regex's counted repetition expands into
that many states, so sources, nesting and repetition counts are bounded ("too complex").
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

MAX_SOURCE_CHARS = 256 * 1024
MAX_SCHEMA_DEPTH = 48  # nested JSON containers in a schema (a property inside an object is two: schema + properties)
MAX_REPEAT = 1000  # a regex's {n} / {n,m}
MAX_BOUND = 2**53  # numeric bounds past what a float64 holds exactly cannot be matched digit by digit
# Keywords whose constraint xgrammar does not enforce: refused, since the output could break them.
UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "uniqueItems",
)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames")
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


class ConstraintError(ValueError):
    """The constraint cannot be kept (unsatisfiable, unenforced) or is too complex to compile."""


def check_source(kind: str, source: str) -> None:
    """Raise ConstraintError when ``source`` (a ``kind`` spec) is too large, too complex or cannot be kept."""
    if len(source) > MAX_SOURCE_CHARS:
        raise ConstraintError(f"{kind} too complex: {len(source)} characters (at most {MAX_SOURCE_CHARS})")
    if kind == "json_schema":
        check_schema(source)
    elif kind == "regex":
        for match in _REPEAT.finditer(source):
            counts = [int(n) for n in match.groups() if n]
            if max(counts) > MAX_REPEAT:
                raise ConstraintError(f"regex too complex: repetition {match.group(0)} (at most {MAX_REPEAT})")


def check_schema(source: str) -> None:
    """A JSON schema source: valid JSON within the nesting bound, a valid schema, and keepable."""
    try:
        schema = json.loads(source)
    except (ValueError, RecursionError) as exc:
        raise ConstraintError(f"invalid json_schema: not JSON ({exc})") from None
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"json_schema too complex: nested {depth} deep (at most {MAX_SCHEMA_DEPTH})")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConstraintError(f"invalid json_schema: {exc.message}") from None
    for where, sub in _subschemas(schema, "#"):
        _check_subschema(where, sub)


def _depth(value: Any) -> int:
    """Nesting depth of a JSON value, iteratively (a hostile schema must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            if deepest > MAX_SCHEMA_DEPTH:
                return deepest
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _subschemas(schema: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every (JSON pointer, subschema) of a schema, the root first (boolean schemas are skipped)."""
    if not isinstance(schema, dict):
        return
    yield where, schema
    for key in _SUBSCHEMA_MAPS:
        for name, sub in (schema.get(key) or {}).items():
            yield from _subschemas(sub, f"{where}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            yield from _subschemas(sub, f"{where}/{key}/{i}")
    for key in _SUBSCHEMAS:
        yield from _subschemas(schema.get(key), f"{where}/{key}")


def _check_subschema(where: str, schema: dict[str, Any]) -> None:
    unenforced = [key for key in UNENFORCED if key in schema and not (key == "uniqueItems" and not schema[key])]
    if unenforced:
        raise ConstraintError(
            f"json_schema keyword {unenforced[0]!r} at {where} is not supported by constrained decoding "
            "(the output could not be guaranteed to satisfy it)"
        )
    if len(schema.get("allOf") or []) > 1:
        raise ConstraintError(f"json_schema allOf with several branches at {where} is not supported (merge them)")
    _check_values(where, schema)
    _check_object(where, schema)
    _check_bounds(where, schema)


def _check_values(where: str, schema: dict[str, Any]) -> None:
    """A const or enum none of whose values passes the rest of its own schema: no value satisfies it."""
    import jsonschema

    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if values is None or any(key in schema for key in ("$ref", *_SUBSCHEMA_LISTS)):
        return
    rest = {key: value for key, value in schema.items() if key not in ("const", "enum")}
    if not any(jsonschema.validators.validator_for(rest)(rest).is_valid(value) for value in values):
        raise ConstraintError(f"json_schema at {where}: no value of its const/enum satisfies the rest of it")


def _check_object(where: str, schema: dict[str, Any]) -> None:
    """A required property that the schema's own properties and additionalProperties: false forbid."""
    if schema.get("additionalProperties") is not False or schema.get("patternProperties"):
        return
    allowed = schema.get("properties") or {}
    forbidden = [name for name in schema.get("required") or [] if name not in allowed or allowed[name] is False]
    if forbidden:
        raise ConstraintError(
            f"json_schema at {where}: property {forbidden[0]!r} is required but additionalProperties: false forbids "
            "it (no object satisfies this schema)"
        )


def _check_bounds(where: str, schema: dict[str, Any]) -> None:
    """Numeric bounds too large to match, and lower bounds above upper ones."""
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and abs(value) > MAX_BOUND:
            raise ConstraintError(f"json_schema at {where}: {key} {value} is beyond what can be matched (2^53)")
    for low, high in (
        ("minimum", "maximum"),
        ("minLength", "maxLength"),
        ("minItems", "maxItems"),
        ("minProperties", "maxProperties"),
    ):
        if isinstance(schema.get(low), int | float) and isinstance(schema.get(high), int | float):
            if schema[low] > schema[high]:
                raise ConstraintError(f"json_schema at {where}: {low} {schema[low]} > {high} {schema[high]}")

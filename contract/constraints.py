"""Output constraints, stated once: the request fields that ask for one, their one
normalised form, and the llguidance grammar it compiles to.

A request may carry at most one constraint, from any of the doors users come through:
OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. Every one becomes one dict:

    {"type": "json_schema", "schema": {...}, "whitespace_flexible": False}
    {"type": "regex", "pattern": "..."}
    {"type": "choice", "choices": ["...", ...]}
    {"type": "grammar", "grammar": "<Lark grammar>"}

(`json_object` is the schema {"type": "object"}). `grammar()` turns that dict into the
grammar text llguidance's `LLMatcher` takes (its JSON grammar format, built here with
the standard library so both the submit side and the engine get the very same text).

JSON is written compactly unless a request asks otherwise (`whitespace_flexible`): no
whitespace outside strings, keys in the schema's order, as OpenAI writes it; a weak
model given flexible whitespace pads with newlines until max_tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: The fields (top level of a request body) that carry a constraint.
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
#: The kinds a normalised constraint may have.
KINDS = ("json_schema", "regex", "choice", "grammar")
#: Keyword arguments of `llguidance.LLParserLimits` for every compile of a constraint
#: (the submit check, jobstore.grammars, and the engine alike), so what passes at submit
#: compiles in a worker: llguidance's defaults with a smaller grammar and lexer, and
#: short error messages (no parser state, no schema echoed back).
PARSER_LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 100_000,
    "max_grammar_size": 250_000,
    "verbose_errors": False,
}


class ConstraintError(ValueError):
    """A constraint field that is not well formed: `field` names it (dotted), the
    message says what is wrong."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def normalise(body: dict) -> tuple[str, dict | None]:
    """(the field that set it, the normalised constraint) of a request body, or
    ("", None) when it asks for none. The body is not changed.

    Raises ConstraintError for a malformed field or for two constraints on one line."""
    found = [(f, body[f]) for f in CONSTRAINT_FIELDS if body.get(f) is not None]
    out: list[tuple[str, dict]] = []
    for field, value in found:
        c = _one(field, value)
        if c is not None:
            out.append((field, c))
    if len(out) > 1:
        raise ConstraintError(
            out[1][0], f"only one constraint per line; {out[0][0]} already sets one"
        )
    return out[0] if out else ("", None)


def _one(field: str, value: Any) -> dict | None:
    if field == "response_format":
        return _response_format(value)
    if field == "structured_outputs":
        if not isinstance(value, dict):
            raise ConstraintError(field, f"must be an object, got {_show(value)}")
        given = {k: v for k, v in value.items() if v is not None}
        known = {"json", "regex", "choice", "grammar", "whitespace_flexible"}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConstraintError(f"{field}.{unknown[0]}", "not supported")
        kinds = [k for k in ("json", "regex", "choice", "grammar") if k in given]
        if len(kinds) != 1:
            raise ConstraintError(
                field, f"give exactly one of json, regex, choice, grammar; got {kinds or 'none'}"
            )
        flexible = _flag(f"{field}.whitespace_flexible", given.get("whitespace_flexible", False))
        return _kind(f"{field}.{kinds[0]}", kinds[0], given[kinds[0]], flexible)
    kind = field.removeprefix("guided_")
    return _kind(field, kind, value, False)


def _response_format(value: Any) -> dict | None:
    field = "response_format"
    if not isinstance(value, dict):
        raise ConstraintError(field, f"must be an object, got {_show(value)}")
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise ConstraintError(
            f"{field}.type", f'must be "text", "json_object" or "json_schema", got {_show(kind)}'
        )
    extra = sorted(set(value) - allowed[kind])
    if extra:
        raise ConstraintError(f"{field}.{extra[0]}", f"unknown field for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_schema", "schema": {"type": "object"}, "whitespace_flexible": False}
    spec = value.get("json_schema")
    where = f"{field}.json_schema"
    if not isinstance(spec, dict):
        raise ConstraintError(where, f"required: an object with a schema, got {_show(spec)}")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise ConstraintError(f"{where}.{extra[0]}", "unknown field")
    name = spec.get("name")
    if name is not None and (
        not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)
    ):
        raise ConstraintError(
            f"{where}.name", f"must be 1 to 64 letters, digits, '_' or '-', got {_show(name)}"
        )
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise ConstraintError(
            f"{where}.strict", f"must be true or false, got {_show(spec['strict'])}"
        )
    if "schema" not in spec:
        raise ConstraintError(f"{where}.schema", "required")
    return _kind(f"{where}.schema", "json", spec["schema"], False)


def _kind(field: str, kind: str, value: Any, flexible: bool) -> dict:
    if kind == "json":
        if isinstance(value, str):  # vLLM accepts a schema as a JSON string
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ConstraintError(field, f"not valid JSON: {exc}") from exc
        if not isinstance(value, (dict, bool)):
            raise ConstraintError(field, f"must be a JSON schema object, got {_show(value)}")
        if isinstance(value, dict):
            _guidance(field, value)
        return {"type": "json_schema", "schema": value, "whitespace_flexible": flexible}
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ConstraintError(field, f"must be a non-empty string, got {_show(value)}")
        return {"type": "regex", "pattern": value}
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise ConstraintError(
                field, f"must be a non-empty list of non-empty strings, got {_show(value)}"
            )
        return {"type": "choice", "choices": list(value)}
    if kind == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise ConstraintError(field, f"must be a non-empty grammar string, got {_show(value)}")
        return {"type": "grammar", "grammar": value}
    raise ConstraintError(field, f"unknown constraint kind {kind!r}")  # pragma: no cover


def _guidance(field: str, schema: dict) -> dict:
    # The schema's own llguidance options (its "x-guidance" object), to which ours are added.
    options = schema.get("x-guidance", {})
    if not isinstance(options, dict):
        raise ConstraintError(f"{field}.x-guidance", f"must be an object, got {_show(options)}")
    return options


def _flag(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConstraintError(field, f"must be true or false, got {_show(value)}")
    return value


def grammar(constraint: dict) -> str:
    """The llguidance grammar text of a normalised constraint (what
    `LLMatcher.grammar_from_json_schema`/`_regex`/`_lark` would build)."""
    kind = constraint["type"]
    if kind == "json_schema":
        schema = closed(constraint["schema"])
        options = {"whitespace_flexible": bool(constraint.get("whitespace_flexible", False))}
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {**_guidance("schema", schema), **options}}
        else:  # true / false: a schema with no room for options
            schema = {"anyOf": [schema], "x-guidance": options} if schema else False
        return _grammars({"name": "json_schema", "json_schema": schema, "lark_grammar": None})
    if kind == "regex":
        return _grammars(
            {
                "name": "regex",
                "json_schema": None,
                "lark_grammar": _lark_regex(constraint["pattern"]),
            }
        )
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint["choices"])
        return _grammars(
            {"name": "choice", "json_schema": None, "lark_grammar": f"start: {alternatives}"}
        )
    if kind == "grammar":
        return _grammars(
            {"name": "grammar", "json_schema": None, "lark_grammar": constraint["grammar"]}
        )
    raise ValueError(f"unknown constraint type {kind!r}")


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems", "items")


def closed(schema):
    """The schema with `additionalProperties: false` on every object schema that lists
    `properties` and says nothing of other keys, as OpenAI's strict mode requires and
    vLLM's default grammar backend assumes: a record gets the keys its schema names,
    not a weak model's inventions. Every output still validates against the schema as
    given. The input is not changed.

    Left open: an object that requires a key its `properties` do not list, and an object
    whose keys are spread over an intersection (`allOf` parts, `properties` beside a
    `$ref`, `anyOf` or `oneOf`), its parts and the `$defs` they refer to too. Closing
    them on their own keys would refuse the others (a valid schema that no longer
    compiles, or allows only {})."""
    shared: set[str] = set()
    while True:  # the $defs entries met as parts of an intersection, to a fixed point
        found: set[str] = set()
        out = _close(schema, "#" in shared, shared, found)
        if found <= shared:
            return out
        shared |= found


def _close(schema, part: bool, shared: set[str], found: set[str]):
    # part: the schema is one part of an intersection (its keys are not all its object's).
    if isinstance(schema, list):
        return [_close(s, part, shared, found) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    own = isinstance(out.get("properties"), dict)
    parts = own + sum(k in out for k in ("$ref", "anyOf", "oneOf"))
    parts += len(out["allOf"]) if isinstance(out.get("allOf"), list) else 0
    part = part or parts > 1
    if part and isinstance(out.get("$ref"), str):
        found.add(out["$ref"])
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {
                name: _close(s, f"#/{k}/{_pointer(name)}" in shared, shared, found)
                for name, s in out[k].items()
            }
    for k in set(_SCHEMA_ONE) | set(_SCHEMA_LISTS):
        if isinstance(out.get(k), (dict, list)) and k not in _SCHEMA_MAPS:
            out[k] = _close(out[k], part and k in ("allOf", "anyOf", "oneOf"), shared, found)
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    required = out.get("required") if isinstance(out.get("required"), list) else []
    beyond = own and any(k not in out["properties"] for k in required if isinstance(k, str))
    if own and not part and not beyond and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def _pointer(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _lark_regex(pattern: str) -> str:
    # As llguidance's grammar_from_regex (its regex_to_lark): the regex as one Lark
    # terminal, "/" escaped whether or not it was ("\/" is a valid regex), whitespace
    # written as escapes.
    out, escaped = [], False
    for c in pattern:
        prev, escaped = escaped, False
        if c == "/" or c in _LARK_WHITESPACE:
            out.append(_LARK_WHITESPACE.get(c, "\\/"))
        elif c == "\\" and not prev:
            escaped = True
        else:
            out.append("\\" + c if prev else c)
    return "start: /" + "".join(out) + "/"


_LARK_WHITESPACE = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _grammars(entry: dict) -> str:
    return json.dumps(
        {"grammars": [entry], "max_tokens": None}, ensure_ascii=False, separators=(",", ":")
    )


def key(constraint: dict) -> str:
    """A stable text key of a normalised constraint (for caches of compiled grammars).
    Keys keep their order: a schema's property order is the order its JSON output
    writes them in, so two schemas that differ only there compile to different grammars."""
    return json.dumps(constraint, ensure_ascii=False, separators=(",", ":"))


def _show(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False) if _jsonable(value) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True

"""Structured output requests: OpenAI's ``response_format`` and llama-server's
``grammar`` and ``json_schema`` fields, read into one :class:`OutputFormat`.

The server only reads and checks the fields; the runtime compiles the grammar and
constrains decoding. A request names at most one format: two would leave the reply's
shape ambiguous, so asking for both is a 400 naming the second field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tandem.app.server.api_error import ApiError
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.constrained import Grammar, GrammarError, GrammarSpec, compile_grammar

MAX_GRAMMAR_CHARS = 64 * 1024


@dataclass(frozen=True)
class OutputFormat:
    """The shape a reply must have: JSON under a schema, or text under a GBNF grammar."""

    kind: Literal["json_schema", "gbnf"]
    source: dict[str, Any] | str
    """The JSON schema (``{"type": "object"}`` for ``json_object``), or the GBNF text."""
    field: str
    """The request field it came from, named in a 400 when it cannot compile."""
    name: str | None = None
    """``response_format.json_schema.name``, when given."""
    strict: bool = True
    """A schema keyword the runtime cannot enforce is a 400 (``strict``); with
    ``response_format``'s ``strict: false`` it is ignored and the rest still holds."""


def parse_output_format(body: dict, *, chat: bool) -> OutputFormat | None:
    """The reply's required format from ``response_format``, ``json_schema`` or
    ``grammar`` (``None``: free text)."""
    found: list[OutputFormat] = []
    if body.get("response_format") is not None:
        fmt = _response_format(body["response_format"])
        if fmt is not None:
            found.append(fmt)
    if body.get("json_schema") is not None:
        found.append(OutputFormat("json_schema", _schema(body["json_schema"], "json_schema"), "json_schema"))
    if body.get("grammar") is not None:
        grammar = body["grammar"]
        if not isinstance(grammar, str) or not grammar.strip() or len(grammar) > MAX_GRAMMAR_CHARS:
            raise ApiError(400, f"'grammar' must be GBNF text of 1 to {MAX_GRAMMAR_CHARS} characters.",
                           "invalid_value", "grammar")
        found.append(OutputFormat("gbnf", grammar, "grammar"))
    if len(found) > 1:
        raise ApiError(400, f"'{found[0].field}' and '{found[1].field}' both constrain the reply; send one.",
                       "invalid_value", found[1].field)
    return found[0] if found else None


def _response_format(rf: Any) -> OutputFormat | None:
    where = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}.",
                       "invalid_value", where)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = rf.get("schema")  # llama-server's extension: a schema inside json_object
        return OutputFormat("json_schema", _schema(schema, f"{where}.schema") if schema is not None
                            else {"type": "object"}, where)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise ApiError(400, "'response_format.json_schema' must be {\"name\", \"schema\", \"strict\"}.",
                           "invalid_value", f"{where}.json_schema")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise ApiError(400, "'response_format.json_schema.name' must be a string.", "invalid_value",
                           f"{where}.json_schema.name")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ApiError(400, "'response_format.json_schema.strict' must be true or false.", "invalid_value",
                           f"{where}.json_schema.strict")
        schema = spec.get("schema", {"type": "object"})
        return OutputFormat("json_schema", _schema(schema, f"{where}.json_schema.schema"),
                            f"{where}.json_schema.schema", name, strict=strict is not False)
    raise ApiError(400, f"'response_format.type' must be text, json_object or json_schema, not {kind!r}.",
                   "invalid_value", f"{where}.type")


def _schema(schema: Any, where: str) -> dict[str, Any]:
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise ApiError(400, f"'{where}' must be a JSON schema (an object).", "invalid_value", where)
    return schema


def compile_format(target: Backend, fmt: OutputFormat) -> Grammar:
    """``fmt`` compiled for ``target``'s vocabulary by the runtime; a 400 naming the
    field when the schema or grammar cannot compile."""
    try:
        return compile_grammar(GrammarSpec(fmt.kind, fmt.source, strict=fmt.strict), target)
    except GrammarError as exc:
        raise ApiError(400, f"'{fmt.field}': {exc}", "invalid_grammar" if fmt.kind == "gbnf" else "invalid_schema",
                       fmt.field) from None

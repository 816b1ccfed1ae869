"""Compiling a grammar: every kind compiles, and what cannot compile gives one readable
message (the server's 400, `tandem run`'s one line) instead of a traceback."""

from __future__ import annotations

import numpy as np
import pytest
from toy_grammar import BYTES, REGEX, GrammarToy
from toy_models import random_table

from tandem.errors import TandemError
from tandem.runtime.constrained import GrammarError, GrammarSpec, GrammarState, compile_grammar


@pytest.fixture(scope="module")
def toy() -> GrammarToy:
    return GrammarToy(random_table(len(BYTES), np.random.default_rng(0)), pieces=BYTES)


@pytest.mark.parametrize("spec", [
    GrammarSpec("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}),
    GrammarSpec("json_schema", '{"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}'),
    GrammarSpec("json_object"),
    GrammarSpec("gbnf", 'root ::= "ab" [cd]+\n'),
    GrammarSpec("regex", REGEX),
    GrammarSpec("lark", 'start: "a" /[bc]+/'),
])
def test_every_kind_compiles(toy, spec) -> None:
    state = GrammarState(compile_grammar(spec, toy))
    assert state.allowed().any() and not state.done


@pytest.mark.parametrize(("spec", "says"), [
    (GrammarSpec("json_schema", '{"type": "object",'), "not valid JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
    (GrammarSpec("json_schema", {"type": "strin"}), "JSON schema"),
    (GrammarSpec("json_schema", {"type": "string", "format": "no-such-format"}, strict=True), "JSON schema"),
    (GrammarSpec("gbnf", 'root ::= "a" ('), "GBNF grammar"),
    (GrammarSpec("gbnf", "root ::= other\n"), "GBNF grammar"),
    (GrammarSpec("gbnf", "   "), "empty"),
    (GrammarSpec("regex", "a(b"), "regular expression"),
    (GrammarSpec("yaml", "a: b"), "Unknown grammar kind"),  # type: ignore[arg-type]
])
def test_what_cannot_compile_says_why_in_one_line(toy, spec, says) -> None:
    with pytest.raises(GrammarError) as caught:
        compile_grammar(spec, toy)
    message = str(caught.value)
    assert isinstance(caught.value, TandemError)
    assert says in message and "\n" not in message and len(message) < 400, message


def test_a_lenient_schema_ignores_what_a_strict_one_refuses(toy) -> None:
    schema = {"type": "string", "format": "no-such-format"}
    with pytest.raises(GrammarError):
        compile_grammar(GrammarSpec("json_schema", schema, strict=True), toy)
    assert compile_grammar(GrammarSpec("json_schema", schema, strict=False), toy).spec.strict is False

"""Compiling a grammar: every kind compiles, and what cannot compile gives one readable
message (the server's 400, `tandem run`'s one line) instead of a traceback."""

from __future__ import annotations

import numpy as np
import pytest
from toy_grammar import BYTES, REGEX, GrammarToy
from toy_models import random_table

from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.constrained import GrammarError, GrammarSpec, GrammarState, compile_grammar
from tandem.runtime.constrained.json_numbers import JsonLex
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.generate import autoregressive, generate


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


def _legal(toy: GrammarToy, spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` is a whole reply the grammar accepts."""
    state = GrammarState(compile_grammar(spec, toy))
    tokens = toy.tokenize(text)
    if state.legal_prefix(tokens) < len(tokens):
        return False
    state.consume(tokens)
    return state.accepting


@pytest.mark.parametrize(("schema", "reply", "legal"), [
    # An object lists its keys: only those (as llama-server and OpenAI's strict mode read it).
    ({"type": "object", "properties": {"x": {"type": "integer"}}}, '{"x": 1}', True),
    ({"type": "object", "properties": {"x": {"type": "integer"}}}, '{"x": 1, "y": 2}', False),
    ({"properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
     '{"a": {"b": 1, "c": 2}}', False),
    ({"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}}}}, "$ref": "#/$defs/n"},
     '{"v": 1, "w": 2}', False),
    # ...unless the schema says other keys may come.
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": True},
     '{"x": 1, "y": 2}', True),
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": {"type": "string"}},
     '{"x": 1, "y": "z"}', True),
    ({"type": "object"}, '{"y": 2}', True),
    # allOf members stay open: each closed to its own keys would admit no object.
    ({"allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, '{"a": 1, "b": 2}', True),
])
def test_an_objects_listed_properties_are_all_it_holds(toy, schema, reply, legal) -> None:
    assert _legal(toy, GrammarSpec("json_schema", schema), reply) is legal


def _digits_allowed_after(toy: GrammarToy, spec: GrammarSpec, text: str) -> bool:
    state = GrammarState(compile_grammar(spec, toy))
    state.consume(toy.tokenize(text))
    return bool(state.allowed()[toy.tokenize("7")].all())


NUMBER = GrammarSpec("json_schema", {"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"}}})


def test_a_numbers_parts_stop_at_sixteen_digits_as_in_llama_cpp(toy) -> None:
    """A model pushing against a closed object writes digits until its tokens run out
    (seen on the real 1.5B); like llama.cpp's grammars, each part of a number ends at 16."""
    assert _digits_allowed_after(toy, NUMBER, '{"x": 1' + "2" * 14)
    assert not _digits_allowed_after(toy, NUMBER, '{"x": 1' + "2" * 15)
    assert _digits_allowed_after(toy, NUMBER, '{"x": 1' + "2" * 15 + ".")  # the fraction: 16 more
    assert not _digits_allowed_after(toy, NUMBER, '{"x": 1.' + "2" * 16)
    assert _legal(toy, NUMBER, '{"x": -1234567890123456.1234567890123456e+1234567890123456}')
    # Inside a string, digits are text: no bound (escaped quotes included).
    assert _digits_allowed_after(toy, NUMBER, '{"s": "\\"' + "9" * 40)
    # A GBNF grammar bounds its own numbers.
    assert _digits_allowed_after(toy, GrammarSpec("gbnf", 'root ::= [0-9]+'), "9" * 40)


def test_the_json_lexer_follows_strings_and_escapes() -> None:
    lex = JsonLex()
    for piece in (b'{"a\\"12', b'3": 45', b"6"):
        lex = lex.after(piece)
    assert lex == JsonLex(in_string=False, escaped=False, digits=3)
    assert JsonLex().after(b'"12\\').escaped and JsonLex().after(b'"12').in_string


DEAD_END = GrammarSpec("gbnf", 'root ::= "a" loop | "b" "c"\nloop ::= loop "b"\n')
"""``a`` is legal (llguidance allows it) but leads where nothing may follow: ``loop``
never ends."""


def test_a_grammar_with_no_way_on_is_an_error_not_a_quiet_end(toy) -> None:
    """llguidance's mask in an error state allows only end-of-generation: committed, the
    reply would end half-written with a normal stop."""
    state = GrammarState(compile_grammar(DEAD_END, toy))
    state.consume(toy.tokenize("a"))
    with pytest.raises(GrammarError, match="allows nothing after the reply so far"):
        state.allowed()


def test_a_draft_token_with_no_way_on_ends_the_legal_prefix(toy) -> None:
    """Only the model's own pick of such a token is an error; a draft holding one is cut
    before it, and the state is left as it was (llguidance cannot roll back an error)."""
    state = GrammarState(compile_grammar(DEAD_END, toy))
    a, b, c = toy.tokenize("abc")
    assert state.legal_prefix([a, b]) == 0
    assert state.tokens == [] and set(np.flatnonzero(state.allowed())) == {a, b}
    assert state.legal_prefix([b, c]) == 2
    state.consume([b])
    assert state.legal_prefix([c]) == 1 and state.follow([b, c]) == 2 and state.accepting
    assert state.follow([a, b]) == 0 and state.tokens == []


def test_a_forced_run_stops_before_a_token_with_no_way_on(toy) -> None:
    """The grammar forces ``ab``; after ``b`` nothing may follow. The run is ``a`` alone:
    the model's own pick of ``b`` (its only legal token) is the error."""
    state = GrammarState(compile_grammar(GrammarSpec("gbnf", 'root ::= "ab" loop\nloop ::= loop "b"\n'), toy))
    a, b = toy.tokenize("ab")
    assert state.forced() == [a] and state.tokens == []
    state.consume([a])
    assert np.flatnonzero(state.allowed()).tolist() == [b]
    state.consume([b])
    with pytest.raises(GrammarError, match="allows nothing"):
        state.allowed()


def test_constrained_decoding_into_a_dead_end_raises(toy) -> None:
    """Here ``ab`` is the only legal start: the model must take it (forced or not)."""
    grammar = compile_grammar(GrammarSpec("gbnf", 'root ::= "ab" loop\nloop ::= loop "b"\n'), toy)
    for forced_rounds in (False, True):
        with pytest.raises(GrammarError, match="allows nothing"):
            list(generate(toy, toy.tokenize("x"), Sampler(SamplingParams(temperature=0.0)),
                          strategy=constrained(autoregressive, grammar, forced_rounds=forced_rounds), max_tokens=4))

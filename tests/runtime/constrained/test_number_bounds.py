"""A number under a JSON schema always ends. Each part of a number stops at 16 digits;
where the schema lets it end no sooner (``multipleOf``, a bound that needs more digits),
only the shortest way out is legal, and a ``multipleOf`` whose way out can be longer is
refused (strict) or ignored (lenient). Before, the bound was dropped there and a model
that wanted ``{"n": 1777...`` under ``multipleOf: 7`` wrote sevens until ``max_tokens``
(seen on the real 0.5B): no JSON at all.

The model here is an adversary over a vocabulary of single bytes: it writes the digits it
wants where they are legal, another digit where they are not, and stops writing digits
only when no digit is legal."""

from __future__ import annotations

import json
import re
from itertools import chain, repeat

import jsonschema
import numpy as np
import pytest
from toy_grammar import BYTES, GrammarToy
from toy_models import random_table

from tandem.runtime.constrained import GrammarError, GrammarSpec, GrammarState, compile_grammar
from tandem.runtime.constrained.json_numbers import (
    MAX_DIGITS,
    MAX_OVERRUN,
    bounded_multiple,
    digit_tokens,
    unbounded_multiples,
)

EOS = len(BYTES) - 1
DIGITS = [ord(c) for c in "0123456789"]


@pytest.fixture(scope="module")
def toy() -> GrammarToy:
    return GrammarToy(random_table(len(BYTES), np.random.default_rng(0)), pieces=BYTES)


def obj(number: dict) -> dict:
    return {"type": "object", "properties": {"n": number}, "required": ["n"]}


def pushed(state: GrammarState, wanted: str, max_tokens: int = 120) -> str | None:
    """The reply of a model that wants to write ``wanted`` (then its last character
    forever) wherever the grammar leaves it a choice: the wanted character where legal,
    else the lowest legal digit, else the first legal token that does not end the reply.
    ``None`` if it has not ended after ``max_tokens`` tokens."""
    want = chain(wanted, repeat(wanted[-1]))
    next_wanted = ord(next(want))
    for _ in range(max_tokens):
        row = state.allowed()
        if row[next_wanted]:
            token = next_wanted
            next_wanted = ord(next(want))
        elif row[DIGITS].any():
            token = DIGITS[int(np.argmax(row[DIGITS]))]
        elif row[:EOS].any():
            token = int(np.argmax(row[:EOS]))
        else:
            return b"".join(BYTES[t] for t in state.tokens).decode()
        state.consume([token])
    return None


def longest_digit_run(text: str) -> int:
    return max(len(run) for run in re.findall(r"[0-9]+", text))


@pytest.mark.parametrize(("number", "wanted"), [
    ({"type": "integer", "multipleOf": 7}, "1777"),  # 1777...7 is no multiple of 7, ever
    ({"type": "integer", "multipleOf": 2}, "1777"),
    ({"type": "integer", "multipleOf": 1000}, "1777"),
    ({"type": "integer", "multipleOf": 1024}, "1777"),  # up to 4 digits past the bound
    ({"type": "integer", "multipleOf": 7, "exclusiveMinimum": 5}, "1000"),
    ({"type": "integer", "multipleOf": 7, "minimum": 10**17}, "1000"),  # 18 digits at least
    ({"type": "number", "multipleOf": 7}, "1777"),
    ({"type": "number", "multipleOf": 2.5}, "1333"),  # neither N nor N.5 a multiple
    ({"type": "number", "exclusiveMinimum": 0}, "0.000"),  # 0.000... is never above 0
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "0.000"),
])
def test_a_number_the_schema_keeps_open_past_the_bound_still_ends(toy, number, wanted) -> None:
    schema = obj(number)
    reply = pushed(GrammarState(compile_grammar(GrammarSpec("json_schema", schema), toy)), '{"n": ' + wanted)
    assert reply is not None, "the number never ended"
    jsonschema.validate(json.loads(reply), schema)
    assert longest_digit_run(reply) <= MAX_DIGITS + MAX_OVERRUN, reply


@pytest.mark.parametrize("number", [{"type": "integer"}, {"type": "number"}, {"type": "integer", "multipleOf": 1},
                                    {"type": "number", "multipleOf": 0.01}, {"type": "integer", "maximum": 1e30}])
def test_a_number_the_schema_lets_end_stops_at_the_bound(toy, number) -> None:
    schema = obj(number)
    reply = pushed(GrammarState(compile_grammar(GrammarSpec("json_schema", schema), toy)), '{"n": 1777')
    assert reply is not None
    jsonschema.validate(json.loads(reply), schema)
    assert longest_digit_run(reply) == MAX_DIGITS, reply


def test_past_the_bound_only_the_shortest_ways_out_are_legal(toy) -> None:
    state = GrammarState(compile_grammar(GrammarSpec("json_schema", obj({"type": "integer", "multipleOf": 7})), toy))
    head = 1777777777777777  # 16 digits, no multiple of 7
    state.consume(toy.tokenize(f'{{"n": {head}'))
    legal = {BYTES[t].decode() for t in np.flatnonzero(state.allowed())}
    assert legal == {str(d) for d in range(10) if (head * 10 + d) % 7 == 0}
    # One digit more and the number may only end: every way on is shut again.
    state.consume(toy.tokenize(min(legal)))
    assert {BYTES[t] for t in np.flatnonzero(state.allowed())} == {b"}"}


def test_the_search_leaves_the_state_where_it_was(toy) -> None:
    state = GrammarState(compile_grammar(GrammarSpec("json_schema", obj({"type": "integer", "multipleOf": 1000})), toy))
    text = '{"n": 1' + "7" * 15
    state.consume(toy.tokenize(text))
    assert {BYTES[t] for t in np.flatnonzero(state.allowed())} == {b"0"}  # ...7000
    assert state.tokens == toy.tokenize(text) and state.legal_prefix(toy.tokenize("000}")) == 4


@pytest.mark.parametrize("value", [12345, 10001, 1.23457, 1e20])
def test_a_multiple_of_with_a_longer_way_out_is_refused_when_strict(toy, value) -> None:
    schema = obj({"type": "integer", "multipleOf": value})
    with pytest.raises(GrammarError) as caught:
        compile_grammar(GrammarSpec("json_schema", schema), toy)
    message = str(caught.value)
    assert f"multipleOf {value}" in message and "strict: false" in message and "\n" not in message


def test_a_lenient_schema_ignores_a_multiple_of_with_a_longer_way_out(toy) -> None:
    schema = obj({"type": "integer", "multipleOf": 12345})
    state = GrammarState(compile_grammar(GrammarSpec("json_schema", schema, strict=False), toy))
    reply = pushed(state, '{"n": 1777')
    assert reply is not None and isinstance(json.loads(reply)["n"], int)


@pytest.mark.parametrize(("value", "bounded"), [
    (7, True), (1000, True), (10000, True), (10001, False), (123457, False),
    (0.01, True), (99.99, True), (1.2345, True), (1.23457, False),  # 2469/2000 and 123457/100000
    (True, True), (float("inf"), True), ("7", True),  # no number: llguidance's to refuse
])
def test_which_multiples_can_be_bounded(value, bounded) -> None:
    assert bounded_multiple(value) is bounded


def test_unbounded_multiples_are_found_in_subschemas_and_not_in_data() -> None:
    schema = {
        "type": "object",
        "properties": {"multipleOf": {"type": "integer", "multipleOf": 123457}, "ok": {"multipleOf": 5}},
        "$defs": {"d": {"anyOf": [{"type": "number", "multipleOf": 98765}, {"type": "null"}]}},
        "const": {"multipleOf": 99999},
        "examples": [{"multipleOf": 99999}],
    }
    stripped, found = unbounded_multiples(schema)
    assert sorted(found) == [98765, 123457]
    assert stripped["properties"] == {"multipleOf": {"type": "integer"}, "ok": {"multipleOf": 5}}
    assert stripped["$defs"]["d"]["anyOf"][0] == {"type": "number"}
    assert stripped["const"] == schema["const"] and stripped["examples"] == schema["examples"]
    assert schema["properties"]["multipleOf"]["multipleOf"] == 123457  # the caller's schema is kept


def test_digit_tokens_take_one_token_per_digit() -> None:
    assert digit_tokens(BYTES) == tuple(DIGITS)
    assert digit_tokens([b"1", b"12", b"a", b"1", b"0"]) == (4, 0)

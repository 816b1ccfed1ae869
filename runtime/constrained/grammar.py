"""What a caller asks the output to follow, compiled for one model's vocabulary.

The grammars and token masks come from **llguidance** (the library llama.cpp itself
links for its ``--grammar`` alternative). It was chosen over xgrammar, outlines-core and
llama.cpp's own GBNF sampler, measured on Qwen2.5's 151,936-token vocabulary (one CPU
thread, a six-field extraction schema):

* speed: a schema compiles in ~1 ms and a token mask takes ~14 µs (median, 62 µs at the
  90th percentile); xgrammar is as fast per mask (4 µs median, 97 µs at the 90th) but
  outlines-core builds a regex index per schema (0.8 s) and answers a step in ~1.5 ms,
  and llama.cpp's sampler checks every candidate token against the grammar stacks;
* drafts: ``validate_tokens`` says in one call how long a draft's legal prefix is,
  ``rollback(n)`` undoes any number of tokens (xgrammar keeps a bounded history, set
  when the matcher is made), and ``compute_ff_tokens`` returns the forced continuation
  as *tokens* of this vocabulary (xgrammar's jump-forward gives a string to re-tokenize);
* inputs: JSON schema (with options for separators and lenient/strict keywords), GBNF
  (converted to its Lark dialect), regex and Lark, from one compiler;
* the tokenizer is built from the backend itself (each token's bytes and its
  ``tokenize``), so it works offline for every backend (GGUF, ONNX, torch) with no
  tokenizer files from the hub, and its masks need numpy only (no torch).

Building the tokenizer takes ~1.5 s for a 152k vocabulary, so it is built once per
backend and kept while the backend lives.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import llguidance
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from tandem.errors import TandemError
from tandem.runtime.backends.protocol import Backend
from tandem.runtime.constrained.json_numbers import (
    MAX_DIGITS,
    MAX_OVERRUN,
    digit_tokens,
    leading_digits,
    unbounded_multiples,
)
from tandem.runtime.speculative.drafters.xvocab.vocab_pair import adds_space_prefix

GrammarKind = Literal["json_schema", "json_object", "gbnf", "regex", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "gbnf", "regex", "lark")

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is written with one fixed layout (``{"a": 1, "b": [2, 3]}``, as ``json.dumps``
writes it): every brace, quote, key and separator of a schema is then forced, so it is
committed without asking the model (free whitespace would leave each one to the model)."""


class GrammarError(TandemError):
    """A schema or grammar that cannot be compiled (the server answers 400)."""

    exit_code = 8


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the output, as the user gave it.

    ``kind``: ``json_schema`` (``source``: the schema, a dict or its JSON text),
    ``json_object`` (any JSON object; ``source`` unused), ``gbnf`` (llama.cpp's grammar
    format, rule ``root`` first), ``regex`` or ``lark``. ``strict`` (JSON schema only):
    a keyword the compiler cannot enforce is an error; otherwise it is ignored and the
    rest of the schema still holds (OpenAI's ``strict: false``).
    """

    kind: GrammarKind
    source: str | dict | None = None
    strict: bool = True


@dataclass(frozen=True)
class Grammar:
    """A :class:`GrammarSpec` compiled for one vocabulary: make a
    :class:`~tandem.runtime.constrained.state.GrammarState` per request from it."""

    spec: GrammarSpec
    definition: str
    """The grammar in llguidance's own form."""
    tokenizer: LLTokenizer
    n_vocab: int
    eog: tuple[int, ...]
    """End-of-generation tokens: legal where the grammar is complete."""
    pieces: list[bytes] = field(repr=False, compare=False)
    """Each token's bytes."""
    leading_digits: np.ndarray | None = field(default=None, repr=False, compare=False)
    """JSON grammars: per token, the digits it begins with, to bound a number's parts
    (:mod:`.json_numbers`); ``None`` for the others (a GBNF grammar says its own)."""
    digit_tokens: tuple[int, ...] = field(default=(), repr=False, compare=False)
    """JSON grammars: one token per decimal digit, to search a number's way to its end
    where the schema lets it end no sooner than past the bound (:mod:`.json_numbers`)."""

    def matcher(self) -> LLMatcher:
        m = LLMatcher(self.tokenizer, self.definition, log_level=0)
        if m.is_error():  # compile_grammar validated it; a limit hit on this vocabulary
            raise GrammarError(f"The {_what(self.spec)} cannot be used: {_clean(m.get_error())}")
        return m


def _what(spec: GrammarSpec) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar", "gbnf": "GBNF grammar",
            "regex": "regular expression", "lark": "Lark grammar"}.get(spec.kind, "grammar")


def _clean(message: str) -> str:
    """llguidance's message on one line, without its internal prefixes."""
    return " ".join(message.replace("Error: ", "").split())


def definition(spec: GrammarSpec) -> str:
    """``spec`` in llguidance's form (syntax not yet checked against a vocabulary)."""
    if spec.kind not in KINDS:
        raise GrammarError(f"Unknown grammar kind {spec.kind!r}: use one of {', '.join(KINDS)}.")
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    source = spec.source
    if spec.kind == "json_schema":
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"The JSON schema is not valid JSON: {exc}.") from None
        if isinstance(source, bool):
            source = {} if source else {"not": {}}
        if not isinstance(source, dict):
            raise GrammarError("A JSON schema must be a JSON object.")
        schema, unbounded = unbounded_multiples(closed_objects(source))
        if unbounded and spec.strict:
            raise GrammarError(_unbounded_message(unbounded[0]))
        options = {**JSON_OPTIONS, "lenient": not spec.strict}
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"The JSON schema cannot be used: {_clean(str(exc))}") from None
    if not isinstance(source, str) or not source.strip():
        raise GrammarError(f"The {_what(spec)} is empty.")
    try:
        return llguidance.grammar_from(spec.kind, source)
    except (ValueError, TypeError, KeyError) as exc:
        raise GrammarError(f"The {_what(spec)} cannot be used: {_clean(str(exc))}") from None


def _unbounded_message(value: float) -> str:
    return (f"The JSON schema cannot be used: multipleOf {value} cannot be enforced with Tandem's bound on a "
            f"number's digits ({MAX_DIGITS} a part), as a multiple of it can need more than {MAX_OVERRUN} digits past "
            f"the bound to end; use a multipleOf whose numerator in lowest terms is at most {10**MAX_OVERRUN}, "
            "or strict: false to ignore it.")


_COMPOSED = ("anyOf", "oneOf", "items", "prefixItems", "additionalProperties")


def closed_objects(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with every object that lists ``properties`` but says nothing of other
    keys closed to them (``additionalProperties: false``).

    JSON Schema lets such an object hold any other key, and a model left free writes
    some (``{"x": 1, "y": 2, "z": 3}`` for a schema of ``x`` alone, seen on the real
    1.5B). llama-server, and Ollama and LM Studio through it, read the schema as closed,
    and OpenAI's strict mode requires it to be; so does Tandem. A schema that allows
    other keys (``additionalProperties`` or ``patternProperties`` given) keeps them, and
    the members of an ``allOf`` stay open, as closing each to its own keys would leave
    their intersection no object at all."""
    if isinstance(schema, list):
        return [closed_objects(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions", "patternProperties") \
                and isinstance(value, dict):
            out[key] = {name: closed_objects(sub) for name, sub in value.items()}
        elif key == "allOf":
            out[key] = closed_objects(value, in_all_of=True)
        elif key in _COMPOSED:
            out[key] = closed_objects(value)
        else:
            out[key] = value
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if isinstance(schema.get("properties"), dict) and not in_all_of and not any(k in schema for k in open_keys):
        out["additionalProperties"] = False
    return out


class _VocabTokens:
    """A backend's vocabulary as llguidance's tokenizer wrapper reads it."""

    def __init__(self, target: Backend, pieces: list[bytes]) -> None:
        special = target.special
        self.eos_token_id = special.eos if special.eos is not None else min(special.eog, default=0)
        self.bos_token_id = special.bos
        # Control tokens write no bytes; llguidance marks special tokens with a 0xFF prefix.
        self.special_token_ids = [t for t, b in enumerate(pieces) if not b]
        self.tokens = [b or b"\xff<|%d|>" % t for t, b in enumerate(pieces)]
        self._tokenize = target.tokenize
        # A SentencePiece vocabulary (Llama 2, Mistral, the stories models) writes a space
        # before the text it tokenizes ("{" -> " ", "{"): llguidance asks for the tokens
        # of text that goes on a reply, so that space must go. Tokenizing after a newline
        # and dropping the newline's tokens gives them.
        self._lead = self._raw(_LEAD) if adds_space_prefix(target, pieces) else []

    def _raw(self, text: str) -> list[int]:
        return self._tokenize(text, add_bos=False, special=False)

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):  # tells llguidance to pass str
            raise TypeError("text, not bytes")
        if not self._lead:
            return self._raw(text)
        ids = self._raw(_LEAD + text)
        return ids[len(self._lead):] if ids[: len(self._lead)] == self._lead else self._raw(text)


_LEAD = "\n"
"""What a vocabulary that writes a leading space tokenizes before a text (see
:class:`_VocabTokens`): a newline, which merges with nothing after it."""


@dataclass
class Vocab:
    """One backend's vocabulary as the grammars need it, built once per backend."""

    tokenizer: LLTokenizer
    pieces: list[bytes]
    """Each token's bytes (control tokens: none)."""

    @functools.cached_property
    def leading_digits(self) -> np.ndarray:
        """Per token, the digits its bytes begin with (for JSON's :data:`MAX_DIGITS`)."""
        return leading_digits(self.pieces)

    @functools.cached_property
    def digit_tokens(self) -> tuple[int, ...]:
        """One token per decimal digit (the steps of a number's way out of the bound)."""
        return digit_tokens(self.pieces)


_vocabs: weakref.WeakKeyDictionary[Backend, Vocab] = weakref.WeakKeyDictionary()
_vocabs_lock = threading.Lock()


def vocab_of(target: Backend) -> Vocab:
    """``target``'s :class:`Vocab` (llguidance's tokenizer takes ~1.5 s for 152k tokens)."""
    with _vocabs_lock:
        vocab = _vocabs.get(target)
        if vocab is None:
            pieces = [target.token_bytes(t) for t in range(target.n_vocab)]
            eog = sorted(target.special.eog) or None
            wrapped = llguidance.TokenizerWrapper(_VocabTokens(target, pieces))
            vocab = Vocab(LLTokenizer(wrapped, n_vocab=target.n_vocab, eos_token=eog), pieces)
            _vocabs[target] = vocab
        return vocab


def compile_grammar(spec: GrammarSpec, target: Backend) -> Grammar:
    """Compile ``spec`` for ``target``'s vocabulary, or raise :class:`GrammarError` with a
    readable message (bad JSON, an unknown keyword in a strict schema, a GBNF syntax error...)."""
    text = definition(spec)
    vocab = vocab_of(target)
    message = LLMatcher.validate_grammar(text, vocab.tokenizer)
    if message:
        raise GrammarError(f"The {_what(spec)} cannot be used: {_clean(message)}")
    json_like = spec.kind in ("json_schema", "json_object")
    grammar = Grammar(spec, text, vocab.tokenizer, target.n_vocab, tuple(sorted(target.special.eog)),
                      vocab.pieces, vocab.leading_digits if json_like else None,
                      vocab.digit_tokens if json_like else ())
    grammar.matcher()  # limits that only show on this vocabulary
    return grammar

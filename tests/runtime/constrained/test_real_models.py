"""Constrained decoding on the real quantized models: greedy output with every drafter
(same vocabulary, other vocabulary, model-free) is plain constrained greedy output token
for token, it is valid JSON of the schema, and forced runs are committed for free."""

from __future__ import annotations

import json

import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.chat import chat_prompt
from tandem.runtime.constrained import GrammarSpec, compile_grammar
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.generate import DoneEvent, autoregressive, generate
from tandem.runtime.speculative.drafters.prediction import Prediction
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
REQUEST = "Maria Lopez, 34, writes Rust and Go at work. Give her record as JSON."
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def target(real_models):
    backend = LlamaCppBackend(real_models.qwen_15b, LlamaConfig(n_ctx=1024, n_threads=2))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def grammar(target):
    return compile_grammar(GrammarSpec("json_schema", SCHEMA), target)


@pytest.fixture(scope="module")
def prompt(target) -> list[int]:
    return chat_prompt(target, [{"role": "user", "content": REQUEST}])[0]


def decode(target, prompt, strategy, params=None) -> DoneEvent:
    target.truncate(0)
    sampler = Sampler(params or SamplingParams.greedy_params())
    done = list(generate(target, prompt, sampler, strategy=strategy, max_tokens=MAX_TOKENS))[-1]
    assert isinstance(done, DoneEvent)
    return done


@pytest.fixture(scope="module")
def plain(target, grammar, prompt) -> DoneEvent:
    return decode(target, prompt, constrained(autoregressive, grammar, forced_rounds=False))


def test_plain_constrained_reply_is_the_schema_and_ends_there(plain) -> None:
    record = json.loads(plain.text)
    assert set(record) == {"name", "age", "languages"} and isinstance(record["age"], int)
    assert plain.stats.finish_reason == "stop"


def test_forced_runs_cost_no_call_and_change_no_token(target, grammar, prompt, plain) -> None:
    forced = decode(target, prompt, constrained(autoregressive, grammar))
    assert forced.tokens == plain.tokens
    assert forced.stats.forced_tokens >= 8  # keys, quotes, separators
    assert forced.stats.target_calls < plain.stats.target_calls


@pytest.mark.parametrize(("mode", "drafter", "k"), [
    ("model", "qwen_05b", 4),
    ("xvocab", "smollm2", 4),
    ("ngram", None, None),
    ("auto", "qwen_05b", None),
])
def test_greedy_speculative_constrained_output_is_plain_constrained_output(target, grammar, prompt, plain,
                                                                          real_models, mode, drafter, k) -> None:
    draft = getattr(real_models, drafter) if drafter else None
    strategy = build_strategy(target, draft, SpecOptions(mode=mode, draft_length=k, measure_cost=False))
    try:
        spec = decode(target, prompt, constrained(strategy, grammar))
    finally:
        strategy.close()
    assert spec.tokens == plain.tokens
    if k:
        assert spec.stats.accepted_tokens > 0  # the drafter's legal drafts were taken


def test_seeded_constrained_sampling_repeats_with_speculation(target, grammar, prompt, real_models) -> None:
    params = SamplingParams(temperature=0.8, seed=99)
    plain = decode(target, prompt, constrained(autoregressive, grammar, forced_rounds=False), params)
    strategy = build_strategy(target, real_models.qwen_05b, SpecOptions(mode="model", draft_length=4,
                                                                        measure_cost=False))
    try:
        spec = decode(target, prompt, constrained(strategy, grammar), params)
    finally:
        strategy.close()
    assert spec.tokens == plain.tokens
    json.loads(spec.text)


def test_values_copied_from_the_request_are_drafted_by_text_lookup(target, grammar, prompt, plain,
                                                                   monkeypatch) -> None:
    """Model-free drafting under the grammar asks text lookup first (the suffix tree knows
    only this request, not the replies of the tests before): "Maria Lopez" in the
    request is ``" Maria", " Lopez"``, and after ``"name": "`` the reply's ``"Maria"`` is
    another token, which token lookup cannot match. Output stays plain constrained output."""
    from tandem.runtime.speculative.drafters.text_lookup import TextLookupDrafter

    drafts: list[list[int]] = []
    propose = TextLookupDrafter.propose

    def spy(self, context, max_tokens, sampler):
        draft = propose(self, context, max_tokens, sampler)
        if draft.tokens:
            drafts.append(draft.tokens)
        return draft

    monkeypatch.setattr(TextLookupDrafter, "propose", spy)
    strategy = build_strategy(target, None, SpecOptions(mode="ngram", draft_length=2, measure_cost=False,
                                                             suffix_memory="request"))
    try:
        spec = decode(target, prompt, constrained(strategy, grammar))
    finally:
        strategy.close()
    assert spec.tokens == plain.tokens
    assert [target.tokenize(" Lopez")[0]] in [d[:1] for d in drafts]
    assert spec.stats.accepted_tokens > 0


def test_a_vocabulary_that_writes_a_leading_space_decodes_under_a_schema(stories260k) -> None:
    """A SentencePiece vocabulary (Llama 2's, as the stories models have) tokenizes "{" as
    " ", "{": llguidance's forced text came back with that space, and the first forced
    token was refused ("A token the grammar does not allow was committed")."""
    backend = LlamaCppBackend(stories260k, LlamaConfig(n_ctx=128, n_threads=1))
    try:
        schema = {"type": "object", "properties": {"hero": {"type": "string", "maxLength": 12}}, "required": ["hero"]}
        grammar = compile_grammar(GrammarSpec("json_schema", schema), backend)
        prompt = backend.tokenize("Once upon a time", add_bos=True)
        done = list(generate(backend, prompt, Sampler(SamplingParams.greedy_params()),
                             strategy=constrained(autoregressive, grammar), max_tokens=40))[-1]
        assert isinstance(done, DoneEvent) and done.stats.forced_tokens > 0
        assert set(json.loads(done.text)) == {"hero"}
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["the reply", "a pretty-printed edit"])
def test_a_predicted_reply_under_a_schema_changes_no_token(target, grammar, prompt, plain, kind) -> None:
    """A prediction's drafts are cut to what the grammar allows like any draft's: a client
    predicting the record (or another layout of it, with another name) gets the reply plain
    constrained decoding gives, and the right prediction is drafted from."""
    record = json.loads(plain.text)
    text = plain.text if kind == "the reply" else json.dumps(record | {"name": "Marie Lopez"}, indent=2)
    strategy = build_strategy(target, None, SpecOptions(mode="ngram", draft_length=8, measure_cost=False))
    try:
        predicted = strategy.predicting(Prediction(target.tokenize(text)), len(prompt))
        spec = decode(target, prompt, constrained(predicted, grammar))
    finally:
        strategy.close()
    assert spec.tokens == plain.tokens
    if kind == "the reply":
        assert spec.stats.accepted_tokens >= len(plain.tokens) / 2  # 18 of 24, in 4 target calls

"""On the real 0.5B, asked for a number the schema cannot take (1 followed by sevens,
under ``multipleOf: 7``), the constrained reply still ends, as JSON of the schema. Before,
the 16-digit bound was dropped where the schema would not let the number end, and the
reply was ``{"n": 16000000000000000000...`` until ``max_tokens``."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import LlamaConfig
from tandem.runtime.chat import chat_prompt
from tandem.runtime.constrained import GrammarSpec, compile_grammar
from tandem.runtime.constrained.strategy import constrained
from tandem.runtime.generate import DoneEvent, autoregressive, generate

REQUEST = "Write the number 1 followed by 60 sevens, as JSON."


@pytest.fixture(scope="module")
def target(real_models):
    backend = LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=1024, n_threads=2))
    yield backend
    backend.close()


@pytest.mark.parametrize("kind", ["integer", "number"])
def test_a_number_pushed_past_the_bound_under_multiple_of_ends_as_json_of_the_schema(target, kind) -> None:
    schema = {"type": "object", "properties": {"n": {"type": kind, "multipleOf": 7}}, "required": ["n"]}
    grammar = compile_grammar(GrammarSpec("json_schema", schema), target)
    prompt = chat_prompt(target, [{"role": "user", "content": REQUEST}])[0]
    target.truncate(0)
    done = list(generate(target, prompt, Sampler(SamplingParams.greedy_params()),
                         strategy=constrained(autoregressive, grammar), max_tokens=64))[-1]
    assert isinstance(done, DoneEvent)
    assert done.stats.finish_reason == "stop", done.text
    jsonschema.validate(json.loads(done.text), schema)

"""The real-model tier: real instruction-tuned GGUFs (Qwen2.5-Coder 0.5B/1.5B, SmolLM2-135M).

Greedy speculative output must be token-identical to plain greedy output on these
quantized models in every drafting mode: the backend's exact configuration
(``LlamaConfig.exact``) plus verification in batches of at most ``exact_batch`` tokens and
one way of splitting a prompt make it so (see ``runtime/backends/llama.py``). Few tokens
each: this tier runs in CI on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.llama import LlamaCppBackend
from tandem.runtime.backends.llama_config import EXACT_BATCH, EXACT_BATCH_REPACKED, LlamaConfig
from tandem.runtime.backends.selfcheck import batch_step_difference, describe_exit, run_selfcheck
from tandem.runtime.chat import ChatEngine
from tandem.runtime.generate import generate
from tandem.runtime.speculative.factory import SpecOptions, build_strategy

CODE_PROMPT = ("<|im_start|>user\nWrite a Python function that parses a CSV file and returns the rows "
               "as dictionaries, skipping blank lines.<|im_end|>\n<|im_start|>assistant\n")
EDIT_PROMPT = ("<|im_start|>user\nRename the variable total to result in this code and return it:\n"
               "def add(values):\n    total = 0\n    for v in values:\n        total += v\n    return total\n"
               "<|im_end|>\n<|im_start|>assistant\n")
N_TOKENS = 24


@pytest.fixture(scope="module")
def target_15b(real_models):
    backend = LlamaCppBackend(real_models.qwen_15b, LlamaConfig(n_ctx=1024, n_threads=2))
    yield backend
    backend.close()


def greedy(target, prompt_ids, strategy=None, n=N_TOKENS):
    kwargs = {} if strategy is None else {"strategy": strategy}
    events = list(generate(target, prompt_ids, Sampler(SamplingParams(temperature=0.0)), max_tokens=n, **kwargs))
    return events[-1]


def plain_and_speculative(target, prompt_ids, draft, mode: str, k: int | None):
    """Greedy output of ``target`` decoding plainly, then with a fresh strategy of
    ``mode`` (cache emptied before each): the pair greedy identity compares."""
    target.truncate(0)
    plain = greedy(target, prompt_ids)
    target.truncate(0)
    strategy = build_strategy(target, draft, SpecOptions(mode=mode, draft_length=k, measure_cost=False))
    try:
        return plain, greedy(target, prompt_ids, strategy)
    finally:
        strategy.close()


def test_short_batches_compute_exactly_what_decode_steps_compute(real_models) -> None:
    """The premise of greedy identity, checked on this machine's CPU and build: up to
    ``exact_batch`` positions in one call give bit-identical logits to one-token steps."""
    with LlamaCppBackend(real_models.qwen_05b, LlamaConfig(n_ctx=256, n_threads=1)) as b:
        assert b.exact_batch == EXACT_BATCH
        ids = b.tokenize(CODE_PROMPT, special=True)
        for m in range(2, EXACT_BATCH + 1):
            diff = batch_step_difference(b, ids, m)
            assert diff == 0.0, f"a batch of {m} differs from steps by {diff}"


@pytest.mark.parametrize("threads", [1, 2])
def test_repacked_weights_compute_short_batches_exactly_too(real_models, threads) -> None:
    """The premise of ``--repack``: with llama.cpp's repacked weights (Q4_0 in the 0.5B,
    Q4_K in the 1.5B) a batch of up to ``exact_batch`` = 3 rows is computed as steps are."""
    for model in (real_models.qwen_05b, real_models.qwen_15b):
        with LlamaCppBackend(model, LlamaConfig(n_ctx=256, n_threads=threads, repack=True)) as b:
            assert b.exact_batch == EXACT_BATCH_REPACKED
            ids = b.tokenize(CODE_PROMPT, special=True)
            for m in range(2, EXACT_BATCH_REPACKED + 1):
                diff = batch_step_difference(b, ids, m)
                assert diff == 0.0, f"{model.name}: a repacked batch of {m} differs from steps by {diff}"


@pytest.mark.parametrize(("mode", "k"), [("ngram", 8), ("model", 5)])
def test_greedy_speculative_output_with_repacked_weights_is_plain_greedy_output(real_models, mode, k) -> None:
    """``--repack`` keeps greedy identity: drafts are verified 3 tokens per call."""
    with LlamaCppBackend(real_models.qwen_15b, LlamaConfig(n_ctx=512, n_threads=2, repack=True)) as target:
        draft = real_models.qwen_05b if mode == "model" else None
        plain, spec = plain_and_speculative(target, target.tokenize(EDIT_PROMPT, special=True), draft, mode, k)
    assert spec.tokens == plain.tokens
    assert spec.stats.tokens_per_call > 1.0  # it did speculate


def test_fast_configuration_makes_no_exactness_promise(real_models) -> None:
    with LlamaCppBackend(real_models.smollm2, LlamaConfig(n_ctx=128, n_threads=1, exact=False)) as b:
        assert b.exact_batch is None


@pytest.mark.parametrize(("mode", "drafter", "k"), [
    ("ngram", None, None),
    ("model", "qwen_05b", 4),
    ("model", "qwen_05b", 12),  # longer than exact_batch: verified in chunks
    ("auto", "qwen_05b", None),
    ("xvocab", "smollm2", 4),
])
@pytest.mark.parametrize("prompt", [CODE_PROMPT, EDIT_PROMPT], ids=["codegen", "edit"])
def test_greedy_speculative_output_is_plain_greedy_output(target_15b, real_models, mode, drafter, k, prompt) -> None:
    draft = getattr(real_models, drafter) if drafter else None
    plain, spec = plain_and_speculative(target_15b, target_15b.tokenize(prompt, special=True), draft, mode, k)
    assert spec.tokens == plain.tokens
    if k:
        assert spec.stats.tokens_per_call > 1.0  # it did speculate


def test_a_repeated_request_reuses_the_cache_and_gives_the_same_tokens(target_15b) -> None:
    """The server's case: an identical second request finds its prompt cached."""
    ids = target_15b.tokenize(CODE_PROMPT, special=True)
    target_15b.truncate(0)
    strategy = build_strategy(target_15b, None, SpecOptions(mode="ngram", measure_cost=False))
    try:
        first = greedy(target_15b, ids, strategy)
        second = greedy(target_15b, ids, strategy)
    finally:
        strategy.close()
    target_15b.truncate(0)
    assert first.tokens == second.tokens == greedy(target_15b, ids).tokens


def test_seeded_sampling_repeats_with_speculation(target_15b, real_models) -> None:
    ids = target_15b.tokenize(CODE_PROMPT, special=True)
    params = SamplingParams(temperature=0.8, seed=1234)
    texts = []
    for _ in range(2):
        target_15b.truncate(0)
        strategy = build_strategy(target_15b, real_models.qwen_05b, SpecOptions(mode="model", draft_length=4,
                                                                                measure_cost=False))
        try:
            events = list(generate(target_15b, ids, Sampler(params), strategy=strategy, max_tokens=16))
        finally:
            strategy.close()
        texts.append(events[-1].tokens)
    assert texts[0] == texts[1]


def test_chat_engine_renders_chatml_and_stops_at_the_end_of_turn(real_models) -> None:
    backend = LlamaCppBackend(real_models.smollm2, LlamaConfig(n_ctx=512, n_threads=1))
    engine = ChatEngine(backend)
    try:
        ids, stops = engine.render([{"role": "user", "content": "Say hello."}])
        text = "".join(backend.tokenizer.piece(t, special=True).decode("utf-8", "replace") for t in ids)
        assert "<|im_start|>user\nSay hello.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
        done = list(engine.stream([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0.0),
                                  max_tokens=64))[-1]
        assert done.stats.finish_reason == "stop"  # the end-of-turn token, not the length limit
        assert "<|im_" not in done.text and "<|endoftext|>" not in done.text
    finally:
        engine.close()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.app.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_tandem_run_applies_the_chat_template_by_default_and_raw_continues(real_models) -> None:
    common = ["run", "-m", str(real_models.smollm2), "-p", "What is 2+2?", "-n", "24", "--threads", "1", "--json"]
    chat = run_cli(*common)
    raw = run_cli(*common, "--raw")
    assert chat.returncode == 0, chat.stderr
    assert raw.returncode == 0, raw.stderr
    chat_out, raw_out = json.loads(chat.stdout), json.loads(raw.stdout)
    # the template wraps the prompt in a system + user turn: more prompt tokens than the bare text
    assert chat_out["stats"]["prompt_tokens"] > raw_out["stats"]["prompt_tokens"] + 5
    assert "<|im_" not in chat_out["text"]
    assert "4" in chat_out["text"]
    fast = run_cli(*common, "--draft-mode", "ngram", "--fast-verify")
    assert fast.returncode == 0, fast.stderr
    assert json.loads(fast.stdout)["stats"]["generated_tokens"] > 0
    assert json.loads(fast.stdout)["engine"]["exact_batch"] is None
    repacked = run_cli(*common, "--draft-mode", "ngram", "--repack")
    assert repacked.returncode == 0, repacked.stderr
    assert json.loads(repacked.stdout)["engine"]["exact_batch"] == EXACT_BATCH_REPACKED
    assert chat_out["engine"]["exact_batch"] == EXACT_BATCH
    assert json.loads(repacked.stdout)["token_ids"] == chat_out["token_ids"]  # exact: the same reply


def test_setup_self_check_runs_quantized_models_here() -> None:
    assert run_selfcheck() == []


def test_self_check_names_a_native_crash() -> None:
    assert describe_exit(-11, "") == "the decoding child died of SIGSEGV (a crash inside native code)"
    assert describe_exit(1, "boom\nValueError: bad\n") == "ValueError: bad"
    assert describe_exit(0, "") is None


FAST_LOGIT_BOUND = 4.0
"""Largest |logit difference| between a verify batch and one-token steps seen with
llama.cpp's fast kernels on the real 1.5B (0.47 at 8 tokens, 1.6 at 32, 2.7 at 64 on
Intel AMX and AMD Zen 5), with margin: the fast configuration is not token-identical to
plain greedy decoding at near-ties, and this is how far apart the two can be."""


def test_fast_verification_differs_from_steps_by_a_bounded_amount(real_models) -> None:
    with LlamaCppBackend(real_models.qwen_15b, LlamaConfig(n_ctx=512, n_threads=2, exact=False)) as b:
        assert b.exact_batch is None  # one call per draft, however long
        ids = b.tokenize(CODE_PROMPT * 3, special=True)
        worst = max(batch_step_difference(b, ids, m) for m in (2, 8, 32))
        assert worst < FAST_LOGIT_BOUND

"""The policy replay (benchmarks/policy_replay.py): its prompts and predictions, and a
replayed reply with a prediction on the stories model."""

from __future__ import annotations

from benchmarks.heldout_prompts import HELD_OUT
from benchmarks.policy_replay import fenced_code, prompts, replay
from tandem.app.bench.workloads import EDIT, EDIT_CODE
from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.generate import generate
from tandem.runtime.speculative.cost import CostCurve
from tandem.runtime.speculative.drafters.prediction import Prediction


def test_the_prediction_of_an_edit_prompt_is_the_code_it_gives() -> None:
    assert [fenced_code(text) for text in EDIT] == list(EDIT_CODE)
    assert all(fenced_code(text) for text in HELD_OUT["edit"])
    assert fenced_code("no code here") is None


def test_predicted_replays_the_edit_prompts_only() -> None:
    edit = prompts(("edit",))
    assert {name for name, _, _ in edit} == {"edit"}
    assert [text for _, label, text in edit if label.startswith("b")] == list(EDIT)
    assert len(prompts()) == 4 * len(edit)


def test_a_replay_predicted_right_drafts_it_and_keeps_the_reply(stories_backend) -> None:
    prompt = stories_backend.tokenize("Once upon a time", add_bos=True)
    *_, plain = generate(stories_backend, prompt, Sampler(SamplingParams.greedy_params()), max_tokens=48,
                         stop_at_eog=False)
    curve = CostCurve.linear(0.1)  # verifying is cheap: drafts that are right pay
    tokens, speedup, rounds = replay(stories_backend, prompt, curve, 1.10, 48, Prediction(list(plain.tokens)))
    assert tokens == list(plain.tokens)
    assert sum(accepted for _, accepted, _ in rounds) >= 30
    assert speedup > 2.0
    bare, bare_speedup, _ = replay(stories_backend, prompt, curve, 1.10, 48)
    assert bare == tokens and bare_speedup < speedup

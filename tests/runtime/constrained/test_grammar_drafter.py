"""Drafts under a grammar: cut before their first illegal token, forced runs appended."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from toy_grammar import PIECES, REGEX, GrammarToy
from toy_models import PURE, random_table

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.constrained import GrammarSpec, compile_grammar
from tandem.runtime.constrained.grammar_drafter import GrammarDrafter
from tandem.runtime.speculative.drafters.base import Draft

A, B, AB, C, BA, D, CA, EOS = range(len(PIECES))


class Scripted:
    """A drafter that proposes a fixed draft (with a q row per token when given)."""

    name = "scripted"
    calls = 0
    stop_threshold = None

    def __init__(self, tokens: list[int], q: np.ndarray | None = None) -> None:
        self.draft = Draft(tokens, q, "scripted")
        self.asked: list[list[int]] = []

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        self.asked.append(list(context))
        return Draft(self.draft.tokens[:max_tokens], None if self.draft.q is None else self.draft.q[:max_tokens],
                     "scripted")

    def commit(self, context: Sequence[int], n_accepted: int) -> None: ...
    def backlog(self, context: Sequence[int]) -> int: return 0
    def weight_bytes(self) -> int: return 0
    def prime(self, tokens: Sequence[int]) -> None: ...
    def model_backend(self): return None
    def close(self) -> None: ...


def grammar():
    return compile_grammar(GrammarSpec("regex", REGEX), GrammarToy(random_table(len(PIECES), np.random.default_rng(1))))


GREEDY = Sampler(SamplingParams.greedy_params())
PROMPT = [D, D]


def test_a_draft_is_cut_before_its_first_illegal_token() -> None:
    # "a" then "d" (illegal: "cab" must follow the first letter)
    drafter = GrammarDrafter(Scripted([A, D, D]), grammar(), len(PROMPT))
    assert drafter.propose(PROMPT, 3, GREEDY).tokens[:1] == [A]
    assert D not in drafter.propose(PROMPT, 3, GREEDY).tokens
    # illegal from the start: nothing to verify
    assert GrammarDrafter(Scripted([C, A]), grammar(), len(PROMPT)).propose(PROMPT, 3, GREEDY).tokens == []


def test_the_forced_run_after_a_legal_draft_is_appended_within_the_length() -> None:
    drafter = GrammarDrafter(Scripted([A]), grammar(), len(PROMPT))
    # "a", then the forced "ca"; the "b" after it is not forced: the token "ba" spells it too
    assert drafter.propose(PROMPT, 4, GREEDY).tokens == [A, CA]
    assert drafter.propose(PROMPT, 1, GREEDY).tokens == [A]


def test_a_random_illegal_draw_is_drawn_again_from_the_legal_part_of_q() -> None:
    q = np.full((2, len(PIECES)), 1.0 / len(PIECES))
    drafter = GrammarDrafter(Scripted([A, D], q), grammar(), len(PROMPT))
    draft = drafter.propose(PROMPT, 2, Sampler(PURE))
    assert draft.tokens == [A, CA]  # after "a" only "ca" is legal: the illegal "d" was redrawn
    assert draft.q is not None
    assert np.isclose(draft.q[0, A], 0.5) and np.isclose(draft.q[0, B], 0.5)  # q over the legal "a" and "b"
    assert draft.q[1, CA] == 1.0

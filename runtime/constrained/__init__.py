"""Constrained decoding: every token the target commits is legal under a grammar.

A caller describes the output with a :class:`GrammarSpec` (a JSON schema, any JSON
object, a GBNF grammar, a regex or a Lark grammar), compiles it for a model's vocabulary
with :func:`compile_grammar` (a :class:`GrammarError` with a readable message when it
cannot), and decodes with ``generate(target, prompt, sampler,
strategy=constrained(strategy, grammar))`` (:mod:`.strategy`) or
``ChatEngine.stream(..., grammar=grammar)``. Every strategy stays lossless: the target's
logits are masked to the legal tokens (:mod:`.target`), drafts are cut at their first
illegal token (:mod:`.grammar_drafter`), and runs the grammar forces are committed without a
target call (:mod:`.strategy`).
"""

from tandem.runtime.constrained.grammar import Grammar, GrammarError, GrammarSpec, compile_grammar
from tandem.runtime.constrained.state import GrammarState

__all__ = ["Grammar", "GrammarError", "GrammarSpec", "GrammarState", "compile_grammar"]

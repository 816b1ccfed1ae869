"""One request's place in its grammar, with the moves speculative decoding needs.

A :class:`GrammarState` follows a token sequence (the reply so far): it says which
tokens may come next (:meth:`allowed`, :meth:`mask`), how long a draft's legal prefix is
(:meth:`legal_prefix`), which tokens the grammar forces next (:meth:`forced`), and it
moves forward (:meth:`consume`) and back (:meth:`rollback`) as drafts are accepted or
rejected. :meth:`follow` brings it to any sequence at once (the longest common prefix is
kept, the rest consumed), which is how every user of a state stays in step with a cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from llguidance import LLMatcher

from tandem.runtime.backends.protocol import common_prefix_len
from tandem.runtime.constrained.grammar import Grammar, GrammarError
from tandem.runtime.constrained.json_numbers import MAX_OVERRUN, JsonLex, digit_room


class GrammarState:
    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._matcher: LLMatcher = grammar.matcher()
        self.n_vocab = grammar.n_vocab
        self._bits = np.zeros(((self.n_vocab + 31) // 32,), dtype=np.int32)
        self.tokens: list[int] = []
        """The tokens consumed so far (the legal reply this state stands after)."""
        self._allowed: np.ndarray | None = None
        self._after_end = 0
        """End-of-generation tokens taken after the grammar was complete (the matcher
        takes none then; they count for rollback only)."""
        self._lex: list[JsonLex] = [JsonLex()]
        """JSON grammars: where the text stands after each prefix of :attr:`tokens`
        (``_lex[i]``: after ``tokens[:i]``), for the bound on a number's digits."""
        lead = grammar.leading_digits
        self._part_ends = None if lead is None else lead == 0
        """JSON grammars: the tokens that begin with no digit (after a number's part: its
        end, a separator, or its next part)."""

    # -- where we are -------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but end-of-generation may follow."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The reply so far is a whole sentence of the grammar (it may end here)."""
        return self._matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """Boolean row over the vocabulary: the tokens legal next (end-of-generation
        alone once the grammar is complete, so a row is never empty). Read-only; kept
        until the state moves."""
        if self._allowed is None:
            row = self._grammar_row()
            if self._matcher.is_error():  # its mask would then allow only end-of-generation
                raise GrammarError("The grammar allows nothing after the reply so far (a rule that never "
                                   f"ends, or a parser limit): {_first_line(self._matcher.get_error())}")
            if not row.any():
                row[list(self.grammar.eog)] = True
            row = self._digits_bounded(row)
            row.flags.writeable = False
            self._allowed = row
        return self._allowed

    def _grammar_row(self) -> np.ndarray:
        """llguidance's mask where the matcher stands, as a boolean row (a new array)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].view(bool)

    def _digits_bounded(self, row: np.ndarray) -> np.ndarray:
        """``row`` less the tokens that would take a JSON number's part past
        :data:`~.json_numbers.MAX_DIGITS` digits. Where that leaves none, the schema lets
        the part end no sooner (``multipleOf``, a bound that needs more digits): then only
        the way out (:meth:`_way_out`), as giving the model back every digit let it write
        them forever. ``row`` itself only where no way out is found."""
        lead = self.grammar.leading_digits
        room = None if lead is None else digit_room(self._lex[-1], lead)
        if room is None:
            return row
        bounded = row & room
        if bounded.any():
            return bounded
        way_out = self._way_out(row)
        return row if way_out is None else way_out

    def _way_out(self, row: np.ndarray) -> np.ndarray | None:
        """The digit tokens that begin the shortest runs of digits after which the grammar
        lets the number's part end, searched breadth first over the grammar's digit tokens
        up to :data:`~.json_numbers.MAX_OVERRUN` digits (``None``: no run that short). The
        matcher is moved along each run and back; the state itself does not move."""
        digits, ends = self.grammar.digit_tokens, self._part_ends
        runs = [(d,) for d in digits if row[d]]
        for _ in range(MAX_OVERRUN):
            firsts: set[int] = set()
            longer: list[tuple[int, ...]] = []
            for run in runs:
                here = self._grammar_row_after(run)
                if (here & ends).any():
                    firsts.add(run[0])
                elif not firsts:
                    longer.extend((*run, d) for d in digits if here[d])
            if firsts:
                way_out = np.zeros(self.n_vocab, dtype=bool)
                way_out[list(firsts)] = True
                return way_out
            runs = longer
        return None

    def _grammar_row_after(self, run: tuple[int, ...]) -> np.ndarray:
        """llguidance's mask after ``run`` (legal tokens), the matcher brought back."""
        if not self._matcher.consume_tokens(list(run)):
            raise GrammarError(f"A number's way out could not be followed: {_first_line(self._matcher.get_error())}")
        row = self._grammar_row()
        if not self._matcher.rollback(len(run)):
            raise GrammarError(f"The grammar state could not be rolled back: {_first_line(self._matcher.get_error())}")
        return row

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every illegal token at -inf (a new array): softmax over it is
        the model's distribution renormalised to the legal tokens, its argmax the most
        likely legal token."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def forced(self, limit: int | None = None) -> list[int]:
        """The tokens the grammar forces next: each the only legal token at its step
        (where the grammar forces text, llguidance allows only its canonical
        tokenization, so a schema's keys and separators are runs of these). At most
        ``limit``; the state does not move."""
        run: list[int] = []
        for token in self._matcher.compute_ff_tokens():
            if limit is not None and len(run) >= limit:
                break
            allowed = self.allowed()
            if not allowed[token] or np.count_nonzero(allowed) != 1 or not self.step(token):
                break
            run.append(token)
        self.rollback(len(run))
        return run

    def legal_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the masks allow, one after another, each with
        somewhere to go after it (:meth:`step`); the state does not move."""
        n = self._advance(tokens)
        self.rollback(n)
        return n

    # -- moving -------------------------------------------------------------------------
    def consume(self, tokens: Sequence[int]) -> None:
        """Move past ``tokens``, which must be legal."""
        if not tokens:
            return
        if self._after_end or self.done:  # end-of-generation after a complete reply
            if any(t not in self.grammar.eog for t in tokens):
                raise GrammarError("A token was committed after the grammar was complete.")
            self._after_end += len(tokens)
        elif not self._matcher.consume_tokens(list(tokens)):
            raise GrammarError(f"A token the grammar does not allow was committed: {_first_line(self._matcher.get_error())}")
        self.tokens.extend(tokens)
        if self.grammar.leading_digits is not None:
            for token in tokens:
                self._lex.append(self._lex[-1].after(self.grammar.pieces[token]))
        self._allowed = None

    def step(self, token: int) -> bool:
        """Consume ``token`` (legal) if the grammar allows anything after it, else stay
        put and say so. A legal token can lead nowhere (a rule that never ends, a parser
        limit): the model's own pick of one is an error (:meth:`allowed` raises after
        it), a draft or a forced run holding one is only cut before it, so speculation
        fails exactly where decoding without it would."""
        self.consume([token])
        try:
            self.allowed()
        except GrammarError:
            self._restart(len(self.tokens) - 1)
            return False
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
        if n <= 0:
            return
        virtual = min(n, self._after_end)
        self._after_end -= virtual
        if n > virtual and not self._matcher.rollback(n - virtual):
            raise GrammarError(f"The grammar state could not be rolled back: {_first_line(self._matcher.get_error())}")
        del self.tokens[-n:]
        if self.grammar.leading_digits is not None:
            del self._lex[-n:]
        self._allowed = None

    def _restart(self, keep: int) -> None:
        """A new matcher brought to the first ``keep`` consumed tokens: llguidance's
        matcher cannot roll back out of an error."""
        tokens = self.tokens[:keep]
        self._matcher = self.grammar.matcher()
        self.tokens, self._lex, self._after_end, self._allowed = [], self._lex[:1], 0, None
        self.consume(tokens)

    def follow(self, tokens: Sequence[int]) -> int:
        """Stand after the longest legal prefix of ``tokens`` (rolling back what differs);
        returns its length."""
        keep = common_prefix_len(self.tokens, tokens)
        self.rollback(len(self.tokens) - keep)
        return keep + self._advance(tokens[keep:])

    def _advance(self, tokens: Sequence[int]) -> int:
        """Move past the longest prefix of ``tokens`` that :meth:`legal_prefix` allows;
        returns its length."""
        n = 0
        for token in tokens:
            if not self.allowed()[token] or not self.step(token):
                break
            n += 1
        return n


def _first_line(message: str) -> str:
    """llguidance's error without the parser state and grammar it dumps after it."""
    return message.split("\n", 1)[0].removeprefix("Parser Error: ")

"""How the cross-vocabulary drafter's n-gram cache learns from committed text: every
aligned drafter/target span that spells the same bytes, and every target token the
drafter spells with several tokens (OmniDraft's rule). Each part of a growing context is
learnt once; the drafter's encoding of the last token may still change, so it waits."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tandem.kernels.vocab_map import aligned_spans, byte_offsets
from tandem.runtime.speculative.drafters.xvocab.text_translation import encodable_prefix
from tandem.runtime.speculative.drafters.xvocab.translation_cache import NGramCache
from tandem.runtime.speculative.drafters.xvocab.vocab_pair import VocabPair, complete_utf8_prefix


class CacheLearner:
    """Adds the entries a committed context teaches to ``cache``, remembering how far it
    has learnt (``tokenize``: the drafter's tokenizer, ``draft_units``: what its
    vocabulary can encode)."""

    def __init__(self, pair: VocabPair, cache: NGramCache, tokenize: Callable[..., list[int]],
                 draft_units: tuple[frozenset[str], frozenset[int]]) -> None:
        self.pair, self.cache, self.tokenize, self.draft_units = pair, cache, tokenize, draft_units
        self._context: list[int] = []
        """The context learnt so far, less its last token."""
        self._byte = 0
        """Bytes of it whose spans are learnt."""

    def follow(self, context: Sequence[int]) -> None:
        """Start over when ``context`` does not continue the one learnt from."""
        if list(context[: len(self._context)]) != self._context:
            self._byte = 0

    def forget(self) -> None:
        self._context, self._byte = [], 0

    def learn(self, context: list[int], draft_ids: list[int], offset: int) -> int:
        """Entries new to the cache from ``context`` (target ids), whose text the drafter
        encodes as ``draft_ids`` (its decoding starting ``offset`` bytes early)."""
        tp = [self.pair.target_pieces[t] for t in context]
        t_ends = byte_offsets(tp)
        d_ends = [e - offset for e in byte_offsets([self.pair.draft_pieces[d] for d in draft_ids])]
        stop = t_ends[-2]  # the drafter's encoding of the last token may still change
        new = 0
        for (d0, d1), (t0, t1) in aligned_spans(d_ends, t_ends, self._byte, stop):
            dseq, tseq = draft_ids[d0:d1], context[t0:t1]
            if not dseq or not tseq or any(not self.pair.draft_pieces[d] for d in dseq):
                continue
            if any(not tp[t] for t in range(t0, t1)):
                continue
            if len(dseq) == 1 and len(tseq) == 1 and self.pair.direct[dseq[0]] == tseq[0]:
                continue
            new += self.cache.add(dseq, tseq)
        first = next((i for i, e in enumerate(t_ends) if e > self._byte), len(context))
        for i in range(first, len(context) - 1):
            new += self._learn_token(context[i])
        self._context, self._byte = context[:-1], max(self._byte, stop)
        return new

    def _learn_token(self, t: int) -> int:
        """OmniDraft's rule: a target token whose text the drafter spells with several
        tokens adds that spelling (only when it decodes back to exactly the same bytes)."""
        piece = self.pair.target_pieces[t]
        if not piece or complete_utf8_prefix(piece) != len(piece):
            return 0
        s = piece.decode("utf-8")
        if encodable_prefix(s, self.draft_units) != len(s):
            return 0
        if self.pair.draft_space_prefix:
            if not s.startswith(" "):
                return 0
            s = s[1:]
        ids = self.tokenize(s, add_bos=False) if s else []
        if len(ids) < 2 or self.pair.draft_text(ids) != piece:
            return 0
        return int(self.cache.add(ids, [t]))

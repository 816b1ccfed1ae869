"""Cross-vocabulary drafting: any drafter model for any target (OmniDraft, TLI).

The drafter never sees target ids. Each round it is brought to the committed *text*:
the target context's bytes are re-encoded with the drafter's tokenizer and its KV cache
is rolled back to where that encoding departs from what it holds (back-translation;
accepted draft fragments that re-encode differently are recomputed). It then drafts k
tokens in its own vocabulary, which are translated into target ids:

* ``omni`` (OmniDraft, default): left to right, the longest n-gram-cache match, else
  the direct map, else stop. The cache learns from every committed round which drafter
  sequences spell which target tokens, and is persisted per tokenizer pair. Greedy is
  exactly lossless (the verifier accepts only the target's argmax); sampling is
  near-lossless, as in the paper (a merged token can arise from other drafter paths).
* ``tli`` (token-level intersection): drafter logits outside the shared vocabulary are
  suppressed and its distribution is scattered onto the target vocabulary, so ``q`` is
  the exact proposal distribution and sampling is exactly lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.kernels.sampling import Sampler
from tandem.kernels.vocab_map import (
    UNMAPPED,
    Translation,
    aligned_spans,
    byte_offsets,
    intersection_mask,
    restrict_logits,
    scatter_to_target,
    translate,
)
from tandem.models.errors import TandemError
from tandem.runtime.backend import Backend, prefill
from tandem.runtime.drafters.base import Draft
from tandem.runtime.drafters.model import token_probability
from tandem.runtime.ngram_cache import NGramCache, default_cache_path, vocab_fingerprint
from tandem.runtime.vocab_map import Tokenizer, VocabPair, complete_utf8_prefix

MODES = ("omni", "tli")


@dataclass
class XVocabConfig:
    mode: str = "omni"
    learn: bool = True
    """Add n-gram cache entries from every committed round."""
    persist: bool = True
    """Load the cache from, and save it to, the user data dir."""
    cache_capacity: int = 50_000
    cache_path: Path | None = None
    """Override the per-pair file in the data dir."""


@dataclass
class XVocabStats:
    rounds: int = 0
    drafted: int = 0
    """Drafter-vocabulary tokens generated."""
    proposed: int = 0
    """Target-vocabulary tokens proposed after translation."""
    accepted: int = 0
    from_cache: int = 0
    """Proposed tokens that came from the n-gram cache."""
    learnt: int = 0
    """New cache entries this session."""
    unsynced: int = 0
    """Rounds skipped because the context text could not be re-encoded exactly."""
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self, cache_size: int) -> dict[str, float]:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "cache_hit_rate": self.from_cache / self.proposed if self.proposed else 0.0,
            "proposed_per_round": self.proposed / self.rounds if self.rounds else 0.0,
            "accepted_per_round": self.accepted / self.rounds if self.rounds else 0.0,
            "cache_size": cache_size,
            "learnt": self.learnt,
            "unsynced": self.unsynced,
        }


@dataclass
class _Synced:
    """The committed context as the drafter sees it."""

    context: list[int]
    text: bytes
    draft_ids: list[int]
    offset: int
    """Bytes the drafter's decoding has before ``text`` (SentencePiece's dummy space)."""


class CrossVocabDrafter:
    """A :class:`~tandem.runtime.drafters.base.Drafter` over a backend with another tokenizer."""

    def __init__(
        self,
        drafter: Backend,
        target: Tokenizer,
        config: XVocabConfig | None = None,
        *,
        cache: NGramCache | None = None,
        owns_backend: bool = True,
        stop_threshold: float | None = None,
    ) -> None:
        self.config = cfg = config or XVocabConfig()
        if cfg.mode not in MODES:
            raise TandemError(f"Unknown cross-vocabulary mode {cfg.mode!r}; choose one of {', '.join(MODES)}.")
        self.drafter = drafter
        self.name = f"xvocab-{cfg.mode}:{drafter.name}"
        self.owns_backend = owns_backend
        self.stop_threshold = stop_threshold
        """SpecDec++: stop drafting once ``1 - prod(confidence)`` exceeds it."""
        self.calls = 0
        """Drafter forward calls so far (for ``DecodeStats.draft_calls``)."""
        self.pair = VocabPair.build(drafter, target)
        if self.pair.shared == 0:
            raise TandemError(f"{drafter.name} and {target.name} share no tokens: cannot draft across them.")
        self.n_target = len(self.pair.target_pieces)
        self.mask = intersection_mask(self.pair.direct)
        self._bos = drafter.special.bos
        self._eog = drafter.special.eog | ({drafter.special.eos} if drafter.special.eos is not None else set())
        fp = (vocab_fingerprint(self.pair.draft_pieces), vocab_fingerprint(self.pair.target_pieces))
        self.cache_path = cfg.cache_path or default_cache_path(*fp)
        if cache is not None:
            self.cache = cache
        elif cfg.persist:
            self.cache = NGramCache.load(self.cache_path, cfg.cache_capacity)
        else:
            self.cache = NGramCache(cfg.cache_capacity)
        self.stats = XVocabStats()
        self._synced: _Synced | None = None
        self._learnt_ctx: list[int] = []
        self._learnt_byte = 0
        self._dirty = False

    # -- back-translation ---------------------------------------------------------------
    def _sync(self, context: Sequence[int]) -> _Synced | None:
        """Encode the committed target text with the drafter's tokenizer (memoised)."""
        context = list(context)
        if self._synced is not None and self._synced.context == context:
            return self._synced
        text = self.pair.target_text(context)
        if complete_utf8_prefix(text) != len(text):
            return None  # mid-character (or invalid) bytes: nothing to encode exactly
        s = text.decode("utf-8")
        if self.pair.draft_space_prefix and s.startswith(" "):
            s = s[1:]
        ids = self.drafter.tokenize(s, add_bos=self._bos is not None) if s else []
        if not s and self._bos is not None:
            ids = [self._bos]
        decoded = self.pair.draft_text(ids)
        if not ids or not decoded.endswith(text):
            return None
        self._synced = _Synced(context, text, ids, len(decoded) - len(text))
        return self._synced

    # -- drafting -----------------------------------------------------------------------
    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        empty = Draft([], None, self.name)
        if max_tokens <= 0:
            return empty
        synced = self._sync(context)
        if synced is None or len(synced.draft_ids) + max_tokens > self.drafter.n_ctx:
            self.stats.unsynced += synced is None
            return empty
        self.stats.rounds += 1
        history = list(synced.draft_ids)
        logits = prefill(self.drafter, history)
        self.calls += 1
        tli = self.config.mode == "tli"
        drafted: list[int] = []
        q_of: list[float] = []
        rows: list[np.ndarray] = []
        conf: list[float] = []
        survive = 1.0
        for j in range(max_tokens):
            raw = logits
            if tli:
                logits = restrict_logits(logits, self.mask)
            q = sampler.distribution(logits, history)
            d = int(np.argmax(q)) if sampler.greedy else sampler.draw(q)
            drafted.append(d)
            q_of.append(float(q[d]))
            rows.append(q)
            history.append(d)
            conf.append(token_probability(raw, d))
            survive *= conf[-1]
            if d in self._eog or (not tli and not self._may_translate(drafted)):
                break
            if self.stop_threshold is not None and 1.0 - survive > self.stop_threshold:
                break
            if j + 1 < max_tokens:
                logits = self.drafter.evaluate([d])[-1]
                self.calls += 1
        self.stats.drafted += len(drafted)
        if tli:
            tokens = [int(self.pair.direct[d]) for d in drafted]
            q_rows = None if sampler.greedy else np.stack([self._scatter(r) for r in rows])
            from_cache, confidence = 0, conf
        else:
            tr = translate(drafted, q_of, self.pair.direct, self.cache.longest_match, max_tokens)
            tokens, from_cache = tr.tokens, tr.cache_hits
            q_rows = None if sampler.greedy else self._omni_rows(tr, rows)
            confidence = _merged_confidence(tr, conf)
        self.stats.proposed += len(tokens)
        self.stats.from_cache += from_cache
        return Draft(tokens, q_rows, self.name, confidence)

    def _may_translate(self, drafted: list[int]) -> bool:
        """Cheap early stop: the newest drafter token is neither mapped nor continuing a
        cache path that could cover it, so translation would stop before it anyway."""
        d = drafted[-1]
        if self.pair.direct[d] != UNMAPPED or not len(self.cache):
            return self.pair.direct[d] != UNMAPPED
        tail = drafted[-self.cache.max_draft_len :]
        return any(self.cache.has_path(tail[i:]) for i in range(len(tail)))

    def _scatter(self, q: np.ndarray) -> np.ndarray:
        return scatter_to_target(q, self.pair.direct, self.n_target)

    def _omni_rows(self, tr: Translation, rows: list[np.ndarray]) -> np.ndarray:
        """Proposal rows for sampled OmniDraft: the drafter's distribution at that
        position moved onto the target vocabulary, with the proposed token carrying the
        product probability of the drafter tokens it merges (near-lossless, see module)."""
        out = np.zeros((len(tr.tokens), self.n_target), dtype=np.float64)
        for i, (t, pos, qt) in enumerate(zip(tr.tokens, tr.draft_pos, tr.q_tokens, strict=True)):
            if i > 0 and tr.draft_pos[i - 1] == pos:
                out[i, t] = 1.0  # implied by the previous token of the same cache entry
                continue
            out[i] = self._scatter(rows[pos])
            out[i, t] = max(out[i, t], qt)
        return out

    # -- learning -----------------------------------------------------------------------
    def commit(self, context: Sequence[int], n_accepted: int) -> None:
        self.stats.accepted += n_accepted
        if self.config.learn and self.config.mode == "omni":
            self.learn(context)

    def learn(self, context: Sequence[int]) -> int:
        """Add cache entries from the committed text (every aligned drafter/target span
        and every target token the drafter spells with several tokens); returns how many
        were new. Learns each part of a growing context once."""
        context = list(context)
        n_seen = len(self._learnt_ctx)
        if context[:n_seen] != self._learnt_ctx:
            self._learnt_byte = 0
        synced = self._sync(context)
        if synced is None or len(context) < 2:
            return 0
        tp = [self.pair.target_pieces[t] for t in context]
        t_ends = byte_offsets(tp)
        d_ends = [e - synced.offset for e in byte_offsets([self.pair.draft_pieces[d] for d in synced.draft_ids])]
        stop = t_ends[-2]  # the drafter's encoding of the last token may still change
        new = 0
        for (d0, d1), (t0, t1) in aligned_spans(d_ends, t_ends, self._learnt_byte, stop):
            dseq, tseq = synced.draft_ids[d0:d1], context[t0:t1]
            if not dseq or not tseq or any(not self.pair.draft_pieces[d] for d in dseq):
                continue
            if any(not tp[t] for t in range(t0, t1)):
                continue
            if len(dseq) == 1 and len(tseq) == 1 and self.pair.direct[dseq[0]] == tseq[0]:
                continue
            new += self.cache.add(dseq, tseq)
        first = next((i for i, e in enumerate(t_ends) if e > self._learnt_byte), len(context))
        for i in range(first, len(context) - 1):
            new += self._learn_token(context[i])
        self._learnt_ctx, self._learnt_byte = context[:-1], max(self._learnt_byte, stop)
        self.stats.learnt += new
        self._dirty |= new > 0
        return new

    def _learn_token(self, t: int) -> int:
        """OmniDraft's rule: a target token whose text the drafter spells with several
        tokens adds that spelling (only when it decodes back to exactly the same bytes)."""
        piece = self.pair.target_pieces[t]
        if not piece or complete_utf8_prefix(piece) != len(piece):
            return 0
        s = piece.decode("utf-8")
        if self.pair.draft_space_prefix:
            if not s.startswith(" "):
                return 0
            s = s[1:]
        ids = self.drafter.tokenize(s, add_bos=False) if s else []
        if len(ids) < 2 or self.pair.draft_text(ids) != piece:
            return 0
        return int(self.cache.add(ids, [t]))

    # -- lifecycle ----------------------------------------------------------------------
    def telemetry(self) -> dict[str, float]:
        return self.stats.as_dict(len(self.cache))

    def save(self) -> None:
        if self.config.persist and self._dirty:
            self.cache.save(self.cache_path)
            self._dirty = False

    def close(self) -> None:
        try:
            self.save()
        finally:
            if self.owns_backend:
                self.drafter.close()


def _merged_confidence(tr: Translation, conf: list[float]) -> list[float]:
    """Per target token: the product of the drafter's confidence in the tokens it merges."""
    ends = tr.draft_pos[1:] + [tr.consumed] if tr.draft_pos else []
    out = []
    for i, (a, b) in enumerate(zip(tr.draft_pos, ends, strict=True)):
        out.append(float(np.prod(conf[a:b])) if i == 0 or tr.draft_pos[i - 1] != a else 1.0)
    return out

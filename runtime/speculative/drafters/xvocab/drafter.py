"""Cross-vocabulary drafting: any drafter model for any target (UAG text, OmniDraft, TLI).

The drafter never sees target ids. Each round it is brought to the committed *text*:
the target context's bytes are re-encoded with the drafter's tokenizer and its KV cache
is rolled back to where that encoding departs from what it holds (back-translation;
accepted draft fragments that re-encode differently are recomputed). It then drafts
tokens in its own vocabulary, which are turned into target ids:

* ``text`` (default): the drafted *text* is re-tokenized with the target tokenizer
  behind a committed look-behind window (:mod:`.text_translation`, after HF's Universal
  Assisted Generation). A committed trailing space is held back from a drafter whose
  pieces carry leading spaces, so it drafts ``▁little`` rather than a lone space. The
  drafter drafts greedily and the proposal is a deterministic function of the context,
  verified with a one-hot ``q``: exactly lossless for greedy *and* sampling (under
  sampling a token is accepted with probability ``p(x)``). When no text translation
  exists the round falls back to ``omni``'s token-level translation (also
  deterministic here).
* ``omni`` (OmniDraft): left to right, the longest n-gram-cache match, else the direct
  map, else stop. The cache learns from every committed round which drafter sequences
  spell which target tokens, and is persisted per tokenizer pair. Greedy is exactly
  lossless (the verifier accepts only the target's argmax); sampling is near-lossless,
  as in the paper (a merged token can arise from other drafter paths).
* ``tli`` (token-level intersection): drafter logits outside the shared vocabulary are
  suppressed and its distribution is scattered onto the target vocabulary, so ``q`` is
  the exact proposal distribution and sampling is exactly lossless with a sampled draft.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.errors import TandemError
from tandem.kernels.sampling import Sampler
from tandem.kernels.vocab_map import (
    UNMAPPED,
    Translation,
    intersection_mask,
    merged_confidence,
    restrict_logits,
    scatter_to_target,
    text_confidence,
    translate,
)
from tandem.runtime.backends.protocol import Backend, prefill, unseen
from tandem.runtime.speculative.drafters.base import Draft
from tandem.runtime.speculative.drafters.model import token_probability
from tandem.runtime.speculative.drafters.xvocab.learning import CacheLearner
from tandem.runtime.speculative.drafters.xvocab.stats import XVocabStats
from tandem.runtime.speculative.drafters.xvocab.text_translation import (
    TextProposal,
    TextTranslator,
    encodable_prefix,
    encodable_units,
)
from tandem.runtime.speculative.drafters.xvocab.translation_cache import (
    NGramCache,
    default_cache_path,
    vocab_fingerprint,
)
from tandem.runtime.speculative.drafters.xvocab.vocab_pair import (
    Tokenizer,
    VocabPair,
    complete_utf8_prefix,
)

MODES = ("text", "omni", "tli")

RETOKENIZED = 16
"""Drafter tokens at the end of the last encoding, at least, that a grown context encodes
again (:meth:`CrossVocabDrafter._encode_tail`): the text after the last committed round
may change how its last words encode."""

BOUNDARY_SEARCH = 64
"""Drafter tokens searched back from there for a word boundary, before encoding the whole
text instead (text with no spaces between words)."""


@dataclass
class XVocabConfig:
    mode: str = "text"
    """text | omni | tli (see the module docstring)."""
    text_draft_cap: float = 3.0
    """``text`` mode: drafter tokens per requested target token, at most (a target
    token often spells several drafter tokens, and the newest is held back)."""
    learn: bool = True
    """Add n-gram cache entries from every committed round."""
    persist: bool = True
    """Load the cache from, and save it to, the user data dir."""
    cache_capacity: int = 50_000
    cache_path: Path | None = None
    """Override the per-pair file in the data dir."""


@dataclass
class _Synced:
    """The committed context as the drafter sees it."""

    context: list[int]
    text: bytes
    draft_ids: list[int]
    offset: int
    """Bytes the drafter's decoding has before ``text`` (SentencePiece's dummy space)."""
    held: bytes = b""
    """Committed bytes after ``text`` not given to the drafter (a trailing space its
    next piece will carry); its draft must start with them."""


class CrossVocabDrafter:
    """A :class:`~tandem.runtime.speculative.drafters.base.Drafter` over a backend with another tokenizer."""

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
        self.text = TextTranslator(target, self.pair.target_pieces) if cfg.mode == "text" else None
        self._synced: dict[bool, _Synced] = {}
        self.last_drafted = b""
        self._draft_units = encodable_units(self.pair.draft_pieces)
        """``text`` mode: the drafted text (after the committed context) of the last round."""
        self.learner = CacheLearner(self.pair, self.cache, drafter.tokenize, self._draft_units)
        self._unlearnt: list[int] | None = None
        self._dirty = False

    # -- back-translation ---------------------------------------------------------------
    def _sync(self, context: Sequence[int], hold_space: bool = False) -> _Synced | None:
        """Encode the committed target text with the drafter's tokenizer (memoised).

        ``hold_space``: leave a trailing space out when the drafter's pieces carry
        leading spaces, so the drafter writes ``▁word`` instead of a lone ``▁`` it
        rarely saw in training (the 656k target ends most tokens with a space)."""
        context = list(context)
        old = self._synced.get(hold_space)
        if old is not None and old.context == context:
            return old
        # A context that grew from the last one: only its new tokens' text is new (a held
        # space is held only at the end, so the text still starts with the last one's).
        grown = old if old is not None and context[: len(old.context)] == old.context else None
        if grown is not None:
            full = grown.text + grown.held + self.pair.target_text(context[len(grown.context):])
        else:
            full = self.pair.target_text(context)
        held = b" " if hold_space and self.pair.draft_space_prefix and full.endswith(b" ") else b""
        text = full[: len(full) - len(held)]
        if complete_utf8_prefix(text) != len(text):
            return None  # mid-character (or invalid) bytes: nothing to encode exactly
        new_text = text[len(grown.text) if grown is not None else 0:].decode("utf-8")
        if encodable_prefix(new_text, self._draft_units) != len(new_text):
            return None  # llama.cpp would abort on a character the drafter's vocabulary lacks
        synced = (self._encode_tail(grown, context, text, held) if grown is not None else None) \
            or self._encode(context, text, held)
        if synced is not None:
            self._synced[hold_space] = synced
        return synced

    def _encode(self, context: list[int], text: bytes, held: bytes) -> _Synced | None:
        """The drafter's encoding of the whole ``text``."""
        s = text.decode("utf-8")
        if self.pair.draft_space_prefix and s.startswith(" "):
            s = s[1:]
        ids = self.drafter.tokenize(s, add_bos=self._bos is not None) if s else []
        if not s and self._bos is not None:
            ids = [self._bos]
        decoded = self.pair.draft_text(ids)
        if not ids or not decoded.endswith(text):
            return None
        return _Synced(context, text, ids, len(decoded) - len(text), held)

    def _encode_tail(self, old: _Synced, context: list[int], text: bytes, held: bytes) -> _Synced | None:
        """``old``'s encoding kept up to a word boundary :data:`RETOKENIZED` or more drafter
        tokens before its end, and only the text after it encoded again: the whole text
        encoded every round cost 9 ms at 4,000 tokens and 60 ms at 16,000 (llama.cpp's BPE
        on SmolLM2's vocabulary), against drafter steps of a few ms. A boundary is where a
        drafter token starts with a space after one that does not end with whitespace: a
        GPT-2-style pre-tokenizer splits the text there, so the tail encodes as it does
        within the whole (the tests compare the two on real text). ``None`` where there is
        no such boundary or the tail does not spell the text back (then all is encoded
        again); never for a drafter whose tokenizer adds a leading space to what it encodes."""
        pieces, ids = self.pair.draft_pieces, old.draft_ids
        if self.pair.draft_space_prefix:
            return None
        last = len(ids) - RETOKENIZED
        cut = next((i for i in range(last, max(last - BOUNDARY_SEARCH, 1), -1)
                    if pieces[ids[i]][:1] == b" " and pieces[ids[i - 1]][-1:] not in (b"", b" ", b"\n")), None)
        if cut is None:
            return None
        start = len(old.text) - len(self.pair.draft_text(ids[cut:]))  # where ids[cut] starts in the text
        if start <= 0:
            return None
        tail = text[start:]
        tail_ids = self.drafter.tokenize(tail.decode("utf-8"), add_bos=False)
        if self.pair.draft_text(tail_ids) != tail:
            return None
        return _Synced(context, text, [*ids[:cut], *tail_ids], old.offset, held)

    # -- drafting -----------------------------------------------------------------------
    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        sampler = sampler.unbiased()  # a logit bias names target ids, not this drafter's
        empty = Draft([], None, self.name)
        if max_tokens <= 0:
            return empty
        self._learn_pending()
        text_mode = self.text is not None
        budget = max(1, int(self.config.text_draft_cap * max_tokens)) if text_mode else max_tokens
        synced = self._sync(context, hold_space=text_mode)
        if synced is None or len(synced.draft_ids) + budget > self.drafter.n_ctx:
            self.stats.unsynced += synced is None
            return empty
        self.stats.rounds += 1
        backlog = unseen(self.drafter, synced.draft_ids)
        started = time.perf_counter()
        logits = prefill(self.drafter, synced.draft_ids)
        self.calls += 1
        catch_up_s = time.perf_counter() - started
        if text_mode:
            draft = self._propose_text(context, synced, logits, max_tokens, budget, sampler)
        else:
            draft = self._propose_tokens(synced, logits, max_tokens, sampler)
        return draft.caught_up(catch_up_s, backlog)

    def backlog(self, context: Sequence[int]) -> int:
        synced = self._sync(context, hold_space=self.text is not None)
        return 0 if synced is None else unseen(self.drafter, synced.draft_ids)

    def _propose_tokens(self, synced: _Synced, logits: np.ndarray, max_tokens: int, sampler: Sampler) -> Draft:
        """Draft in the drafter's vocabulary and translate token by token (``omni``, ``tli``)."""
        history = list(synced.draft_ids)
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
            confidence = merged_confidence(tr, conf)
        self.stats.proposed += len(tokens)
        self.stats.from_cache += from_cache
        return Draft(tokens, q_rows, self.name, confidence)

    def _propose_text(self, context: Sequence[int], synced: _Synced, logits: np.ndarray, max_tokens: int,
                      budget: int, sampler: Sampler) -> Draft:
        """Draft greedily until the re-tokenized text yields ``max_tokens`` stable target
        tokens (or ``budget`` drafter tokens, the drafter's end of text, or SpecDec++'s
        stop). Greedy drafting makes the proposal a function of the context: one-hot q."""
        assert self.text is not None
        history = list(synced.draft_ids)
        held, drafted, conf, ends = synced.held, [], [], []
        text, prop, survive, final = b"", TextProposal(), 1.0, False
        for j in range(budget):
            d = int(np.argmax(sampler.adjusted(logits, history)))
            drafted.append(d)
            history.append(d)
            conf.append(token_probability(logits, d))
            survive *= conf[-1]
            text += self.pair.draft_pieces[d]
            ends.append(len(text) - len(held))
            if d in self._eog:
                final = True
            elif not (text.startswith(held) if len(text) >= len(held) else held.startswith(text)):
                break  # the drafter does not even agree with the committed text
            elif len(text) > len(held):
                prop = self.text.propose(context, text[len(held):])
                if len(prop.tokens) >= max_tokens:
                    break
            if final or (self.stop_threshold is not None and 1.0 - survive > self.stop_threshold):
                break
            if j + 1 < budget:
                logits = self.drafter.evaluate([d])[-1]
                self.calls += 1
        if final and text.startswith(held):
            prop = self.text.propose(context, text[len(held):], final=True)
        tokens = prop.tokens[:max_tokens]
        if final and prop.held_back == 0 and len(tokens) < max_tokens and self.pair.direct[drafted[-1]] != UNMAPPED:
            tokens.append(int(self.pair.direct[drafted[-1]]))
            prop.ends.append(ends[-1])
        self.last_drafted = text[len(held) :] if text.startswith(held) else b""
        self.stats.drafted += len(drafted)
        self.stats.anchored += prop.anchored
        if not tokens and drafted and not held:
            return self._fallback(drafted, conf, max_tokens)
        self.stats.proposed += len(tokens)
        return Draft(tokens, None, self.name, text_confidence(prop.ends[: len(tokens)], ends, conf))

    def _fallback(self, drafted: list[int], conf: list[float], max_tokens: int) -> Draft:
        """Token-level (OmniDraft) translation of a greedy draft: deterministic, one-hot q."""
        tr = translate(drafted, conf, self.pair.direct, self.cache.longest_match, max_tokens)
        self.stats.fallbacks += bool(tr.tokens)
        self.stats.proposed += len(tr.tokens)
        self.stats.from_cache += tr.cache_hits
        return Draft(tr.tokens, None, self.name, merged_confidence(tr, conf))

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
        """Learning re-encodes the committed text with the drafter's tokenizer: it is
        deferred to the next proposal (or :meth:`close`) and done then in one pass, so a
        drafter the policy has switched off costs nothing per round."""
        self.stats.accepted += n_accepted
        if self.config.learn and self.config.mode != "tli":
            self._unlearnt = list(context)

    def _learn_pending(self) -> None:
        if self._unlearnt is not None:
            context, self._unlearnt = self._unlearnt, None
            self.learn(context)

    def learn(self, context: Sequence[int]) -> int:
        """Teach the n-gram cache what the committed text shows (:class:`.learning.CacheLearner`);
        returns how many entries were new."""
        context = list(context)
        self.learner.follow(context)
        synced = self._sync(context)
        if synced is None or len(context) < 2:
            return 0
        new = self.learner.learn(context, synced.draft_ids, synced.offset)
        self.stats.learnt += new
        self._dirty |= new > 0
        return new

    # -- lifecycle ----------------------------------------------------------------------
    def telemetry(self) -> dict[str, float]:
        return self.stats.as_dict(len(self.cache))

    def save(self) -> None:
        if self.config.persist and self._dirty:
            self.cache.save(self.cache_path)
            self._dirty = False

    def weight_bytes(self) -> int:
        return self.drafter.memory().weights

    def model_backend(self) -> Backend:
        return self.drafter

    def prime(self, tokens: Sequence[int]) -> None:
        """Not used: see :meth:`~tandem.runtime.speculative.drafters.base.Drafter.prime`."""

    def close(self) -> None:
        try:
            self._learn_pending()
            self.save()
        finally:
            if self.owns_backend:
                self.drafter.close()


"""Cross-vocabulary mapping as pure functions: direct map, TLI scatter, translation.

Two tokenizers agree on *text*, not on ids. Every function here works on the raw bytes
each token contributes to the output (``Backend.token_bytes``: llama.cpp has already
turned SentencePiece's ``▁`` and byte-level BPE's ``Ġ`` into a space and byte tokens
such as ``<0x0A>`` into their byte), so word-boundary markers are normalised by
construction rather than by string heuristics.

* :func:`build_direct_map`: drafter id -> target id of a token with identical bytes.
* :func:`scatter_to_target`: a drafter distribution restricted to the mapped ids, moved
  onto the target vocabulary (TLI, Timor et al. 2025). Sampling the drafter from it and
  proposing the mapped id makes the scattered row the exact proposal distribution, so
  the standard rejection rule stays exactly lossless.
* :func:`translate`: OmniDraft's left-to-right translation of drafted ids into target
  ids, longest n-gram-cache match first, then the direct map, else stop. The target
  text it yields is always a prefix of the drafted text (it never invents text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

UNMAPPED = -1

Matcher = Callable[[Sequence[int], int], tuple[int, tuple[int, ...]] | None]
"""``(draft_ids, start) -> (n_draft_consumed, target_ids)`` for the longest cached match."""


def build_direct_map(
    draft_pieces: Sequence[bytes],
    target_pieces: Sequence[bytes],
    *,
    target_priority: Sequence[float] | None = None,
    special_pairs: Sequence[tuple[int, int]] = (),
) -> np.ndarray:
    """``map[d]`` = target id whose bytes equal drafter id ``d``'s bytes, or ``UNMAPPED``.

    Tokens with empty bytes (control tokens) are never mapped by text; ``special_pairs``
    maps them explicitly (e.g. drafter EOS -> target EOS). When several target tokens
    share the same bytes (a SentencePiece byte token ``<0x41>`` and the ordinary ``A``),
    the one with the highest ``target_priority`` wins (ties: the higher id, which in
    SentencePiece vocabularies is the ordinary token, since byte tokens come first),
    because that is the one the target itself emits and greedy verification accepts.
    """
    prio = np.arange(len(target_pieces), dtype=np.float64) if target_priority is None else target_priority
    best: dict[bytes, int] = {}
    for t, piece in enumerate(target_pieces):
        if not piece:
            continue
        cur = best.get(piece)
        if cur is None or (prio[t], t) > (prio[cur], cur):
            best[piece] = t
    out = np.full(len(draft_pieces), UNMAPPED, dtype=np.int64)
    for d, piece in enumerate(draft_pieces):
        if piece:
            out[d] = best.get(piece, UNMAPPED)
    for d, t in special_pairs:
        if 0 <= d < len(out) and 0 <= t < len(target_pieces):
            out[d] = t
    return out


def intersection_mask(direct_map: np.ndarray) -> np.ndarray:
    """Boolean mask of drafter ids that have a target counterpart (the shared vocabulary)."""
    return direct_map != UNMAPPED


def restrict_logits(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Drafter logits with every id outside the shared vocabulary suppressed (-inf)."""
    return np.where(mask, np.asarray(logits, dtype=np.float64), -np.inf)


def scatter_to_target(q_draft: np.ndarray, direct_map: np.ndarray, n_target: int) -> np.ndarray:
    """Move a drafter distribution onto the target vocabulary (mass of unmapped ids dropped).

    Drafter ids sharing one target id add up, so when ``q_draft`` is supported on the
    shared vocabulary the result is exactly the distribution of ``direct_map[d]`` for
    ``d ~ q_draft``.
    """
    q_draft = np.asarray(q_draft, dtype=np.float64)
    ok = direct_map != UNMAPPED
    return np.bincount(direct_map[ok], weights=q_draft[ok], minlength=n_target)[:n_target]


@dataclass
class Translation:
    """Target tokens for a draft, and where each came from."""

    tokens: list[int] = field(default_factory=list)
    q_tokens: list[float] = field(default_factory=list)
    """Proposal probability of each target token: the product of the drafter
    probabilities of the drafter tokens it replaces (1.0 for the later tokens of a
    multi-token cache entry, which are implied by the first)."""
    draft_pos: list[int] = field(default_factory=list)
    """Index of the first drafter token behind each target token."""
    consumed: int = 0
    """How many drafter tokens were translated."""
    cache_hits: int = 0
    """How many target tokens came from the n-gram cache (vs the direct map)."""


def translate(
    draft: Sequence[int],
    q_draft: Sequence[float],
    direct_map: np.ndarray,
    match: Matcher | None = None,
    max_tokens: int | None = None,
) -> Translation:
    """Translate drafted ids left to right; stop at the first id nothing covers.

    At each position the longest cache match wins over the direct map (OmniDraft:
    ``f la ke`` -> ``flake`` avoids the false rejection of ``f`` when the target prefers
    ``flake``). Deterministic, and yields at most ``len(draft)`` target tokens when
    every cache entry maps n drafter ids to at most n target ids (see ``NGramCache``).
    """
    out = Translation()
    limit = len(draft) if max_tokens is None else max_tokens
    j = 0
    while j < len(draft) and len(out.tokens) < limit:
        hit = match(draft, j) if match is not None else None
        if hit is not None:
            n, targets = hit
            if len(out.tokens) + len(targets) > limit:
                break
            prob = float(np.prod(np.asarray(q_draft[j : j + n], dtype=np.float64)))
            for i, t in enumerate(targets):
                out.tokens.append(int(t))
                out.q_tokens.append(prob if i == 0 else 1.0)
                out.draft_pos.append(j)
            out.cache_hits += len(targets)
            j += n
            continue
        t = int(direct_map[draft[j]]) if 0 <= draft[j] < len(direct_map) else UNMAPPED
        if t == UNMAPPED:
            break
        out.tokens.append(t)
        out.q_tokens.append(float(q_draft[j]))
        out.draft_pos.append(j)
        j += 1
    out.consumed = j
    return out


def byte_offsets(pieces: Sequence[bytes]) -> list[int]:
    """Cumulative end offsets of each piece in the concatenated text (length n)."""
    ends: list[int] = []
    pos = 0
    for p in pieces:
        pos += len(p)
        ends.append(pos)
    return ends


def aligned_spans(
    draft_ends: Sequence[int], target_ends: Sequence[int], start: int = 0, stop: int | None = None
) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Minimal spans where both tokenizations of the same text cut at the same byte.

    ``*_ends`` are cumulative end offsets (:func:`byte_offsets`) of two tokenizations of
    one text. Returns ``((d0, d1), (t0, t1))`` index ranges covering identical bytes,
    between consecutive common cut points in ``[start, stop]``. These are what the
    n-gram cache learns: the drafter ids ``d0:d1`` spell exactly target ids ``t0:t1``.
    """
    stop = min(draft_ends[-1] if draft_ends else 0, target_ends[-1] if target_ends else 0) if stop is None else stop
    d_at = {e: i + 1 for i, e in enumerate(draft_ends)}
    t_at = {e: i + 1 for i, e in enumerate(target_ends)}
    d_at[0] = t_at[0] = 0
    cuts = sorted(c for c in d_at.keys() & t_at.keys() if start <= c <= stop)
    return [((d_at[a], d_at[b]), (t_at[a], t_at[b])) for a, b in zip(cuts, cuts[1:], strict=False)]


def merged_confidence(tr: Translation, conf: list[float]) -> list[float]:
    """Per target token: the product of the drafter's confidence in the tokens it merges."""
    ends = tr.draft_pos[1:] + [tr.consumed] if tr.draft_pos else []
    out = []
    for i, (a, b) in enumerate(zip(tr.draft_pos, ends, strict=True)):
        out.append(float(np.prod(conf[a:b])) if i == 0 or tr.draft_pos[i - 1] != a else 1.0)
    return out


def text_confidence(token_ends: list[int], draft_ends: list[int], conf: list[float]) -> list[float]:
    """Per target token: the product of the drafter's confidence in the drafter tokens
    needed to spell it (those not already needed by the previous target token)."""
    out, j = [], 0
    for end in token_ends:
        c = 1.0
        while j < len(draft_ends) and (j == 0 or draft_ends[j - 1] < end):
            c *= conf[j]
            j += 1
        out.append(c)
    return out

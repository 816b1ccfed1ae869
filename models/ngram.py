"""Token n-gram tables (1- to 6-grams) built from text the user chooses.

Superposed decoding re-scores the model's shared proposal per draft with an n-gram
model, because the n-gram model sees each draft's own last tokens while the model sees
only their mix. The tables count *token ids* of one tokenizer, so a model file records
a fingerprint of the tokenizer it was built with and is only used with a matching one.

Layout (compact and fast to query): for each context length c = 1..5 the contexts are
hashed to uint64 and stored sorted, each with a slice of (next token, count) pairs
sorted by token. A lookup is one binary search for the context and one vectorised
binary search for the candidate tokens. Unigram counts are a dense array.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.errors import ModelFormatError, TandemError
from tandem.models.paths import data_dir

MAX_ORDER = 6
"""Longest n-gram: a context of 5 tokens plus the next one."""
_PRIME = np.uint64(0x100000001B3)
_MASK = (1 << 64) - 1
FORMAT_VERSION = 1


def ngram_dir() -> Path:
    path = data_dir() / "ngram"
    path.mkdir(parents=True, exist_ok=True)
    return path


def tokenizer_fingerprint(n_vocab: int, token_bytes: Callable[[int], bytes]) -> str:
    """A stable id of a tokenizer: the hash of every token's bytes, in id order."""
    h = hashlib.sha256(str(n_vocab).encode())
    for t in range(n_vocab):
        piece = token_bytes(t)
        h.update(len(piece).to_bytes(2, "little"))
        h.update(piece)
    return h.hexdigest()[:16]


def _hash_contexts(tokens: np.ndarray, c: int) -> np.ndarray:
    """uint64 hash of tokens[i-c:i] for every i in c..len-1 (polynomial, wrapping)."""
    n = len(tokens) - c
    h = np.zeros(n, dtype=np.uint64)
    t = tokens.astype(np.uint64) + np.uint64(1)
    for j in range(c):
        h = h * _PRIME + t[j : j + n]
    return h


def hash_context(context: Sequence[int]) -> int:
    """The same hash as :func:`_hash_contexts`, for one context at query time."""
    h = 0
    for t in context:
        h = (h * 0x100000001B3 + int(t) + 1) & _MASK
    return h


@dataclass
class _Order:
    keys: np.ndarray  # uint64 (n_ctx,), sorted
    offsets: np.ndarray  # int64 (n_ctx + 1,)
    totals: np.ndarray  # uint32 (n_ctx,)
    nexts: np.ndarray  # int32 (n_pairs,), sorted within each context
    counts: np.ndarray  # uint32 (n_pairs,)

    def lookup(self, key: int, candidates: np.ndarray) -> np.ndarray:
        """P(candidate | context) for one context hash; zeros where unseen."""
        i = int(np.searchsorted(self.keys, np.uint64(key)))
        if i >= len(self.keys) or int(self.keys[i]) != key:
            return np.zeros(len(candidates))
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        nexts = self.nexts[lo:hi]
        pos = np.searchsorted(nexts, candidates)
        pos_c = np.minimum(pos, len(nexts) - 1)
        hit = nexts[pos_c] == candidates
        return np.where(hit, self.counts[lo:hi][pos_c], 0) / float(self.totals[i])


def _build_order(docs: Sequence[np.ndarray], c: int, min_count: int) -> _Order:
    keys_l, nexts_l = [], []
    for d in docs:
        if len(d) > c:
            keys_l.append(_hash_contexts(d, c))
            nexts_l.append(d[c:].astype(np.int32))
    if not keys_l:
        empty_u = np.zeros(0, dtype=np.uint64)
        return _Order(empty_u, np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.uint32),
                      np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.uint32))
    keys, nexts = np.concatenate(keys_l), np.concatenate(nexts_l)
    order = np.lexsort((nexts, keys))
    keys, nexts = keys[order], nexts[order]
    new_pair = np.ones(len(keys), dtype=bool)
    new_pair[1:] = (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])
    starts = np.flatnonzero(new_pair)
    counts = np.diff(np.append(starts, len(keys))).astype(np.uint32)
    pkeys, pnexts = keys[starts], nexts[starts]
    if min_count > 1:
        keep = counts >= min_count
        pkeys, pnexts, counts = pkeys[keep], pnexts[keep], counts[keep]
    new_ctx = np.ones(len(pkeys), dtype=bool)
    new_ctx[1:] = pkeys[1:] != pkeys[:-1]
    ctx_starts = np.flatnonzero(new_ctx)
    offsets = np.append(ctx_starts, len(pkeys)).astype(np.int64)
    totals = np.add.reduceat(counts, ctx_starts).astype(np.uint32) if len(ctx_starts) else np.zeros(0, np.uint32)
    return _Order(pkeys[ctx_starts], offsets, totals, pnexts, counts)


class NgramModel:
    """Counts of 1..6-grams over token ids, queried as interpolated probabilities."""

    def __init__(self, unigrams: np.ndarray, orders: list[_Order], meta: dict) -> None:
        self.unigrams = unigrams
        self.orders = orders  # orders[c-1] holds contexts of length c
        self.meta = meta

    @property
    def fingerprint(self) -> str:
        return str(self.meta.get("fingerprint", ""))

    @property
    def n_tokens(self) -> int:
        return int(self.meta.get("n_tokens", 0))

    @classmethod
    def build(
        cls,
        docs: Iterable[Sequence[int]],
        n_vocab: int,
        *,
        fingerprint: str = "",
        min_count: int = 1,
        sources: Sequence[str] = (),
    ) -> NgramModel:
        """Count n-grams within each document (never across two)."""
        arrays = [np.asarray(d, dtype=np.int64) for d in docs]
        arrays = [a for a in arrays if len(a)]
        if any(((a < 0) | (a >= n_vocab)).any() for a in arrays):
            raise ValueError("token id outside the vocabulary")
        flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
        unigrams = np.bincount(flat, minlength=n_vocab).astype(np.uint32)
        orders = [_build_order(arrays, c, min_count) for c in range(1, MAX_ORDER)]
        meta = {"version": FORMAT_VERSION, "fingerprint": fingerprint, "n_vocab": n_vocab,
                "n_tokens": int(len(flat)), "n_docs": len(arrays), "sources": list(sources),
                "min_count": min_count}
        return cls(unigrams, orders, meta)

    def probs(self, context: Sequence[int], candidates: np.ndarray, weights: Sequence[float]) -> np.ndarray:
        """Σ_j λ_j · P(candidate | last j tokens of ``context``) for j = 1..len(weights)."""
        cand = np.asarray(candidates, dtype=np.int32)
        out = np.zeros(len(cand), dtype=np.float64)
        ctx = list(context)
        for j, lam in enumerate(weights, start=1):
            if lam == 0.0 or j > len(ctx) or j > len(self.orders):
                continue
            out += lam * self.orders[j - 1].lookup(hash_context(ctx[-j:]), cand)
        return out

    def unigram_prob(self, candidates: np.ndarray) -> np.ndarray:
        total = float(self.unigrams.sum()) or 1.0
        return self.unigrams[np.asarray(candidates, dtype=np.int64)] / total

    def nbytes(self) -> int:
        arrays = [self.unigrams] + [a for o in self.orders for a in (o.keys, o.offsets, o.totals, o.nexts, o.counts)]
        return int(sum(a.nbytes for a in arrays))

    # -- storage --------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        arrays: dict[str, np.ndarray] = {"unigrams": self.unigrams,
                                         "meta": np.array(json.dumps(self.meta))}
        for c, o in enumerate(self.orders, start=1):
            for name in ("keys", "offsets", "totals", "nexts", "counts"):
                arrays[f"o{c}_{name}"] = getattr(o, name)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> NgramModel:
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as f:
                meta = json.loads(str(f["meta"]))
                if meta.get("version") != FORMAT_VERSION:
                    raise ModelFormatError(f"{path} is n-gram format {meta.get('version')}, expected {FORMAT_VERSION}: rebuild it.")
                orders = [_Order(*(f[f"o{c}_{n}"] for n in ("keys", "offsets", "totals", "nexts", "counts")))
                          for c in range(1, MAX_ORDER)]
                return cls(f["unigrams"], orders, meta)
        except (OSError, KeyError, ValueError) as exc:
            raise ModelFormatError(f"{path} is not a Tandem n-gram file ({exc}).") from None


def default_path(name: str, fingerprint: str) -> Path:
    if not name or any(ch in name for ch in "/\\") or name.startswith("."):
        raise TandemError(f"Invalid n-gram model name {name!r}: use letters, digits, '-' or '_'.")
    return ngram_dir() / f"{name}-{fingerprint}.npz"


def find_for(fingerprint: str, name: str | None = None) -> Path | None:
    """The newest stored n-gram file built with this tokenizer (optionally of this name)."""
    pattern = f"{name}-{fingerprint}.npz" if name else f"*-{fingerprint}.npz"
    found = sorted(ngram_dir().glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    return found[0] if found else None

"""OmniDraft's n-gram cache: drafter-token sequences that spell whole target tokens.

A trie from drafter-id sequences to target-id sequences of the same text (most often
one target token, e.g. drafter ``▁f la ke`` -> target ``▁flake``), learnt from what the
target actually commits, so translation proposes the target's own tokens instead of
the drafter's fragments. Entries map n drafter ids to at most n target ids, so a
translated draft is never longer than the drafted one.

The cache is bounded (frequency-then-recency eviction) and persisted in the user data
dir under a key made from both tokenizers, so acceptance keeps improving across runs
with the same pair and never leaks across pairs.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.models import paths

FORMAT_VERSION = 1


@dataclass
class Entry:
    target: tuple[int, ...]
    hits: int = 0
    """Times this entry was learnt again or used in a translation (eviction weight)."""
    stamp: int = 0
    """Logical clock of the last use (eviction tie-break: least recent goes first)."""


class _Node:
    __slots__ = ("children", "entry")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None


def vocab_fingerprint(pieces: Iterable[bytes], extra: str = "") -> str:
    """A short stable hash of a vocabulary (every token's bytes, in id order)."""
    h = hashlib.sha256(extra.encode())
    for p in pieces:
        h.update(len(p).to_bytes(2, "little"))
        h.update(p)
    return h.hexdigest()[:16]


def default_cache_path(draft_fp: str, target_fp: str) -> Path:
    """Where the cache for one (drafter, target) tokenizer pair lives."""
    return paths.data_dir() / "ngram-cache" / f"{draft_fp}-{target_fp}.json"


class NGramCache:
    """Bounded trie of ``drafter ids -> target ids`` with longest-match lookup."""

    def __init__(self, capacity: int = 50_000, max_draft_len: int = 12) -> None:
        self.capacity = capacity
        self.max_draft_len = max_draft_len
        self._root = _Node()
        self._entries: dict[tuple[int, ...], Entry] = {}
        self._clock = 0
        self.lookups = 0
        self.matches = 0

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [(k, e.target) for k, e in self._entries.items()]

    def get(self, draft: Sequence[int]) -> tuple[int, ...] | None:
        e = self._entries.get(tuple(draft))
        return None if e is None else e.target

    def add(self, draft: Sequence[int], target: Sequence[int]) -> bool:
        """Learn ``draft -> target``; returns whether it was new.

        A sequence already mapped keeps its first target (deterministic merging) and
        only gains weight. Entries longer than ``max_draft_len`` drafter ids, or with
        more target ids than drafter ids, are refused.
        """
        key, tgt = tuple(int(x) for x in draft), tuple(int(x) for x in target)
        if not key or not tgt or len(key) > self.max_draft_len or len(tgt) > len(key):
            return False
        self._clock += 1
        old = self._entries.get(key)
        if old is not None:
            old.hits += 1
            old.stamp = self._clock
            return False
        node = self._root
        for d in key:
            node = node.children.setdefault(d, _Node())
        node.entry = self._entries[key] = Entry(tgt, 1, self._clock)
        if len(self._entries) > self.capacity:
            self._evict(len(self._entries) - int(self.capacity * 0.9))
        return True

    def longest_match(self, draft: Sequence[int], start: int) -> tuple[int, tuple[int, ...]] | None:
        """The longest entry that ``draft[start:]`` begins with, as ``(n, target ids)``."""
        self.lookups += 1
        node, best = self._root, None
        for n, d in enumerate(draft[start : start + self.max_draft_len], 1):
            node = node.children.get(int(d))
            if node is None:
                break
            if node.entry is not None:
                best = (n, node.entry)
        if best is None:
            return None
        self.matches += 1
        self._clock += 1
        best[1].hits += 1
        best[1].stamp = self._clock
        return best[0], best[1].target

    def has_path(self, draft: Sequence[int]) -> bool:
        """Whether ``draft`` is a prefix of (or equal to) some entry's drafter sequence."""
        node: _Node | None = self._root
        for d in draft:
            node = node.children.get(int(d))
            if node is None:
                return False
        return True

    def _evict(self, count: int) -> None:
        """Drop the ``count`` least valuable entries (fewest hits, then least recent)."""
        victims = sorted(self._entries.items(), key=lambda kv: (kv[1].hits, kv[1].stamp))[:count]
        for key, _ in victims:
            del self._entries[key]
            self._unlink(key)

    def _unlink(self, key: tuple[int, ...]) -> None:
        path = [self._root]
        for d in key:
            path.append(path[-1].children[d])
        path[-1].entry = None
        for depth in range(len(key), 0, -1):
            node = path[depth]
            if node.entry is not None or node.children:
                break
            del path[depth - 1].children[key[depth - 1]]

    # -- persistence ------------------------------------------------------------------
    def to_json(self) -> dict:
        rows = sorted(self._entries.items(), key=lambda kv: kv[1].stamp)
        return {
            "version": FORMAT_VERSION,
            "entries": [[list(k), list(e.target), e.hits] for k, e in rows],
        }

    @classmethod
    def from_json(cls, data: dict, capacity: int = 50_000, max_draft_len: int = 12) -> NGramCache:
        cache = cls(capacity, max_draft_len)
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            return cache
        for row in data.get("entries", []):
            try:
                key, tgt, hits = row
                if cache.add(key, tgt):
                    cache._entries[tuple(key)].hits = int(hits)
            except (TypeError, ValueError):
                continue
        return cache

    def save(self, path: Path) -> None:
        """Write atomically (temp file + rename) so a crash never leaves half a cache."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_json(), f, separators=(",", ":"))
            os.replace(tmp, path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, capacity: int = 50_000, max_draft_len: int = 12) -> NGramCache:
        """Read a saved cache; a missing or unreadable file gives an empty cache
        (the cache is an optimisation: losing it costs speed, never correctness)."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return cls(capacity, max_draft_len)
        return cls.from_json(data, capacity, max_draft_len)

"""SuffixDecoding-style drafting (Oliaro et al., NeurIPS 2025; ArcticInference defaults).

Two depth-limited suffix tries with occurrence counts:

* a per-request trie over the current prompt + conversation + output, grown
  incrementally as tokens are committed (O(depth) per token), and cut back where the
  next request changes the end of the conversation;
* a global trie over earlier requests' sequences, shared by every drafter in the
  process for the same vocabulary, FIFO-evicted (``max_cached_requests``), and kept
  across sessions in the user's data dir when :data:`~tandem.runtime.choices.SuffixMemory` says ``saved``
  (what the user wrote and read yesterday drafts today's edit of it).

A proposal finds the longest suffix of the context (at most ``max_match`` tokens) that
occurred before with a continuation, then follows the most frequent child while the
path probability (child count / count of all continuations, multiplied along the path) stays at or
above ``min_token_prob``, for at most ``max_spec_factor`` x match-length tokens. The
verifier here is linear, so we speculate the single most likely path of the paper's
speculation tree. Whichever trie gives the higher expected accepted length (sum of path
probabilities) wins.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.kernels.sampling import Sampler
from tandem.models.paths import write_cache_file
from tandem.runtime.speculative.drafters.base import Draft, ModelFreeDrafter, same_request

SAVED_FORMAT = 1


class _Node:
    """A trie node with its occurrence count and children.

    Most nodes have one child: a context token that never repeated extends a single
    path at every depth. That child sits in two slots, and a dict is made only when a
    second child arrives, so a node is about 64 bytes, not the 288 of an object with a
    one-entry dict, and the ``depth`` nodes a new context token adds take a quarter of
    the memory. Children iterate in the order they were added, as a dict's do."""

    __slots__ = ("count", "token", "only", "more")

    def __init__(self) -> None:
        self.count = 0
        self.token = -1
        """The single child's token (-1: none, or the children are in :attr:`more`)."""
        self.only: _Node | None = None
        self.more: dict[int, _Node] | None = None

    def child(self, token: int) -> _Node | None:
        if self.more is not None:
            return self.more.get(token)
        return self.only if self.token == token else None

    def add_child(self, token: int) -> _Node:
        child = _Node()
        if self.more is not None:
            self.more[token] = child
        elif self.only is None:
            self.token, self.only = token, child
        else:
            self.more = {self.token: self.only, token: child}
            self.token, self.only = -1, None
        return child

    def remove_child(self, token: int) -> None:
        if self.more is not None:
            del self.more[token]
        else:
            self.token, self.only = -1, None

    def has_children(self) -> bool:
        return bool(self.more) if self.more is not None else self.only is not None

    def items(self) -> list[tuple[int, _Node]]:
        """(token, child) pairs, oldest child first."""
        if self.more is not None:
            return list(self.more.items())
        return [] if self.only is None else [(self.token, self.only)]


class SuffixTrie:
    """All substrings of length <= ``depth`` of the inserted sequences, with counts."""

    def __init__(self, depth: int = 24) -> None:
        self.depth = depth
        self.root = _Node()

    def append(self, active: list[_Node], token: int, delta: int = 1) -> list[_Node]:
        """Extend a sequence by ``token``. ``active[j]`` is the node of its length-j
        suffix (``active[0]`` the root); returns the new active list."""
        self.root.count += delta
        new = [self.root]
        for node in active:
            child = node.child(token)
            if child is None:
                child = node.add_child(token)
            child.count += delta
            if child.count <= 0:
                node.remove_child(token)
            elif len(new) < self.depth:
                new.append(child)
        return new

    def add(self, seq: Sequence[int], delta: int = 1) -> None:
        active = [self.root]
        for t in seq:
            active = self.append(active, t, delta)

    def suffix_nodes(self, seq: Sequence[int]) -> list[_Node]:
        """The active list after an indexed ``seq`` (the nodes of its suffixes shorter
        than ``depth``, the root first): where :meth:`append` goes on from its end."""
        active = [self.root]
        for j in range(1, min(self.depth - 1, len(seq)) + 1):
            node = self.walk(seq[len(seq) - j:])
            if node is None:
                break
            active.append(node)
        return active

    def remove_tail(self, seq: Sequence[int], keep: int) -> list[_Node]:
        """Un-index ``seq[keep:]`` of a sequence that was added whole: every substring
        that ends past ``keep`` loses its count, as if only ``seq[:keep]`` had been added.
        Returns the active list after ``seq[:keep]``. It costs ``depth`` node visits a
        removed token, against as many a token of the whole sequence to index it again."""
        kept = self.suffix_nodes(seq[:keep])
        active = kept
        for t in seq[keep:]:
            active = self.append(active, t, -1)
        return kept

    def walk(self, path: Sequence[int]) -> _Node | None:
        node = self.root
        for t in path:
            node = node.child(t)
            if node is None:
                return None
        return node

    def longest_match(self, context: Sequence[int], max_match: int) -> tuple[_Node | None, int]:
        """The node of the longest context suffix (<= ``max_match``) that has a
        continuation. Presence is monotone in the length, so binary search works."""
        lo, hi, best = 1, min(max_match, len(context)), (None, 0)
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.walk(context[len(context) - mid :])
            if node is not None and node.has_children():
                best, lo = (node, mid), mid + 1
            else:  # absent, or a leaf: every longer suffix is absent or a leaf too
                hi = mid - 1
        return best


@dataclass(frozen=True)
class SuffixParams:
    depth: int = 24
    """Trie depth: longest substring counted (match + speculation)."""
    max_match: int = 16
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    max_cached_requests: int = 10_000
    max_cached_tokens: int = 16_384
    """Bound on the global trie's memory: about 1.6 kB per token that never repeats
    (``depth`` nodes of about 64 bytes, :class:`_Node`), so at most ~30 MB — a cost the
    memory planner's budget must leave room for (200,000 tokens, the old bound, reached
    1.4 GB with nodes of 288 bytes)."""
    max_request_tokens: int = 4096
    """Only the last this-many tokens of a finished request go to the global trie."""


def speculate(node: _Node, match_len: int, max_tokens: int, params: SuffixParams) -> tuple[list[int], list[float], float]:
    """Greedy most-frequent path from ``node``: (tokens, per-token probs, score)."""
    limit = min(max_tokens, int(params.max_spec_factor * match_len))
    tokens: list[int] = []
    probs: list[float] = []
    path_prob, score = 1.0, 0.0
    while len(tokens) < limit and node.has_children():
        children = node.items()
        token, child = max(children, key=lambda kv: kv[1].count)
        # Denominator: occurrences *with* a continuation, so the occurrence being
        # matched right now (at the end of the context) does not dilute the estimate.
        p = child.count / sum(c.count for _, c in children)
        if path_prob * p < params.min_token_prob:
            break
        path_prob *= p
        score += path_prob
        tokens.append(token)
        probs.append(p)
        node = child
    return tokens, probs, score


def match_certainty(match_len: int) -> float:
    """How much a continuation found after ``match_len`` matching tokens is to be trusted
    (0.5 after one token, 0.94 after four); adaptive policies calibrate it per source
    against what is accepted."""
    return 1.0 - 0.5 ** max(match_len, 0)


class GlobalSuffixCache:
    """Sequences of finished requests, in one trie, FIFO-evicted. Thread-safe.

    With a ``file``, the sequences of earlier sessions are read back on a background
    thread (rebuilding the trie of a full cache takes ~0.3 s of Python, which must not
    delay the first token; until it is done, drafting uses what this process added) and
    :meth:`save` writes them all back, atomically. A file that cannot be read (absent,
    corrupt, another format) starts an empty cache and is replaced on the next save."""

    def __init__(self, params: SuffixParams | None = None, file: Path | None = None, n_vocab: int = 0) -> None:
        """``n_vocab``: ids read back from ``file`` must lie below it (a drafted id the
        target does not have would reach llama.cpp)."""
        self.params = params or SuffixParams()
        self.trie = SuffixTrie(self.params.depth)
        self._seqs: deque[list[int]] = deque()
        self._tokens = 0
        self.lock = threading.Lock()
        self.file = file
        self.n_vocab = n_vocab
        self._changed = False
        self._loaded = threading.Event()
        if file is None:
            self._loaded.set()
        else:
            threading.Thread(target=self._load, name="suffix-tree-load", daemon=True).start()

    def add(self, seq: Sequence[int]) -> None:
        seq = list(seq[-self.params.max_request_tokens :])
        if len(seq) < 2:
            return
        with self.lock:
            self.trie.add(seq)
            self._seqs.append(seq)
            self._tokens += len(seq)
            self._changed = True
            self._evict()

    def _evict(self) -> None:
        while self._seqs and (
            len(self._seqs) > self.params.max_cached_requests or self._tokens > self.params.max_cached_tokens
        ):
            old = self._seqs.popleft()
            self.trie.add(old, delta=-1)
            self._tokens -= len(old)

    def _load(self) -> None:
        """Earlier sessions' sequences first (oldest, so evicted first), then whatever
        this process added while they were read."""
        try:
            saved = read_sequences(self.file, self.n_vocab) if self.file is not None else []
            trie = SuffixTrie(self.params.depth)
            for seq in saved:
                trie.add(seq)
            with self.lock:
                for seq in self._seqs:
                    trie.add(seq)
                self._seqs = deque([*saved, *self._seqs])
                self._tokens = sum(map(len, self._seqs))
                self.trie = trie
                self._evict()
        finally:
            self._loaded.set()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Wait for the earlier sessions' sequences to be in the trie."""
        return self._loaded.wait(timeout)

    def save(self) -> bool:
        """Write the sequences to :attr:`file` if they changed (best effort: a read-only
        or full data dir only means starting the next session without them)."""
        if self.file is None or not self.wait_loaded(timeout=30):
            return False
        with self.lock:
            if not self._changed:
                return False
            text = json.dumps({"format": SAVED_FORMAT, "sequences": list(self._seqs)}, separators=(",", ":"))
            self._changed = False
        return write_cache_file(self.file, text)

    def __len__(self) -> int:
        return len(self._seqs)


def read_sequences(file: Path, n_vocab: int) -> list[list[int]]:
    """The sequences a :meth:`GlobalSuffixCache.save` wrote (none from a file that is
    absent, unreadable or not one of ours; a sequence with an id outside ``[0, n_vocab)``
    is left out)."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("format") != SAVED_FORMAT or not isinstance(data.get("sequences"), list):
        return []
    return [seq for seq in data["sequences"]
            if isinstance(seq, list) and all(type(t) is int and 0 <= t < n_vocab for t in seq)]


_GLOBAL: dict[tuple[str, Path | None], GlobalSuffixCache] = {}
_GLOBAL_LOCK = threading.Lock()


def global_cache(key: str, params: SuffixParams | None = None, file: Path | None = None,
                 n_vocab: int = 0) -> GlobalSuffixCache:
    """The process-wide cache for one vocabulary (``key``: its fingerprint), kept in
    ``file`` across sessions when one is given (ids below ``n_vocab``)."""
    with _GLOBAL_LOCK:
        cache = _GLOBAL.get((key, file))
        if cache is None:
            cache = _GLOBAL[(key, file)] = GlobalSuffixCache(params, file, n_vocab)
        return cache


class SuffixDrafter(ModelFreeDrafter):
    """Per-request trie + an optional shared :class:`GlobalSuffixCache`.

    A context that is not the same request (:func:`~.base.same_request`) starts a new one;
    the finished one is added to the global cache (also on :meth:`end_request` and
    :meth:`close`).
    """

    def __init__(self, params: SuffixParams | None = None, global_cache: GlobalSuffixCache | None = None) -> None:
        self.params = params or (global_cache.params if global_cache else SuffixParams())
        self.global_cache = global_cache
        self.name = "suffix"
        self._primer: list[int] = []
        self._primed: SuffixTrie | None = None
        """The request's primer (:meth:`prime`), in a trie of its own: never part of the
        request's trie, which another client's request may go on with (:meth:`_diverged`)."""
        self._reset()

    def _reset(self) -> None:
        self.trie = SuffixTrie(self.params.depth)
        self._seq: list[int] = []
        self._active = [self.trie.root]

    def prime(self, tokens: Sequence[int]) -> None:
        """Held until the next request starts, then drafted from beside its trie (never
        part of the shared cache: it is this request's client's own text)."""
        self._primer = list(tokens)

    def end_request(self) -> None:
        if self.global_cache is not None and self._seq:
            self.global_cache.add(self._seq)
        self._reset()

    def _sync(self, context: Sequence[int]) -> None:
        n = len(self._seq)
        if len(context) < n or list(context[:n]) != self._seq:
            self._diverged(context)
            n = len(self._seq)
        for t in context[n:]:
            self._active = self.trie.append(self._active, t)
        self._seq.extend(context[n:])

    def _diverged(self, context: Sequence[int]) -> None:
        """The context no longer extends the indexed sequence: a request starts. The same
        request with its end changed (:func:`~.base.same_request`) un-indexes that end and
        goes on; a new one ends the last. Either way the last request's primer goes, and a
        pending one becomes this request's."""
        keep = same_request(self._seq, context)
        if keep is None:
            self.end_request()
        else:
            self._active = self.trie.remove_tail(self._seq, keep)
            del self._seq[keep:]
        self._primed = None
        if self._primer:
            self._primed = SuffixTrie(self.params.depth)
            self._primed.add(self._primer)
            self._primer = []

    def _elsewhere(self, trie: SuffixTrie, context: Sequence[int],
                   max_tokens: int) -> tuple[tuple[list[int], list[float], float], int]:
        """The draft ``trie`` gives after the longest suffix of ``context`` it continues,
        and that suffix's length."""
        node, j = trie.longest_match(context, self.params.max_match)
        return (speculate(node, j, max_tokens, self.params) if node is not None else ([], [], 0.0)), j

    def propose(self, context: Sequence[int], max_tokens: int, sampler: Sampler) -> Draft:
        if max_tokens <= 0:
            return Draft([], None, self.name)
        self._sync(context)
        best: tuple[list[int], list[float], float] = ([], [], 0.0)
        matched = 0
        # Local: the active nodes are the context's own suffixes; the longest one that
        # occurred earlier with a continuation is the match.
        limit = min(self.params.max_match, len(self._active) - 1)
        for j in range(limit, 0, -1):
            node = self._active[j]
            if node.has_children():
                best, matched = speculate(node, j, max_tokens, self.params), j
                break
        # Elsewhere (the primer, the shared cache): the longest context suffix they continue.
        others = []
        if self._primed is not None:
            others.append(self._elsewhere(self._primed, context, max_tokens))
        if self.global_cache is not None:
            with self.global_cache.lock:
                others.append(self._elsewhere(self.global_cache.trie, context, max_tokens))
        for cand, j in others:
            if cand[2] > best[2]:
                best, matched = cand, j
        tokens, probs, _ = best
        # A continuation seen once after a 1-token match is a guess; after 12 matching
        # tokens it is near certain: the frequency alone cannot tell them apart.
        sure = match_certainty(matched)
        return Draft(tokens, None, self.name, [p * sure for p in probs] or None)

    def close(self) -> None:
        self.end_request()
        if self.global_cache is not None:
            self.global_cache.save()

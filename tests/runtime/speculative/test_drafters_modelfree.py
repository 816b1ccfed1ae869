"""Prompt lookup, the suffix-tree drafter and the chain, on hand-made token sequences.

Expected proposals are derived by brute force over the sequence (a reference matcher
written independently of the incremental index/trie), not hard-coded.
"""

from __future__ import annotations

import numpy as np
import pytest

from tandem.kernels.sampling import Sampler
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.speculative.drafters.base import Draft
from tandem.runtime.speculative.drafters.chain import ChainDrafter
from tandem.runtime.speculative.drafters.lookup import PromptLookupDrafter
from tandem.runtime.speculative.drafters.suffix import (
    GlobalSuffixCache,
    SuffixDrafter,
    SuffixParams,
    SuffixTrie,
    match_certainty,
)

GREEDY = Sampler(SamplingParams.greedy_params())


def reference_lookup(seq: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Brute force: longest final n-gram with an earlier occurrence; most recent one."""
    for n in range(min(max_n, len(seq) - 1), min_n - 1, -1):
        tail = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_brute_force_incrementally(seed: int) -> None:
    rng = np.random.default_rng(seed)
    seq = [int(t) for t in rng.integers(0, 5, 60)]
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    for end in range(2, len(seq)):  # grows one token at a time, like commits
        assert drafter.propose(seq[:end], 4, GREEDY).tokens == reference_lookup(seq[:end], 4, 3, 1)


@pytest.mark.parametrize("seed", range(8))
def test_lookup_cut_back_to_a_shared_start_is_a_fresh_index(seed: int) -> None:
    """A context that changes the end of the last one (the same chat, its next turn)
    re-indexes only that end, and the index is the one a fresh drafter builds for it:
    every n-gram points where it would, so the drafts are the same."""
    rng = np.random.default_rng(seed)
    seq = [int(t) for t in rng.integers(0, 4, 80)]
    drafter = PromptLookupDrafter(max_ngram=4, min_ngram=int(rng.integers(1, 3)))
    drafter.propose(seq, 4, GREEDY)
    for _ in range(4):
        keep = int(rng.integers(len(seq) // 2, len(seq) + 1))
        seq = seq[:keep] + [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 30)))]
        draft = drafter.propose(seq, 4, GREEDY)
        fresh = PromptLookupDrafter(max_ngram=4, min_ngram=drafter.min_ngram)
        assert draft.tokens == fresh.propose(seq, 4, GREEDY).tokens == reference_lookup(seq, 4, 4, drafter.min_ngram)
        assert drafter._index == fresh._index
    drafter.propose([9, 9, 9], 4, GREEDY)  # a new request: a new index
    fresh = PromptLookupDrafter(max_ngram=4, min_ngram=drafter.min_ngram)
    fresh.propose([9, 9, 9], 4, GREEDY)
    assert drafter._index == fresh._index


def test_lookup_resets_on_new_conversation() -> None:
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=2)
    assert drafter.propose([1, 2, 3, 1, 2], 3, GREEDY).tokens == [3, 1, 2]
    assert drafter.propose([7, 8, 9, 7], 3, GREEDY).tokens == []  # 2-gram (9, 7) unseen
    assert drafter.propose([7, 8, 9, 7, 8], 2, GREEDY).tokens == [9, 7]


def substring_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] = counts.get(tuple(s[i:j]), 0) + 1
    return counts


def trie_counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, child in node.items():
            out[path + (t,)] = child.count
            stack.append((path + (t,), child))
    return out


def test_trie_counts_every_substring_and_evicts_exactly() -> None:
    rng = np.random.default_rng(1)
    seqs = [[int(t) for t in rng.integers(0, 4, n)] for n in (30, 17, 25)]
    trie = SuffixTrie(depth=5)
    for s in seqs:
        trie.add(s)
    assert trie_counts(trie) == substring_counts(seqs, 5)
    trie.add(seqs[0], delta=-1)
    assert trie_counts(trie) == substring_counts(seqs[1:], 5)


def trie_shape(trie: SuffixTrie) -> dict[tuple[int, ...], tuple[int, tuple[int, ...]]]:
    """Every node's count and its children in order (the order ties are broken in)."""
    out: dict[tuple[int, ...], tuple[int, tuple[int, ...]]] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        children = node.items()
        out[path] = (node.count, tuple(t for t, _ in children))
        stack.extend((path + (t,), child) for t, child in children)
    return out


@pytest.mark.parametrize("seed", range(8))
def test_removing_a_tail_leaves_the_trie_of_what_was_kept(seed: int) -> None:
    """Un-indexing ``seq[keep:]`` gives the trie ``seq[:keep]`` would have built, node for
    node and child order too, and appending after it goes on as from a fresh index: on
    small alphabets, where substrings repeat and overlap the cut."""
    rng = np.random.default_rng(seed)
    depth = int(rng.integers(2, 7))
    other = [int(t) for t in rng.integers(0, 3, 20)]
    seq = [int(t) for t in rng.integers(0, 3, 40)]
    keep = int(rng.integers(0, len(seq) + 1))
    more = [int(t) for t in rng.integers(0, 3, 10)]
    trie = SuffixTrie(depth)
    trie.add(other)
    trie.add(seq)
    active = trie.remove_tail(seq, keep)
    for t in more:
        active = trie.append(active, t)
    fresh = SuffixTrie(depth)
    fresh.add(other)
    fresh.add(seq[:keep] + more)
    assert trie_shape(trie) == trie_shape(fresh)
    assert trie_counts(trie) == substring_counts([other, seq[:keep] + more], depth)
    assert [id(n) for n in trie.suffix_nodes(seq[:keep] + more)] == [id(n) for n in active]


def test_a_chat_s_next_turn_re_indexes_only_what_changed() -> None:
    """A context that changes the end of the last one (a chat's next turn) keeps the
    request: the trie is the one a fresh drafter builds for it, nothing goes to the shared
    cache, and so does a pre-draft the target rejected; a context sharing less than half
    starts a new request, and the old one is stored."""
    rng = np.random.default_rng(3)
    cache = GlobalSuffixCache()
    drafter = SuffixDrafter(global_cache=cache)
    chat = [int(t) for t in rng.integers(0, 6, 300)]
    drafter.propose(chat, 8, GREEDY)
    for turn in range(4):  # the reply's last tokens re-rendered, then the user's next turn
        if turn == 2:  # or: drafted on from a guess the target did not keep
            drafter.propose([*chat, 1, 2, 3], 8, GREEDY)
            chat = [*chat, 4]
        else:
            chat = chat[:-2] + [int(t) for t in rng.integers(0, 6, 40)]
        draft = drafter.propose(chat, 8, GREEDY)
        fresh = SuffixDrafter()
        assert draft.tokens == fresh.propose(chat, 8, GREEDY).tokens
        assert trie_shape(drafter.trie) == trie_shape(fresh.trie)
    assert len(cache) == 0
    drafter.propose([99, 98, *chat[:100]], 8, GREEDY)  # another chat: the first one is stored
    assert len(cache) == 1 and cache._seqs[0] == chat[-cache.params.max_request_tokens:]


def test_a_never_repeating_context_costs_a_quarter_of_the_old_trie() -> None:
    """Each new context token adds ``depth`` nodes with one child each: held in slots,
    not a dict, they took 1.6 kB a token under tracemalloc (6.4 kB with a dict per
    node, which made a 32k-token prompt's trie ~200 MB)."""
    import random
    import tracemalloc

    tokens = random.Random(0).sample(range(1 << 20), 2000)
    tracemalloc.start()
    try:
        trie = SuffixTrie(depth=24)
        trie.add(tokens)
        per_token = tracemalloc.get_traced_memory()[0] / len(tokens)
    finally:
        tracemalloc.stop()
    assert per_token < 2500
    assert trie_counts(trie) == substring_counts([tokens], 24)
    node = trie.walk(tokens[:5])
    assert node is not None and node.count == 1 and node.items() == [(tokens[5], trie.walk(tokens[:6]))]


def test_ties_go_to_the_oldest_continuation_as_children_come_and_go() -> None:
    """The most frequent continuation wins, a tie the one seen first; a continuation
    evicted and seen again counts as new (a dict's order, which drafts always followed)."""
    trie = SuffixTrie(depth=3)
    trie.add([1, 7])
    trie.add([1, 8])  # a second child: 7 first
    assert [t for t, _ in trie.root.child(1).items()] == [7, 8]
    trie.add([1, 7], delta=-1)
    trie.add([1, 7])  # back, after 8
    assert [t for t, _ in trie.root.child(1).items()] == [8, 7]
    one = SuffixTrie(depth=3)
    one.add([2, 5])
    one.add([2, 5], delta=-1)
    assert not one.root.has_children() and one.root.child(2) is None
    one.add([2, 6])
    assert [t for t, _ in one.root.child(2).items()] == [6]


def test_suffix_proposes_most_frequent_continuation() -> None:
    # "1 2 3 4" seen twice, "1 2 3 9" once: after "... 1 2 3" the drafter proposes 4.
    context = [1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 1, 2, 3, 9, 6, 1, 2, 3]
    draft = SuffixDrafter(SuffixParams(min_token_prob=0.1)).propose(context, 4, GREEDY)
    assert draft.tokens[0] == 4
    # frequency 2/3, scaled by how much a 3-token match is worth (1 - 0.5^3)
    assert draft.confidence is not None and draft.confidence[0] == pytest.approx(2 / 3 * match_certainty(3))
    assert match_certainty(1) == 0.5 and match_certainty(12) > 0.99


def test_suffix_respects_spec_factor_and_min_prob() -> None:
    context = [5, 6, 7, 8, 9, 10, 11, 12, 5]  # match length 1
    assert SuffixDrafter(SuffixParams(max_spec_factor=1.0)).propose(context, 8, GREEDY).tokens == [6]
    assert SuffixDrafter(SuffixParams(max_spec_factor=4.0)).propose(context, 8, GREEDY).tokens == [6, 7, 8, 9]
    branching = [1, 2, 1, 3, 1, 4, 1, 5, 1]  # after 1: 2, 3, 4, 5 each with p = 1/4
    assert SuffixDrafter(SuffixParams(min_token_prob=0.3)).propose(branching, 4, GREEDY).tokens == []


def test_suffix_global_cache_across_requests() -> None:
    cache = GlobalSuffixCache(SuffixParams(max_cached_requests=2))
    first = SuffixDrafter(global_cache=cache)
    story = [10, 11, 12, 13, 14, 15, 16]
    first.propose(story, 4, GREEDY)
    first.close()  # the finished request goes to the global trie
    assert len(cache) == 1
    second = SuffixDrafter(global_cache=cache)
    assert second.propose([3, 10, 11, 12], 3, GREEDY).tokens == [13, 14, 15]
    second.propose([20, 21], 2, GREEDY)
    second.propose([30, 31], 2, GREEDY)  # a new request: the previous one is stored
    second.propose([40, 41], 2, GREEDY)
    assert len(cache) == 2  # FIFO: the first story was evicted
    assert SuffixDrafter(global_cache=cache).propose([3, 10, 11, 12], 3, GREEDY).tokens == []


class Recorder:
    def __init__(self, name: str, tokens: list[int]) -> None:
        self.name, self.tokens, self.commits = name, tokens, 0

    def propose(self, context, max_tokens, sampler) -> Draft:
        return Draft(self.tokens[:max_tokens], None, self.name)

    def commit(self, context, n_accepted) -> None:
        self.commits += 1

    def backlog(self, context) -> int:
        return 0

    def close(self) -> None:
        pass


def test_chain_first_nonempty_wins_and_all_see_commits() -> None:
    empty, a, b = Recorder("empty", []), Recorder("a", [1, 2]), Recorder("b", [3])
    chain = ChainDrafter([empty, a, b])
    assert chain.propose([0], 5, GREEDY).source == "a"
    chain.commit([0, 1], 1)
    assert (empty.commits, a.commits, b.commits) == (1, 1, 1)
    assert ChainDrafter([empty, b]).propose([0], 5, GREEDY).tokens == [3]


def test_a_primed_suffix_drafter_offers_the_previous_suggestion_once() -> None:
    """An editor asks again with part of the last suggestion accepted: primed with the
    previous request's tail, the next request drafts the rest of that suggestion; the
    primer is used by one request only and can be withdrawn."""
    greedy = Sampler(SamplingParams.greedy_params())
    previous = [1, 2, 3, 9, 40, 41, 42, 43, 44, 45]  # ... suffix, <mid>, then the suggestion 40..45
    drafter = SuffixDrafter()
    drafter.propose([7, 7, 1, 2, 3, 9, 40], 8, greedy)  # the previous request (its trie)
    drafter.prime(previous)
    context = [7, 7, 8, 1, 2, 3, 9, 40, 41]  # new prompt (the prefix grew), then the first tokens again
    assert drafter.propose(context, 8, greedy).tokens == [42, 43, 44, 45]
    alone = SuffixTrie(drafter.params.depth)  # the primer is beside the request's own trie, not in it
    alone.add(context)
    assert trie_shape(drafter.trie) == trie_shape(alone)
    drafter.propose([*context, 42, 43], 8, greedy)  # the primed request goes on
    # Another client sends the same prompt: the same start, but the primer was not its own.
    assert drafter.propose(context, 8, greedy).tokens == []
    drafter.propose([5, 5, 5, 9, 40, 41], 8, greedy)  # a request after that: no primer left
    assert drafter.propose([6, 6, 9, 40, 41], 8, greedy).tokens == []
    chain = ChainDrafter([SuffixDrafter(), PromptLookupDrafter()])
    chain.prime(previous)
    chain.prime([])  # withdrawn (the server does so after every request)
    assert chain.propose(context, 8, greedy).tokens == []

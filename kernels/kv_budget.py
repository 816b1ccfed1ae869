"""Which KV entries to keep: attention sinks + recent window, and CAKE layer budgets.

Pure functions on attention statistics; the cache classes in
``tandem.runtime.kv.compress`` call them.

* StreamingLLM keeps the first ``sinks`` tokens (they soak up attention mass) and the
  most recent ``window`` tokens.
* CAKE (Qin et al., ICLR 2025) splits one total budget over layers by how *spread out*
  (entropy) and how *shifting* (variance across recent queries) each layer's attention
  is, then inside a layer keeps the tokens with the highest mean-plus-variance attention
  over an observation window of recent queries, always keeping that window itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sinks_window_keep(n: int, sinks: int, window: int) -> torch.Tensor:
    """Indices (ascending) of the tokens StreamingLLM keeps out of ``n`` cached tokens."""
    if n <= sinks + window:
        return torch.arange(n)
    return torch.cat((torch.arange(sinks), torch.arange(n - window, n)))


def _mean_var(a: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population variance along ``dim`` (``Tensor.var`` is several times slower on CPU here)."""
    mean = a.mean(dim=dim, keepdim=True)
    return mean.squeeze(dim), (a - mean).square().mean(dim=dim)


def layer_preference(attn: torch.Tensor, tau1: float = 1.0, tau2: float = 1.0) -> float:
    """CAKE preference ``H^(1/tau1) * V^(1/tau2)`` of one layer.

    ``attn`` is (heads, w, n): softmax rows of the last ``w`` queries over ``n`` keys.
    ``H`` is the entropy of the window-averaged attention (spatial dispersion) and ``V``
    the variance over the window's queries, averaged over keys (temporal shift); both are
    averaged over heads.
    """
    mean, var = _mean_var(attn.float(), 1)  # (heads, n) each
    entropy = -(mean.clamp_min(1e-12).log() * mean).sum(dim=-1).mean()
    variance = var.sum(dim=-1).mean()
    return float(entropy.clamp_min(0) ** (1.0 / tau1) * variance.clamp_min(1e-12) ** (1.0 / tau2))


def allocate_budgets(preferences: Sequence[float], total: int, lengths: Sequence[int], floor: int = 0) -> list[int]:
    """Split ``total`` cache slots over layers in proportion to ``preferences``.

    No layer gets more than its ``lengths`` entry (what it holds) or less than
    ``min(floor, length)``; whatever a clipped layer cannot use is handed to the others
    in proportion to their preference (CAKE's ``adjust_budgets``). The result sums to
    ``min(total, sum(lengths))`` exactly (largest-remainder rounding).
    """
    n = len(lengths)
    if len(preferences) != n:
        raise ValueError("one preference per layer")
    cap = [int(x) for x in lengths]
    target = min(int(total), sum(cap))
    budget = [min(floor, c) for c in cap]
    if sum(budget) > target:
        raise ValueError(f"floor {floor} x {n} layers exceeds the total budget {total}")
    open_ = [i for i in range(n) if budget[i] < cap[i]]
    while sum(budget) < target and open_:
        left = target - sum(budget)
        weights = [max(float(preferences[i]), 0.0) for i in open_]
        wsum = sum(weights)
        if wsum <= 0:
            weights, wsum = [1.0] * len(open_), float(len(open_))
        share = [left * w / wsum for w in weights]
        whole = [int(s) for s in share]
        order = sorted(range(len(open_)), key=lambda j: share[j] - whole[j], reverse=True)
        for j in order[: left - sum(whole)]:
            whole[j] += 1
        for j, i in enumerate(open_):
            budget[i] = min(cap[i], budget[i] + whole[j])
        open_ = [i for i in open_ if budget[i] < cap[i]]
    return budget


def eviction_scores(attn: torch.Tensor, gamma: float = 200.0) -> torch.Tensor:
    """CAKE per-key indicator: mean attention over the window plus ``gamma`` x its variance.

    ``attn`` is (heads, w, n); scores are averaged over heads, shape (n,). A token some
    recent query attends to strongly, or one whose attention fluctuates (it may matter
    again), scores high.
    """
    mean, var = _mean_var(attn.float(), 1)
    return (mean + gamma * var).mean(dim=0)


def select_keep(scores: torch.Tensor, budget: int, window: int, sinks: int = 0) -> torch.Tensor:
    """Ascending indices of the ``budget`` tokens to keep: sinks, the last ``window``, then top scores."""
    n = scores.shape[0]
    if budget >= n:
        return torch.arange(n)
    forced = torch.zeros(n, dtype=torch.bool)
    forced[: min(sinks, n)] = True
    forced[max(0, n - window) :] = True
    n_forced = int(forced.sum())
    if n_forced >= budget:
        # Budget smaller than sinks + window: keep sinks, then the most recent tokens.
        return sinks_window_keep(n, min(sinks, budget), budget - min(sinks, budget))
    free = scores.float().masked_fill(forced, float("-inf"))
    top = torch.topk(free, budget - n_forced).indices
    forced[top] = True
    return torch.nonzero(forced).squeeze(-1)


def fold_moments(
    m1: torch.Tensor | None, m2: torch.Tensor | None, seen: int, rows: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Fold attention rows into CAKE's running statistics, in O(heads x keys) memory.

    CAKE scores keys by the mean and variance of their attention over the last ``window``
    queries. Holding those rows costs ``heads x window x keys`` floats per layer, more
    than the KV entries they help evict; a running mean ``m1`` (heads, n) and a running
    head-averaged second moment ``m2`` (n,) give the same two statistics (exactly the
    window mean until ``window`` rows were seen, then an exponential average with weight
    ``1/window``). ``rows`` is (heads, T, n); ``m1``/``m2`` may cover fewer keys (new keys
    start at zero, as the zero attention earlier queries gave them). Returns the new
    ``(m1, m2, seen)``.
    """
    h, t, n = rows.shape
    m1 = torch.zeros(h, n, device=rows.device) if m1 is None else torch.nn.functional.pad(m1.float(), (0, n - m1.shape[-1]))
    m2 = torch.zeros(n, device=rows.device) if m2 is None else torch.nn.functional.pad(m2.float(), (0, n - m2.shape[-1]))
    rows = rows.float()
    sq = rows.square().mean(dim=0)  # (T, n)
    for i in range(t):
        seen += 1
        a = 1.0 / min(seen, window)
        m1 = m1 + a * (rows[:, i] - m1)
        m2 = m2 + a * (sq[i] - m2)
    return m1, m2, seen


def preference_from_moments(m1: torch.Tensor, m2: torch.Tensor, tau1: float = 1.0, tau2: float = 1.0) -> float:
    """:func:`layer_preference` from :func:`fold_moments` statistics (same formula, running moments)."""
    m1, m2 = m1.float(), m2.float()
    entropy = -(m1.clamp_min(1e-12).log() * m1).sum(dim=-1).mean()
    variance = (m2 - m1.square().mean(dim=0)).sum()
    return float(entropy.clamp_min(0) ** (1.0 / tau1) * variance.clamp_min(1e-12) ** (1.0 / tau2))


def scores_from_moments(m1: torch.Tensor, m2: torch.Tensor, gamma: float = 200.0) -> torch.Tensor:
    """:func:`eviction_scores` from running moments: head-mean of (mean + gamma x variance), shape (n,)."""
    m1, m2 = m1.float(), m2.float()
    return m1.mean(dim=0) + gamma * (m2 - m1.square().mean(dim=0))

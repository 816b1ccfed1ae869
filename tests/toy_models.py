"""Toy Markov-chain models implementing the Backend protocol, with exact probabilities.

``ToyBackend(table)``: the next-token distribution depends only on the last token,
``table[last]`` (rows sum to 1; zeros allowed). Logits are ``log(table[last])`` in
float64 -> float32, so ``Sampler`` at temperature 1 with every filter off reproduces
the table (up to float32 rounding, which the exact joint below accounts for by using
the same softmax). Deterministic, numpy only, fast enough for statistical tests.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from tandem.kernels.sampling import softmax
from tandem.kernels.sampling_params import SamplingParams
from tandem.runtime.backends.protocol import ComputeSettings, MemoryReport, SpecialTokens

PURE = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
"""Sampling settings under which the sampler's distribution is the model's softmax."""


def random_table(n: int, rng: np.random.Generator, *, zeros: float = 0.0, concentration: float = 1.0) -> np.ndarray:
    """Random row-stochastic ``n x n`` table; ``zeros`` = fraction of entries forced to 0."""
    t = rng.dirichlet(np.full(n, concentration), size=n)
    if zeros:
        mask = rng.random((n, n)) < zeros
        mask[np.arange(n), rng.integers(0, n, n)] = False  # keep every row non-empty
        t = np.where(mask, 0.0, t)
        t /= t.sum(axis=1, keepdims=True)
    return t


class ToyBackend:
    """A first-order Markov model with its own token cache (the 'KV cache')."""

    def __init__(self, table: np.ndarray, name: str = "toy", n_ctx: int = 4096) -> None:
        self.table = np.asarray(table, dtype=np.float64)
        with np.errstate(divide="ignore"):
            self.logits_table = np.log(self.table).astype(np.float32)
        self.name = name
        self._n_ctx = n_ctx
        self._tokens: list[int] = []
        self.calls = 0
        self.evaluated = 0

    @property
    def n_vocab(self) -> int:
        return self.table.shape[0]

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def special(self) -> SpecialTokens:
        return SpecialTokens(bos=None, eos=None)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        return [int(c) % self.n_vocab for c in text.split()]

    def token_bytes(self, token: int) -> bytes:
        return f"{token} ".encode()

    def chat_template(self) -> str | None:
        return None

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("evaluate needs at least one token")
        if len(self._tokens) + len(tokens) > self._n_ctx:
            raise ValueError("context full")
        wanted = [len(tokens) - 1] if logits_for is None else list(logits_for)
        self._tokens.extend(tokens)
        self.calls += 1
        self.evaluated += len(tokens)
        return self.logits_table[[tokens[i] for i in wanted]]

    def truncate(self, n: int) -> None:
        del self._tokens[max(0, n) :]

    exact_batch: int | None = None
    """Tests set it to check that verification respects a backend's bound."""

    def memory(self) -> MemoryReport:
        return MemoryReport(weights=self.table.nbytes, kv_cache=0)

    def compute_settings(self) -> ComputeSettings:
        """An in-memory model: no file to keep its timings under."""
        return ComputeSettings(None, f"toy {self.name}")

    def set_threads(self, n: int) -> bool:
        return False

    def close(self) -> None:
        self._tokens = []


def model_distribution(backend: ToyBackend) -> np.ndarray:
    """The exact rows the sampler uses (softmax of the float32 logits), float64."""
    return softmax(backend.logits_table.astype(np.float64))


def exact_joint(table: np.ndarray, first: int, length: int) -> dict[tuple[int, ...], float]:
    """P(x_1..x_length | previous token ``first``) under a Markov table."""
    n = table.shape[0]
    out: dict[tuple[int, ...], float] = {}
    for seq in itertools.product(range(n), repeat=length):
        prob, prev = 1.0, first
        for t in seq:
            prob *= table[prev, t]
            prev = t
        if prob > 0:
            out[seq] = prob
    return out


def chi2_pvalue(stat: float, df: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty; accurate to ~1e-3 for df >= 3)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def check_matches(counts: np.ndarray, probs: np.ndarray, tv_bound: float) -> None:
    """Empirical counts follow ``probs``: no mass where p = 0, a TV bound, chi-square."""
    n = counts.sum()
    probs = probs / probs.sum()
    assert np.all(counts[probs == 0] == 0), "a token with p = 0 was emitted"
    tv = 0.5 * np.abs(counts / n - probs).sum()
    assert tv < tv_bound, f"TV {tv:.4g} >= {tv_bound}"
    support = probs > 0
    expected = n * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df >= 1:
        assert chi2_pvalue(stat, df) > 1e-4, f"chi-square {stat:.1f} on {df} dof"


def sequence_counts(strategy, target, sampler, prompt: list[int], length: int, trials: int) -> dict[tuple[int, ...], int]:
    """How often a strategy produced each first-``length``-token continuation of ``prompt``."""
    from tandem.runtime.generate import DecodeStats

    counts: dict[tuple[int, ...], int] = {}
    for _ in range(trials):
        out: list[int] = []
        run = strategy(target, list(prompt), sampler, DecodeStats())
        for commit in run:
            out += commit.tokens
            if len(out) >= length:
                break
        run.close()
        key = tuple(out[:length])
        counts[key] = counts.get(key, 0) + 1
    return counts

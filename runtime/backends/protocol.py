"""The one protocol every model backend implements.

A backend owns one model and one KV cache for a single sequence. Every generation
strategy (plain, speculative, superposed) is written once against this protocol, so a
GGUF target through llama.cpp, a torch model and an ONNX session are interchangeable as
target or drafter.

The KV cache holds exactly the tokens in ``tokens``: ``evaluate`` appends, ``truncate``
rolls back. Strategies never assume anything else about the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from tandem.errors import PromptError


@dataclass(frozen=True)
class MemoryReport:
    """Bytes a backend holds, by what they are for (host and device together)."""

    weights: int
    kv_cache: int
    scratch: int = 0
    device: str = "cpu"

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.scratch


@dataclass(frozen=True)
class SpecialTokens:
    bos: int | None
    eos: int | None
    eog: frozenset[int] = field(default_factory=frozenset)
    """End-of-generation tokens (EOS, EOT, ...): generation stops on any of them."""
    fim_prefix: int | None = None
    fim_suffix: int | None = None
    fim_middle: int | None = None
    bos_text: str = ""
    """Literal text of the BOS token (``<s>``), which chat templates write into prompts."""
    eos_text: str = ""


@dataclass(frozen=True)
class ComputeSettings:
    """What decides how fast a backend computes, so that timings taken on it can be kept
    for the next run with the same model (the cost cache) and timed with the right clock."""

    model_file: Path | None
    """The model's file; ``None`` for a model that lives only in memory (nothing to key
    a cache on)."""
    settings: str
    """The settings that change its speed, as text (context size left out: it hardly does)."""
    threads: int | None = None
    """Compute threads on this machine; ``None`` where a library picks them or a GPU computes."""
    remote: bool = False
    """Part of the model computes on other machines (llama.cpp RPC)."""


@runtime_checkable
class Backend(Protocol):
    """A model plus its single-sequence KV cache."""

    name: str
    """A short human name (file stem), used in stats and the UI."""

    @property
    def n_vocab(self) -> int: ...

    @property
    def n_ctx(self) -> int:
        """Maximum tokens the KV cache can hold."""
        ...

    @property
    def special(self) -> SpecialTokens: ...

    @property
    def tokens(self) -> list[int]:
        """Tokens currently in the KV cache (a copy or a read-only view)."""
        ...

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Text to ids. ``special`` parses control-token text such as ``<|eot|>``."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token contributes to the output (may be part of a UTF-8 char).

        Control tokens contribute nothing. Concatenating the bytes of a sequence and
        decoding gives the detokenized text of that sequence as a continuation.
        """
        ...

    def chat_template(self) -> str | None:
        """The Jinja chat template stored with the model, if any."""
        ...

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        """Append ``tokens`` to the cache and return float32 logits.

        ``logits_for`` are indices into ``tokens`` whose next-token logits are wanted;
        ``None`` means only the last one. Returns an array of shape
        ``(len(logits_for), n_vocab)``. Computing only the rows asked for is what makes
        plain decoding cheap and verification exact.
        """
        ...

    def truncate(self, n: int) -> None:
        """Roll the KV cache back so it holds only its first ``n`` tokens."""
        ...

    def keep_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Keep only the cached positions in ``spans`` (sorted, disjoint ``(start, end)``
        pairs), packed down in order, so the cache then holds those tokens one after the
        other; ``False`` (cache unchanged) where entries cannot be moved.

        This is llama-server's ``--cache-reuse``: an editor's prompt often keeps long
        stretches of the previous one at other offsets. Moved keys are re-rotated to their
        new positions, which is close to, not bit-identical with, evaluating them afresh."""
        ...

    @property
    def exact_batch(self) -> int | None:
        """Longest batch whose logits are bit-identical to one-token steps over the same
        tokens (``None``: any length). Speculative verification never sends more at once,
        so greedy speculative output equals plain greedy output token for token."""
        ...

    def memory(self) -> MemoryReport: ...

    def compute_settings(self) -> ComputeSettings:
        """The file and settings its timings depend on (see :class:`ComputeSettings`)."""
        ...

    def set_threads(self, n: int) -> bool:
        """Use ``n`` compute threads from the next call on, without reloading; ``False``
        (nothing changed) where the backend cannot (the placement calibration then keeps
        the count it was opened with)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class EmbeddingInput(Protocol):
    """A backend that also takes input embeddings instead of token ids (llama.cpp, torch):
    what superposed decoding needs, which feeds a mix of token embeddings per step."""

    @property
    def n_embd(self) -> int: ...

    def token_embeddings(self) -> np.ndarray:
        """The input token-embedding matrix (n_vocab, n_embd) as float32."""
        ...

    def evaluate_embeddings(self, embeds: np.ndarray, logits_for: Sequence[int] | None = None) -> np.ndarray:
        """Like :meth:`Backend.evaluate`, one embedding row (n, n_embd) per position; the
        positions are recorded in ``tokens`` as ``-1`` (no id describes a mixed input)."""
        ...


@runtime_checkable
class RowSource(Protocol):
    """A backend that reads single rows of its input-embedding matrix on demand (GGUF
    through llama.cpp), so superposed decoding need not load the whole table."""

    def token_embedding_rows(self, ids: Sequence[int]) -> np.ndarray: ...


def speed_settings(config: object, threads: int | None) -> str:
    """A backend's frozen config dataclass as the text :class:`ComputeSettings` keeps: its
    context size left out, the threads it computes with now put in."""
    return f"{replace(config, n_ctx=None)!r}|threads={threads}"  # type: ignore[type-var]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def reused(backend: Backend, tokens: Sequence[int]) -> int:
    """Tokens of ``tokens`` that :func:`prefill` keeps from the cache: the cached prefix,
    less the last token, which it always evaluates again for its logits."""
    return min(common_prefix_len(backend.tokens, tokens), max(0, len(tokens) - 1))


def unseen(backend: Backend, tokens: Sequence[int]) -> int:
    """Tokens of ``tokens`` that :func:`prefill` would evaluate before the last one: those
    past the cached prefix it keeps. For a drafter, what it must catch up on before it
    drafts (the last token it evaluates in every round anyway)."""
    return max(0, len(tokens) - 1 - reused(backend, tokens))


def prefill(backend: Backend, prompt: Sequence[int], *, keep_last: bool = True) -> np.ndarray | None:
    """Bring the cache to ``prompt`` reusing the longest cached prefix.

    Returns the logits after the last prompt token. At least the last prompt token is
    always re-evaluated so its logits exist (``keep_last``), which is how a chat turn
    reuses the previous turns' KV instead of recomputing them.

    The last token is evaluated on its own, after the rest as one batch: every strategy
    splits a prompt the same way (speculative decoding sends the last prompt token with
    its first verify batch), because llama.cpp computes a position in a long batch
    slightly differently from one in a short batch, and greedy identity between plain
    and speculative decoding needs identical KV for the prompt.
    """
    if not prompt:
        raise ValueError("prefill needs at least one token")
    reuse = reused(backend, prompt) if keep_last else common_prefix_len(backend.tokens, prompt)
    backend.truncate(reuse)
    if reuse >= len(prompt):
        return None
    if len(prompt) - 1 > reuse:
        backend.evaluate(prompt[reuse:-1])
    return backend.evaluate(prompt[-1:])[-1]


def check_room(cached: int, n: int, n_ctx: int) -> None:
    """Raise :class:`~tandem.errors.PromptError` when ``n`` new positions do not fit
    after ``cached`` ones in a context of ``n_ctx``."""
    if cached + n > n_ctx:
        raise PromptError(f"Context full: {cached} + {n} tokens exceed the context of {n_ctx}.")


def chunk_bounds(n: int, step: int, min_last: int = 1, align: int = 1) -> list[tuple[int, int]]:
    """``(start, stop)`` of ``n`` positions in chunks of ``step``. A last chunk shorter than
    ``min_last`` takes rows from the one before it, a multiple of ``align`` of them, or
    joins it when that would leave the one before shorter than ``min_last``."""
    bounds = [(start, min(n, start + step)) for start in range(0, n, step)]
    short = min_last - (bounds[-1][1] - bounds[-1][0]) if bounds else 0
    if len(bounds) > 1 and short > 0:
        (start, cut), _ = bounds[-2:]
        cut -= -(-short // align) * align
        bounds[-2:] = [(start, cut), (cut, n)] if cut - start >= min_last else [(start, n)]
    return bounds


def chunked_logits(n: int, step: int, n_vocab: int, logits_for: Sequence[int] | None,
                   run: Callable[[int, int, list[int]], Sequence[np.ndarray]], *, min_last: int = 1,
                   align: int = 1, fresh: bool = False) -> np.ndarray:
    """The chunking every backend's ``evaluate`` shares: ``n`` new positions go through
    ``run(start, stop, rows)`` in the chunks of :func:`chunk_bounds`, where ``run``
    evaluates positions ``start:stop`` and returns the logits of ``rows`` (chunk-relative,
    in that order). Returns the rows ``logits_for`` asks for (default: the last position),
    in its order, copied out before the next chunk runs (a backend may reuse its logits
    buffer). ``fresh``: ``run`` returns one array of its own (nothing reuses it), which a
    call of one chunk returns as it is, uncopied."""
    if logits_for is None and n <= step and not fresh:  # a decode step: one chunk, its last row
        out = np.empty((1, n_vocab), dtype=np.float32)
        out[0] = run(0, n, [n - 1])[0]
        return out
    wanted = [n - 1] if logits_for is None else list(logits_for)
    if any(not 0 <= i < n for i in wanted):
        raise ValueError(f"logits_for indices must lie in [0, {n})")
    if fresh and n <= step:
        return np.asarray(run(0, n, wanted))
    out = np.empty((len(wanted), n_vocab), dtype=np.float32)
    for start, stop in chunk_bounds(n, step, min_last, align):
        picks = [(r, i - start) for r, i in enumerate(wanted) if start <= i < stop]
        rows = run(start, stop, [i for _, i in picks])
        for (r, _), row in zip(picks, rows, strict=True):
            out[r] = row
    return out

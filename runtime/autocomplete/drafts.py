"""Autocomplete: k ranked drafts for the text around the cursor within a latency budget.

A prompt is fill-in-the-middle (prefix, suffix, then the model writes the middle) when
the model's GGUF names FIM tokens, and a plain continuation of the prefix otherwise.
Drafts come from one superposed decode (:mod:`tandem.runtime.autocomplete.superposed`), so k
suggestions cost about one generation. The prefix/suffix are clipped to their last /
first tokens (as llama.vscode does) so latency does not grow with the file.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tandem.kernels.superpose import SuperposeConfig
from tandem.models.ngram import NgramModel, find_for, tokenizer_fingerprint
from tandem.runtime.autocomplete.superposed import SuperposedDecoder
from tandem.runtime.backends.protocol import Backend


@dataclass(frozen=True)
class AutocompleteConfig:
    k: int = 3
    max_tokens: int = 24
    budget_ms: float = 400.0
    n_prefix_tokens: int = 256
    n_suffix_tokens: int = 64
    single_line: bool = False
    """Cut each draft at its first newline (editor ghost text of one line)."""
    superpose: SuperposeConfig = field(default_factory=SuperposeConfig)


@dataclass(frozen=True)
class Suggestion:
    text: str
    tokens: list[int]
    score: float


@dataclass
class SuggestResult:
    suggestions: list[Suggestion]
    fim: bool
    elapsed_ms: float
    stopped: str
    prompt_tokens: int


def supports_fim(target: Backend) -> bool:
    s = target.special
    return None not in (s.fim_prefix, s.fim_suffix, s.fim_middle)


def load_ngram_for(target: Backend, name: str | None = None) -> NgramModel | None:
    """The newest n-gram model built with this target's tokenizer, if the user built one."""
    fp = tokenizer_fingerprint(target.n_vocab, target.token_bytes)
    path = find_for(fp, name)
    return NgramModel.load(path) if path else None


def build_fim_prompt(target: Backend, prefix: str, suffix: str = "", *, n_prefix_tokens: int = 256,
                     n_suffix_tokens: int = 64, fim: bool | None = None) -> list[int]:
    """Token ids of the prompt: PSM-order FIM when the model has FIM tokens, else the prefix.

    The prefix keeps its last ``n_prefix_tokens`` and the suffix its first
    ``n_suffix_tokens``: what is nearest the cursor matters most.
    """
    fim = supports_fim(target) if fim is None else fim
    pre = target.tokenize(prefix, add_bos=False)[-n_prefix_tokens:] if prefix and n_prefix_tokens > 0 else []
    bos = target.tokenize("", add_bos=True)  # the BOS only where the tokenizer adds one (not Qwen's)
    if fim:
        s = target.special
        suf = target.tokenize(suffix, add_bos=False)[:n_suffix_tokens] if suffix else []
        return [*bos, s.fim_prefix, *pre, s.fim_suffix, *suf, s.fim_middle]  # type: ignore[list-item]
    return [*bos, *pre] if pre else []


class Autocompleter:
    """Suggests completions with one model; ``lock`` is shared with whoever else uses it."""

    def __init__(self, target: Backend, ngram: NgramModel | None = None,
                 config: AutocompleteConfig | None = None, lock: threading.Lock | None = None) -> None:
        self.target = target
        self.config = config or AutocompleteConfig()
        self.decoder = SuperposedDecoder(target, ngram, self.config.superpose)
        self.lock = lock or threading.Lock()
        self.fim = supports_fim(target)

    def build_prompt(self, prefix: str, suffix: str = "") -> list[int]:
        cfg = self.config
        return build_fim_prompt(self.target, prefix, suffix, n_prefix_tokens=cfg.n_prefix_tokens,
                                n_suffix_tokens=cfg.n_suffix_tokens, fim=self.fim)

    def suggest(self, prefix: str, suffix: str = "", k: int | None = None, budget_ms: float | None = None,
                *, max_tokens: int | None = None, cancel: threading.Event | None = None) -> SuggestResult:
        """Up to ``k`` distinct suggestions, best first; stops early at the budget or on cancel."""
        cfg = self.config
        k = k or cfg.k
        budget = cfg.budget_ms if budget_ms is None else budget_ms
        start = time.perf_counter()
        prompt = self.build_prompt(prefix, suffix)
        if not prompt:
            return SuggestResult([], self.fim, 0.0, "empty", 0)
        deadline = start + budget / 1000.0 if budget and budget > 0 else None
        # The model may be busy (a chat reply): wait at most the budget, then give up.
        if not self.lock.acquire(timeout=budget / 1000.0 if deadline else -1):
            return SuggestResult([], self.fim, (time.perf_counter() - start) * 1000, "busy", len(prompt))
        try:
            result = self.decoder.decode(prompt, k, max_tokens or cfg.max_tokens, deadline=deadline, cancel=cancel)
        finally:
            self.lock.release()
        seen: set[str] = set()
        out: list[Suggestion] = []
        for d in result.drafts:
            text = d.text.split("\n", 1)[0] if cfg.single_line else d.text
            if text and text not in seen:
                seen.add(text)
                out.append(Suggestion(text, d.tokens, d.score))
        return SuggestResult(out, self.fim, (time.perf_counter() - start) * 1000, result.stopped, len(prompt))

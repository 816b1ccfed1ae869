"""Fill-in-the-middle prompts in the model's own format, with other files as context.

Editors (llama.vim, llama.vscode) send the text before the cursor, the text after it,
the start of the cursor line (``prompt``) and chunks of other files (``input_extra``).
How the chunks must be written depends on what the model was trained on:

* **repo-level tokens** (Qwen2.5-Coder ``<|repo_name|>``/``<|file_sep|>``, StarCoder2
  ``<repo_name>``/``<file_sep>``): a repository header, one file-separator block per
  chunk (``filename`` line, then its text), then the current file's FIM block;
* **DeepSeek-Coder** (``<｜fim▁begin｜>``): no repository tokens; the chunks go before
  the FIM block as plain files, each after a ``# filename`` line, as in its
  repository-level pretraining;
* otherwise the chunks are **left out**: pasted into the prefix they read as part of
  the current file and the model continues *them*.

The token budget follows llama-server's ``format_infill``: the prefix keeps its last
3/4 of a batch, the suffix its first 1/4 (less the prompt), and the chunks get what the
context has left after a batch and room for the reply. Chunks are dropped whole, oldest
(first) first, so the start of the prompt stays the same from one request to the next
and its KV cache is reused (llama.vim's warm-up requests rely on that).

Everything here is pure (a tokenize function in, token ids out) and tested on the real
Qwen vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.runtime.backends.protocol import Backend

Tokenize = Callable[[str], list[int]]

REPO_NAME = "myproject"
"""Repository name in repo-level prompts (editors do not send one; llama-server's too)."""
CURRENT_FILE = "filename"
"""Name of the file being edited in repo-level prompts (editors do not send it)."""

STYLES = {
    # style: (repository-name token text, file-separator token text)
    "qwen": ("<|repo_name|>", "<|file_sep|>"),
    "starcoder": ("<repo_name>", "<file_sep>"),
}
DEEPSEEK_FIM_BEGIN = "<｜fim▁begin｜>"


@dataclass(frozen=True)
class FimFormat:
    """The FIM tokens of one model and how it takes other files."""

    prefix: int
    suffix: int
    middle: int
    style: str = "plain"
    """``qwen`` | ``starcoder`` (repo-level tokens), ``deepseek`` (files as text), ``plain`` (no extra context)."""
    repo: int | None = None
    sep: int | None = None
    bos: tuple[int, ...] = ()
    """What the model's tokenizer puts first (its BOS when it adds one, else nothing)."""

    @property
    def takes_extra(self) -> bool:
        return self.style != "plain"


@dataclass(frozen=True)
class ExtraChunk:
    """A piece of another file (llama.vim's ring buffer, llama.vscode's chunks)."""

    filename: str
    text: str


@dataclass(frozen=True)
class InfillText:
    prefix: str
    suffix: str
    prompt: str = ""
    """The cursor line up to the cursor; it follows the prefix."""
    extra: tuple[ExtraChunk, ...] = ()


@dataclass(frozen=True)
class FimBudget:
    n_ctx: int
    n_batch: int = 512
    n_predict: int = 128

    @property
    def prefix_tokens(self) -> int:
        return 3 * (self.n_batch // 4)

    def suffix_tokens(self, n_prompt: int) -> int:
        return max(0, self.n_batch // 4 - (2 + n_prompt))

    @property
    def extra_tokens(self) -> int:
        """Room for chunks. ``n_predict`` counts at least 128 so a warm-up request
        (``n_predict: 0``) keeps the same chunks as the requests it warms up for."""
        return max(0, self.n_ctx - self.n_batch - 2 * max(self.n_predict, 128))


@dataclass(frozen=True)
class FimPrompt:
    tokens: list[int]
    extra_chunks: int
    """Chunks kept."""
    extra_dropped: int
    """Chunks left out because the context could not hold them (``truncated``)."""
    extra_ignored: bool = False
    """The model has no way to take other files, so ``input_extra`` was not used."""

    @property
    def truncated(self) -> bool:
        return self.extra_dropped > 0


def _single_special(tokenize_special: Tokenize, tokenize_plain: Tokenize, text: str) -> int | None:
    """The id of ``text`` if the vocabulary has it as one control token, else None."""
    ids = tokenize_special(text)
    return ids[0] if len(ids) == 1 and tokenize_plain(text) != ids else None


def detect_format(target: Backend) -> FimFormat | None:
    """The model's FIM format, or None when its GGUF names no FIM tokens."""
    s = target.special
    if None in (s.fim_prefix, s.fim_suffix, s.fim_middle):
        return None

    def special(text: str) -> list[int]:
        return target.tokenize(text, special=True)

    def plain(text: str) -> list[int]:
        return target.tokenize(text, special=False)

    bos = tuple(target.tokenize("", add_bos=True))
    fim = dict(prefix=s.fim_prefix, suffix=s.fim_suffix, middle=s.fim_middle, bos=bos)
    for style, (repo_text, sep_text) in STYLES.items():
        repo, sep = _single_special(special, plain, repo_text), _single_special(special, plain, sep_text)
        if repo is not None and sep is not None:
            return FimFormat(**fim, style=style, repo=repo, sep=sep)  # type: ignore[arg-type]
    if _single_special(special, plain, DEEPSEEK_FIM_BEGIN) == s.fim_prefix:
        return FimFormat(**fim, style="deepseek")  # type: ignore[arg-type]
    return FimFormat(**fim)  # type: ignore[arg-type]


def _with_newline(text: str) -> str:
    return text if not text or text.endswith("\n") else text + "\n"


def _chunk_tokens(fmt: FimFormat, chunk: ExtraChunk, tokenize: Tokenize) -> list[int]:
    name = chunk.filename or "tmp"
    if fmt.style == "deepseek":
        return tokenize(f"# {name}\n" + _with_newline(chunk.text))
    assert fmt.sep is not None
    return [fmt.sep, *tokenize(name + "\n"), *tokenize(_with_newline(chunk.text))]


def _repo_header(fmt: FimFormat, tokenize: Tokenize) -> list[int]:
    if fmt.style == "qwen":
        return [fmt.repo, *tokenize(REPO_NAME + "\n")]  # type: ignore[list-item]
    if fmt.style == "starcoder":
        return [fmt.repo, *tokenize(REPO_NAME)]  # type: ignore[list-item]
    return []


def _current_file(fmt: FimFormat, tokenize: Tokenize) -> list[int]:
    if fmt.style == "qwen":
        return [fmt.sep, *tokenize(CURRENT_FILE + "\n")]  # type: ignore[list-item]
    if fmt.style == "starcoder":
        return [fmt.sep]  # type: ignore[list-item]
    return []


def fit_chunks(sizes: Sequence[int], budget: int) -> int:
    """How many of the *oldest* chunks to drop so the rest fit in ``budget`` tokens."""
    total, drop = sum(sizes), 0
    while drop < len(sizes) and total > budget:
        total -= sizes[drop]
        drop += 1
    return drop


def render_infill(fmt: FimFormat, text: InfillText, tokenize: Tokenize, budget: FimBudget) -> FimPrompt:
    """Token ids of a FIM prompt: [BOS] [repo header, chunks, current file] PRE prefix
    prompt SUF suffix MID (PSM order, as llama-server writes it)."""
    prompt = tokenize(text.prompt) if text.prompt else []
    prefix = tokenize(text.prefix)[-budget.prefix_tokens :] if text.prefix and budget.prefix_tokens else []
    n_suffix = budget.suffix_tokens(len(prompt))
    suffix = tokenize(text.suffix)[:n_suffix] if text.suffix and n_suffix else []
    context: list[int] = []
    kept = dropped = 0
    if fmt.takes_extra:
        chunks = [_chunk_tokens(fmt, c, tokenize) for c in text.extra]
        header, current = _repo_header(fmt, tokenize), _current_file(fmt, tokenize)
        dropped = fit_chunks([len(c) for c in chunks], budget.extra_tokens - len(header) - len(current))
        kept = len(chunks) - dropped
        context = header + [t for c in chunks[dropped:] for t in c] + current
    tokens = [*fmt.bos, *context, fmt.prefix, *prefix, *prompt, fmt.suffix, *suffix, fmt.middle]
    return FimPrompt(tokens, kept, dropped, extra_ignored=bool(text.extra) and not fmt.takes_extra)


def render_plain(bos: Sequence[int], text: InfillText, tokenize: Tokenize, budget: FimBudget) -> FimPrompt:
    """A model without FIM tokens continues the prefix (and prompt); the rest is left out."""
    body = tokenize(text.prefix + text.prompt)[-(budget.prefix_tokens + budget.n_batch // 4):] if (
        text.prefix or text.prompt) else []
    return FimPrompt([*bos, *body], 0, 0, extra_ignored=bool(text.extra))


def infill_prompt(target: Backend, text: InfillText, budget: FimBudget, fmt: FimFormat | None = None) -> FimPrompt:
    """The prompt for ``text`` on ``target`` (``fmt`` from :func:`detect_format`, computed if not given)."""
    fmt = fmt if fmt is not None else detect_format(target)

    def tokenize(s: str) -> list[int]:
        return target.tokenize(s, add_bos=False)

    if fmt is None:
        return render_plain(target.tokenize("", add_bos=True), text, tokenize, budget)
    return render_infill(fmt, text, tokenize, budget)

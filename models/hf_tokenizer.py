"""Hugging Face ``tokenizer.json`` -> GGUF vocabulary metadata, without ``transformers``.

Two families cover the Llama-style checkpoints people convert:

* **SentencePiece-style BPE** (Llama 1/2, Mistral, Phi-3, TinyStories): a BPE model with
  ``byte_fallback`` whose normalizer (or Metaspace pre-tokenizer) turns spaces into ``▁``.
  llama.cpp runs these with its ``llama`` (SPM) tokenizer, which merges the adjacent
  pair whose *merged token* has the highest score. Scoring a token by minus the rank of
  the merge that creates it therefore reproduces BPE's lowest-rank-first merge order.
  (llama.cpp's own converter gives every token -1000 here, which makes the SPM tokenizer
  merge left-to-right instead of by rank.)
* **Byte-level BPE** (GPT-2, Llama 3, Qwen2, Phi-2): tokens and merges are copied as they
  are and ``tokenizer.ggml.pre`` names the pre-tokenizer regex, which llama.cpp needs to
  split text the same way; unknown regexes are refused rather than guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from tandem.errors import ModelFormatError, UnsupportedModel

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# Pre-tokenizer regexes llama.cpp knows, by its ``tokenizer.ggml.pre`` name.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
KNOWN_PRE_REGEXES = {(): "gpt-2", (_LLAMA3_REGEX,): "llama-bpe", (_QWEN2_REGEX,): "qwen2"}


@dataclass
class VocabSpec:
    """Everything GGUF needs to describe a tokenizer."""

    model: str  # "llama" (SentencePiece-style) or "gpt2" (byte-level BPE)
    pre: str
    tokens: list[str]
    scores: list[float]
    types: list[int]
    merges: list[str] = field(default_factory=list)
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    pad: int | None = None
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"Cannot read {path}: {exc}") from None


def read_json_optional(path: Path) -> dict[str, Any]:
    """A JSON side file that may be missing or unreadable (``{}`` then)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _walk(node: Any, kind: str) -> list[dict[str, Any]]:
    """All components of type ``kind`` in a (possibly nested ``Sequence``) normalizer/pre-tokenizer."""
    if not isinstance(node, dict):
        return []
    found = [node] if node.get("type") == kind else []
    for child in node.get("normalizers", []) + node.get("pretokenizers", []):
        found += _walk(child, kind)
    return found


def _merge_pairs(merges: list[Any]) -> list[tuple[str, str]]:
    """Merges are ``"a b"`` strings in older files and ``["a", "b"]`` pairs in newer ones."""
    pairs = []
    for m in merges:
        if isinstance(m, str):
            a, _, b = m.partition(" ")
            pairs.append((a, b))
        else:
            pairs.append((m[0], m[1]))
    return pairs


def _token_table(tok: dict[str, Any]) -> tuple[list[str | None], dict[int, dict[str, Any]]]:
    vocab: dict[str, int] = tok["model"]["vocab"]
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    size = max([*vocab.values(), *added.keys()]) + 1
    tokens: list[str | None] = [None] * size
    for text, idx in vocab.items():
        tokens[idx] = text
    for idx, a in added.items():
        tokens[idx] = a["content"]
    return tokens, added


def _is_spm_style(tok: dict[str, Any]) -> bool:
    model = tok["model"]
    metaspace = bool(_walk(tok.get("pre_tokenizer"), "Metaspace"))
    replaces = any(
        r.get("content") == "▁" for r in _walk(tok.get("normalizer"), "Replace")
    )
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and (metaspace or replaces)


def _spm_vocab(tok: dict[str, Any]) -> tuple[list[str], list[float], list[int], bool]:
    tokens, added = _token_table(tok)
    rank: dict[str, int] = {}
    for r, (a, b) in enumerate(_merge_pairs(tok["model"].get("merges", []))):
        rank.setdefault(a + b, r)
    unk = tok["model"].get("unk_token")
    texts, scores, types = [], [], []
    for idx, text in enumerate(tokens):
        if text is None:
            texts.append(f"[PAD{idx}]")
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNUSED)
            continue
        texts.append(text)
        if idx in added:
            scores.append(-1000.0)
            special = added[idx].get("special", False)
            types.append(
                gguf.TokenType.UNKNOWN if text == unk
                else gguf.TokenType.CONTROL if special
                else gguf.TokenType.USER_DEFINED
            )
        elif text == unk:
            scores.append(-1000.0)
            types.append(gguf.TokenType.UNKNOWN)
        elif _BYTE_TOKEN.fullmatch(text):
            scores.append(0.0)
            types.append(gguf.TokenType.BYTE)
        else:
            scores.append(-float(rank[text]) - 1.0 if text in rank else 0.0)
            types.append(gguf.TokenType.NORMAL)
    metaspace = _walk(tok.get("pre_tokenizer"), "Metaspace")
    if metaspace:
        m = metaspace[0]
        add_prefix = m.get("prepend_scheme", "always") != "never" and m.get("add_prefix_space", True)
    else:
        add_prefix = any(p.get("prepend") == "▁" for p in _walk(tok.get("normalizer"), "Prepend"))
    return texts, scores, [int(t) for t in types], add_prefix


def _pre_name(tok: dict[str, Any]) -> str:
    pre = tok.get("pre_tokenizer")
    regexes = tuple(
        s["pattern"].get("Regex", s["pattern"].get("String"))
        for s in _walk(pre, "Split")
    )
    byte_level = _walk(pre, "ByteLevel")
    if not byte_level:
        raise UnsupportedModel("tokenizer.json: a BPE tokenizer without a ByteLevel pre-tokenizer is not supported.")
    if not regexes and not byte_level[0].get("use_regex", True):
        raise UnsupportedModel("tokenizer.json: ByteLevel pre-tokenizer without a split regex is not supported.")
    name = KNOWN_PRE_REGEXES.get(regexes)
    if name is None:
        raise UnsupportedModel(
            f"tokenizer.json: unknown pre-tokenizer regex {regexes!r}; llama.cpp would split text "
            f"differently, so the converter refuses rather than guess."
        )
    return name


def _bpe_vocab(tok: dict[str, Any]) -> tuple[list[str], list[int], list[str]]:
    tokens, added = _token_table(tok)
    texts, types = [], []
    for idx, text in enumerate(tokens):
        if text is None:
            texts.append(f"[PAD{idx}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif idx in added:
            texts.append(text)
            types.append(int(gguf.TokenType.CONTROL if added[idx].get("special") else gguf.TokenType.USER_DEFINED))
        else:
            texts.append(text)
            types.append(int(gguf.TokenType.NORMAL))
    merges = [f"{a} {b}" for a, b in _merge_pairs(tok["model"].get("merges", []))]
    return texts, types, merges


def _token_id(name: Any, tokens: list[str]) -> int | None:
    if isinstance(name, dict):  # AddedToken serialised with its attributes
        name = name.get("content")
    if not isinstance(name, str):
        return None
    try:
        return tokens.index(name)
    except ValueError:
        return None


def read_hf_tokenizer(folder: str | Path, config: dict[str, Any] | None = None) -> VocabSpec:
    """Read ``tokenizer.json`` (+ ``tokenizer_config.json``) from a checkpoint folder."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelFormatError(f"{folder} has no tokenizer.json (only Hugging Face fast tokenizers are supported).")
    tok = _read_json(path)
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = _read_json(tcfg_path) if tcfg_path.is_file() else {}
    config = config or {}
    model_type = tok.get("model", {}).get("type")
    if model_type != "BPE":
        raise UnsupportedModel(f"{path}: tokenizer model {model_type!r} is not supported (only BPE).")
    if _is_spm_style(tok):
        tokens, scores, types, add_prefix = _spm_vocab(tok)
        spec = VocabSpec("llama", "default", tokens, scores, types, add_space_prefix=add_prefix)
    else:
        tokens, types, merges = _bpe_vocab(tok)
        spec = VocabSpec("gpt2", _pre_name(tok), tokens, [0.0] * len(tokens), types, merges=merges)
        spec.add_bos = False
    vocab_size = int(config.get("vocab_size", len(tokens)))
    if vocab_size > len(spec.tokens):  # embedding rows beyond the tokenizer: padding tokens
        for i in range(len(spec.tokens), vocab_size):
            spec.tokens.append(f"[PAD{i}]")
            spec.scores.append(-1000.0)
            spec.types.append(int(gguf.TokenType.UNUSED))
    spec.bos = _token_id(tcfg.get("bos_token"), spec.tokens)
    spec.eos = _token_id(tcfg.get("eos_token"), spec.tokens)
    spec.unk = _token_id(tcfg.get("unk_token"), spec.tokens)
    spec.pad = _token_id(tcfg.get("pad_token"), spec.tokens)
    for key, attr in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        if getattr(spec, attr) is None and isinstance(config.get(key), int):
            setattr(spec, attr, config[key])
    spec.add_bos = bool(tcfg.get("add_bos_token", spec.add_bos))
    spec.add_eos = bool(tcfg.get("add_eos_token", False))
    template = tcfg.get("chat_template")
    spec.chat_template = template if isinstance(template, str) else None
    return spec


def add_vocab(writer: gguf.GGUFWriter, spec: VocabSpec) -> None:
    """Write the tokenizer keys of ``spec`` into a GGUF being written."""
    writer.add_tokenizer_model(spec.model)
    writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_scores(spec.scores)
    writer.add_token_types(spec.types)
    if spec.merges:
        writer.add_token_merges(spec.merges)
    for value, add in (
        (spec.bos, writer.add_bos_token_id),
        (spec.eos, writer.add_eos_token_id),
        (spec.unk, writer.add_unk_token_id),
        (spec.pad, writer.add_pad_token_id),
    ):
        if value is not None:
            add(value)
    writer.add_add_bos_token(spec.add_bos)
    writer.add_add_eos_token(spec.add_eos)
    if spec.add_space_prefix is not None:
        writer.add_add_space_prefix(spec.add_space_prefix)
    if spec.chat_template:
        writer.add_chat_template(spec.chat_template)


def write_vocab_only(spec: VocabSpec, out: str | Path, name: str = "vocab") -> Path:
    """A weightless GGUF holding only the vocabulary (``Llama(path, vocab_only=True)`` loads it)."""
    out = Path(out)
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_name(name)
    writer.add_vocab_size(len(spec.tokens))
    add_vocab(writer, spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return out

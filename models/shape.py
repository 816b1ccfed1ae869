"""A decoder's dimensions, in one vocabulary: llama.cpp's (the names GGUF metadata uses).

Every part of Tandem that needs a model's size (the planner's memory model, the torch
engine, the converter, the cost twins, the distiller) reads the same fields:
``n_vocab, n_embd, n_ff, n_layer, n_head, n_head_kv, head_dim, n_ctx_train, tied``.
Types that need more (byte sizes, RoPE and norm settings, MoE routing) extend
:class:`DecoderShape` rather than respelling a dimension, so ``n_embd`` means the same
thing in a plan, a torch config and a GGUF header.

One reader per source lives here: :func:`dims_from_gguf` (GGUF metadata, no tensor data)
and :func:`dims_from_hf` (a Hugging Face ``config.json``). Callers that build a richer
type pass the result on with ``**dims.dims()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

KV_TYPE_SIZES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24),
                 "q5_0": (32, 22), "q4_1": (32, 20), "q4_0": (32, 18)}
"""(block, bytes per block) of each KV cache type, as ggml stores them."""


@dataclass(frozen=True)
class DecoderShape:
    """Dimensions of a decoder-only transformer (Llama family), named as in GGUF."""

    n_vocab: int
    n_embd: int
    """Width of the residual stream (GGUF ``embedding_length``, HF ``hidden_size``)."""
    n_ff: int
    """Feed-forward width (GGUF ``feed_forward_length``, HF ``intermediate_size``)."""
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    """Key (and query) width of one head (GGUF ``attention.key_length``)."""
    n_ctx_train: int = 2048
    tied: bool = False
    """The output head reuses the token embedding (no ``output.weight``)."""
    head_dim_v: int | None = None
    """Value width of one head (GGUF ``attention.value_length``); ``None``: ``head_dim``."""

    @property
    def kv_width(self) -> int:
        """Width of one token's keys in one layer (all KV heads)."""
        return self.n_head_kv * self.head_dim

    def kv_bytes_per_token(self, type_k: str = "f16", type_v: str = "f16") -> int:
        """Bytes of K and V per token of context over all layers, as llama.cpp stores them
        (a row of ``n_head_kv`` heads per layer, in blocks of its type): the one rule the
        backends, the planner and the server's model list all use."""
        def row(type_name: str, width: int) -> int:
            block, size = KV_TYPE_SIZES[type_name]
            return width // block * size

        width_v = (self.head_dim_v or self.head_dim) * self.n_head_kv
        return self.n_layer * (row(type_k, self.kv_width) + row(type_v, width_v))

    def kv_type_ok(self, type_name: str) -> bool:
        """Quantized KV rows are split per head, so each head must hold whole blocks."""
        block = KV_TYPE_SIZES[type_name][0]
        return self.head_dim % block == 0 and (self.head_dim_v or self.head_dim) % block == 0

    @property
    def layer_params(self) -> int:
        """Parameters of one plain (dense, bias-free) Llama block of these dims."""
        q = self.n_head * self.head_dim
        return 2 * self.n_embd * q + 2 * self.n_embd * self.kv_width + 3 * self.n_embd * self.n_ff + 2 * self.n_embd

    def count_params(self) -> int:
        """Parameters of a plain Llama of these dims (a file's own count may differ:
        biases, experts; :class:`tandem.runtime.planning.shapes.ModelShape` keeps that one)."""
        return self.n_layer * self.layer_params + self.n_vocab * self.n_embd * (1 if self.tied else 2) + self.n_embd

    def dims(self) -> dict[str, Any]:
        """Only the :class:`DecoderShape` fields, to build a richer type from these dims."""
        return {f.name: getattr(self, f.name) for f in fields(DecoderShape)}


def dims_from_gguf(arch_value: Callable[[str, Any], Any], n_vocab: int, tied: bool) -> DecoderShape:
    """Dimensions from GGUF metadata: ``arch_value(key, default)`` reads
    ``{architecture}.{key}`` (e.g. :meth:`tandem.models.gguf_file.GGUFInfo.arch_value`);
    the vocabulary and tying come from the tensors (``token_embd`` rows, no ``output``)."""
    def num(key: str, default: int) -> int:
        return int(arch_value(key, default) or default)

    n_embd, n_head = num("embedding_length", 0), num("attention.head_count", 1)
    head_dim = num("attention.key_length", n_embd // max(n_head, 1))
    return DecoderShape(
        n_vocab=int(n_vocab), n_embd=n_embd, n_ff=num("feed_forward_length", 0), n_layer=num("block_count", 0),
        n_head=n_head, n_head_kv=num("attention.head_count_kv", n_head), head_dim=head_dim,
        n_ctx_train=num("context_length", 2048), tied=tied, head_dim_v=num("attention.value_length", head_dim),
    )


def dims_from_hf(config: Mapping[str, Any]) -> DecoderShape:
    """Dimensions from a Hugging Face ``config.json``; a missing required key raises
    ``KeyError`` and a malformed value ``TypeError``/``ValueError`` (callers word the error)."""
    n_embd, n_head = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or n_embd // n_head)
    return DecoderShape(
        n_vocab=int(config["vocab_size"]), n_embd=n_embd, n_ff=int(config.get("intermediate_size") or 0),
        n_layer=int(config["num_hidden_layers"]), n_head=n_head,
        n_head_kv=int(config.get("num_key_value_heads") or n_head), head_dim=head_dim,
        n_ctx_train=int(config.get("max_position_embeddings") or 2048),
        tied=bool(config.get("tie_word_embeddings", False)), head_dim_v=head_dim,
    )

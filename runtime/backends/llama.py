"""The GGUF backend: llama.cpp through llama-cpp-python's low-level API.

``llama_cpp.Llama`` loads the model and context; evaluation goes straight to
``llama_decode`` with a batch whose logits flags are set only for the positions asked
for, so plain decoding copies one row of logits and verification copies k+1.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _internals

from tandem.errors import ModelFormatError, TandemError
from tandem.models.gguf_file import check_runnable, inspect_gguf
from tandem.runtime.backends.embedding_rows import EmbeddingRows
from tandem.runtime.backends.host_experts import HostExperts
from tandem.runtime.backends.llama_config import (
    EXACT_BATCH,
    EXACT_BATCH_REPACKED,
    LlamaConfig,
    check_kv_types,
    context_params,
    load_progress,
    model_params,
)
from tandem.runtime.backends.llama_outputs import OutputRows, flagged, in_asked_order
from tandem.runtime.backends.llama_vocab import (
    NO_FD_REDIRECT,
    LlamaVocab,
    TokenizerDelegate,
    load_model,
)
from tandem.runtime.backends.protocol import (
    ComputeSettings,
    MemoryReport,
    check_room,
    chunked_logits,
    speed_settings,
)
from tandem.runtime.backends.rpc import direct, open_link
from tandem.runtime.backends.token_cache import TokenCache, new_tokens
from tandem.runtime.machine import cpu_cores


class LlamaCppBackend(TokenizerDelegate, TokenCache):
    """A GGUF model and its KV cache (see :class:`tandem.runtime.backends.protocol.Backend`)."""

    def __init__(self, path: str | os.PathLike[str], config: LlamaConfig | None = None, *,
                 on_load: Callable[[float], None] | None = None) -> None:
        """``on_load`` hears the fraction of the weights loaded (a progress bar's)."""
        self.config = config or LlamaConfig()
        self.path = Path(path)
        self.info = inspect_gguf(self.path)
        check_runnable(self.info)
        self.name = self.path.stem
        cfg = self.config
        self.shape = self.info.shape()
        check_kv_types(self.shape, cfg.type_k, cfg.type_v)
        trained = int(self.info.arch_value("context_length", 2048) or 2048)
        n_ctx = cfg.n_ctx or min(trained, 4096)
        threads = cfg.n_threads or cpu_cores()
        params, self._rpc = model_params(cfg), None
        self.host_experts = (HostExperts.for_model(cfg.host_expert_layers, [t.name for t in self.info.tensors])
                             if cfg.host_expert_layers else None)
        if self.host_experts is not None:
            self.host_experts.apply(params)  # the array lives on self.host_experts past the load
        progress = load_progress(on_load) if on_load is not None else None
        if progress is not None:
            params.progress_callback = progress  # referenced by ``progress`` until __init__ ends
        if cfg.rpc:
            self._rpc, split = open_link(cfg.rpc, self.info, cfg.rpc_layers)
            self._rpc.apply(params, split)
        native = self._rpc.call if self._rpc else direct
        self._llama_decode = self._rpc.decode if self._rpc else llama_cpp.llama_decode
        self._model_handle = native(load_model, self.path, params)
        try:
            self._context = native(lambda: _internals.LlamaContext(
                model=self._model_handle, params=context_params(cfg, n_ctx, threads), verbose=NO_FD_REDIRECT))
        except (ValueError, RuntimeError) as exc:
            self._model_handle.close()
            raise ModelFormatError(
                f"llama.cpp could not create a context of {n_ctx} tokens for {self.path} "
                f"(architecture {self.info.architecture!r}): {exc}"
            ) from None
        self._ctx = self._context.ctx
        self._model = self._model_handle.model
        self.tokenizer = LlamaVocab(self._model_handle, path=self.path)
        self._mem = llama_cpp.llama_get_memory(self._ctx)
        self._n_vocab = self.tokenizer.n_vocab
        self._outputs = OutputRows(self._ctx, self._n_vocab)
        self._n_ctx = int(llama_cpp.llama_n_ctx_seq(self._ctx))
        self.n_seq = int(llama_cpp.llama_n_seq_max(self._ctx))
        # llama-cpp-python caps n_batch at the requested n_ctx; chunk by what the context took.
        self._n_batch = int(llama_cpp.llama_n_batch(self._ctx))
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
        self._tokens: list[int] = []
        self._threads = threads
        self.kv_bytes_per_token = self.shape.kv_bytes_per_token(cfg.type_k, cfg.type_v)
        # embedding input (superposed decoding) is set up on first use: most runs never take it
        self._token_embd: np.ndarray | None = None
        self._embd_rows: EmbeddingRows | None = None
        self._embd_batch: llama_cpp.llama_batch | None = None
        self._finite_pending: Callable[[], None] | None = None

    # -- damaged weights --------------------------------------------------------------
    def check_first_logits(self, on_finite: Callable[[], None]) -> None:
        """Check the next logits this model computes for NaN or infinite values: damaged
        weights (a NaN or infinite scale in a quantized block) give them in every row,
        and they would otherwise be "generated" as garbage. Checking a real call's
        logits costs no forward pass of its own (a test prompt's cost a new pair's
        first `tandem run` 0.45 s on 2 cores). ``on_finite`` hears that they were finite;
        until then every call's logits are checked."""
        self._finite_pending = on_finite

    def checked_logits(self, logits: np.ndarray) -> np.ndarray:
        """``logits``, after the check :meth:`check_first_logits` asked for (if pending)."""
        done = self._finite_pending
        if done is not None:
            if not np.isfinite(logits).all():
                raise ModelFormatError(f"{self.name}: the model computes NaN or infinite values; its weights are "
                                       "damaged (re-download or re-convert the file).")
            self._finite_pending = None
            done()
        return logits

    # -- protocol -------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        tokens = new_tokens(tokens)

        def fill(batch, start: int, count: int) -> None:
            for i in range(count):
                batch.token[i] = tokens[start + i]

        return self._decode(len(tokens), fill, logits_for, self._batch, tokens)

    def _decode(self, n: int, fill, logits_for: Sequence[int] | None, batch, ids: list[int]) -> np.ndarray:
        """Append ``n`` positions (inputs written by ``fill``) in chunks of the context's
        batch size, recording ``ids`` in ``tokens``; return the logits rows asked for."""
        check_room(len(self._tokens), n, self._n_ctx)

        def run(start: int, stop: int, rows: list[int]) -> list[np.ndarray]:
            count = stop - start
            n_past = len(self._tokens)
            batch.n_tokens = count
            fill(batch, start, count)
            positions = flagged(rows)
            for i in range(count):
                batch.pos[i] = n_past + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = False
            for i in positions:
                batch.logits[i] = True
            rc = self._llama_decode(self._ctx, batch)
            if rc != 0:
                self.truncate(n_past)
                raise TandemError(f"llama.cpp failed to evaluate a batch (llama_decode returned {rc}).")
            self._tokens.extend(ids[start:stop])
            # views into llama.cpp's buffer: chunked_logits copies them before the next chunk
            return in_asked_order(self._outputs.block(len(positions)), positions, rows, copy=False)

        return self.checked_logits(chunked_logits(n, self._n_batch, self._n_vocab, logits_for, run))

    # -- superposed input (embeddings instead of token ids) ---------------------------
    @property
    def n_embd(self) -> int:
        return int(llama_cpp.llama_model_n_embd(self._model))

    def token_embeddings(self) -> np.ndarray:
        """The input token-embedding matrix ``E`` (n_vocab, n_embd) as float32, read from the GGUF.

        llama.cpp keeps the matrix inside ggml buffers it does not expose, so it is read
        (and dequantized for quantized types) from the file once and cached: superposed
        decoding feeds ``m @ E`` instead of a token id.
        """
        if self._token_embd is not None:
            return self._token_embd
        import gguf  # local: gguf's reader only when a file is read here

        reader = gguf.GGUFReader(str(self.path))
        tensor = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if tensor is None:
            raise ModelFormatError(f"{self.path.name} has no token_embd.weight tensor to read embeddings from.")
        qtype = gguf.GGMLQuantizationType(int(tensor.tensor_type))
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = np.asarray(tensor.data, dtype=np.float32)
        else:
            data = gguf.quants.dequantize(tensor.data, qtype).astype(np.float32)
        matrix = np.ascontiguousarray(data.reshape(-1, self.n_embd))
        if matrix.shape[0] < self._n_vocab:
            raise ModelFormatError(f"{self.path.name}: token_embd.weight has {matrix.shape[0]} rows for a vocab of {self._n_vocab}.")
        self._token_embd = matrix
        return matrix

    def token_embedding_rows(self, ids: Sequence[int]) -> np.ndarray:
        """Rows ``E[ids]`` only, read from the file on first use (superposition mixes at
        most k rows a step: no need to hold the whole table, see :mod:`.embedding_rows`)."""
        if self._embd_rows is None:
            self._embd_rows = EmbeddingRows(self.info, self.n_embd, self._n_vocab)
        return self._embd_rows.rows(ids)

    def evaluate_embeddings(self, embeds: np.ndarray, logits_for: Sequence[int] | None = None) -> np.ndarray:
        """Like :meth:`evaluate`, but each position's input is an embedding row, not a token.

        ``embeds`` has shape (n, n_embd). Positions are recorded in ``tokens`` as ``-1``
        (no token id describes a mixed input), so a later :func:`prefill` never reuses them.
        """
        embeds = np.ascontiguousarray(np.atleast_2d(embeds), dtype=np.float32)
        n, width = embeds.shape
        if n == 0 or width != self.n_embd:
            raise ValueError(f"evaluate_embeddings needs rows of width {self.n_embd}, got shape {embeds.shape}")
        if self._embd_batch is None:
            self._embd_batch = llama_cpp.llama_batch_init(self._n_batch, width, 1)

        def fill(batch, start: int, count: int) -> None:
            chunk = embeds[start : start + count]
            ctypes.memmove(batch.embd, chunk.ctypes.data, chunk.nbytes)

        return self._decode(n, fill, logits_for, self._embd_batch, [-1] * n)

    def truncate(self, n: int) -> None:
        n = max(0, n)
        if n >= len(self._tokens):
            return
        if not llama_cpp.llama_memory_seq_rm(self._mem, 0, n, -1):
            # Some caches (recurrent models) cannot drop a suffix: rebuild the prefix.
            keep = self._tokens[:n]
            llama_cpp.llama_memory_clear(self._mem, True)
            self._tokens = []
            if keep:
                self.evaluate(keep)
            return
        del self._tokens[n:]

    def keep_spans(self, spans: Sequence[tuple[int, int]]) -> bool:
        if not spans or not llama_cpp.llama_memory_can_shift(self._mem):
            return False
        kept: list[int] = []
        for start, end in spans:  # pack each span down to where the kept ones end
            to = len(kept)
            if to < start:
                llama_cpp.llama_memory_seq_rm(self._mem, 0, to, start)  # the gap before it
                llama_cpp.llama_memory_seq_add(self._mem, 0, start, end, to - start)
            kept += self._tokens[start:end]
        llama_cpp.llama_memory_seq_rm(self._mem, 0, len(kept), -1)
        self._tokens = kept
        return True

    @property
    def exact_batch(self) -> int | None:
        """:data:`EXACT_BATCH` in the exact configuration, :data:`EXACT_BATCH_REPACKED`
        with repacked weights (llama.cpp's CPU matmul takes another kernel path from 8
        rows on, measured on Intel AMX and AMD Zen 5 CPUs, and from 4 when repacked,
        measured on Zen 5: ``tests/runtime/test_real_models.py`` checks both on every
        machine it runs on);
        ``None`` when the fast configuration gives no such guarantee."""
        exact = self.config.exact and not self.config.flash_attn and self.config.type_v in ("f16", "f32", "bf16")
        if not exact:
            return None
        return EXACT_BATCH_REPACKED if self.config.repack else EXACT_BATCH

    def memory(self) -> MemoryReport:
        weights = int(llama_cpp.llama_model_size(self._model))
        kv = self.kv_bytes_per_token * self._n_ctx * self.n_seq
        scratch = self._n_vocab * 4 * self._n_batch  # logits buffer for a full batch
        device = "cuda" if self.config.n_gpu_layers else "cpu"
        return MemoryReport(weights=weights, kv_cache=kv, scratch=scratch, device=device)

    # -- what the batcher of parallel sequences drives (llama_batch) --------------------
    @property
    def context(self):
        """The ``llama_context`` pointer (one caller at a time)."""
        return self._ctx

    @property
    def memory_handle(self):
        """The context's ``llama_memory`` (KV cache) handle."""
        return self._mem

    @property
    def n_batch(self) -> int:
        return self._n_batch

    def decode_batch(self, batch) -> int:
        """``llama_decode`` of a batch built by the caller (RPC-aware); its return code."""
        return int(self._llama_decode(self._ctx, batch))

    def compute_settings(self) -> ComputeSettings:
        return ComputeSettings(self.path, speed_settings(self.config, self._threads), self._threads,
                               remote=bool(self.config.rpc))

    def set_threads(self, n: int) -> bool:
        if n < 1:
            return False
        llama_cpp.llama_set_n_threads(self._ctx, n, n)
        self._threads = n
        return True

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self._embd_batch is not None:
            llama_cpp.llama_batch_free(self._embd_batch)
            self._embd_batch = None
        if self._rpc is not None:
            self._rpc.release(self._context, self._model_handle)
            return
        self._context.close()
        self._model_handle.close()

    def __enter__(self) -> LlamaCppBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

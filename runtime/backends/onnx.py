"""`OnnxBackend`: the backend protocol on onnxruntime, for decoder-with-past graphs.

Runs the folders ``tandem export-onnx`` writes and Hugging Face Optimum-style exports
(``input_ids``, optional ``attention_mask``/``position_ids``, ``past_key_values.N.key``
/``.value`` in, ``logits`` and ``present.N.*`` out), batch size 1. The KV cache is the
list of ``present`` arrays; ``truncate`` slices them, so rollback is exact.

The CUDA execution provider is used when onnxruntime has it and a GPU answers;
otherwise the session runs on CPU and the backend logs one note saying so
(``backend.note`` holds it too).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.errors import ModelFormatError, ModelNotFound, TandemError
from tandem.models.hf_tokenizer import read_json_optional
from tandem.runtime.backends.llama_vocab import LlamaVocab, TokenizerDelegate
from tandem.runtime.backends.onnx_meta import FP32_FILE, INT8_FILE, read_onnx_meta
from tandem.runtime.backends.protocol import (
    ComputeSettings,
    MemoryReport,
    check_room,
    chunked_logits,
    speed_settings,
)
from tandem.runtime.backends.token_cache import FixedTokenCache, new_tokens
from tandem.runtime.backends.torch_engine.tokenizer import HFTokenizer

log = logging.getLogger(__name__)
CUDA_EP, CPU_EP = "CUDAExecutionProvider", "CPUExecutionProvider"
_NP_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


@dataclass(frozen=True)
class OnnxConfig:
    device: str | None = None
    """``cuda`` or ``cpu``; ``None`` tries CUDA and falls back to CPU with a note."""
    variant: str = "fp32"
    """Which graph of an exported folder: ``fp32`` (model.onnx) or ``int8`` (model.int8.onnx)."""
    n_ctx: int | None = None
    n_batch: int = 512
    n_threads: int | None = None


def resolve_graph(path: Path, variant: str) -> tuple[Path, Path]:
    """(graph file, folder with tokenizer and metadata) for a folder or a .onnx file."""
    if not path.exists():
        raise ModelNotFound(f"No ONNX model at {path}.")
    if path.is_file():
        return path, path.parent
    files = {"fp32": FP32_FILE, "int8": INT8_FILE}
    if variant not in files:
        raise TandemError(f"Unknown ONNX variant {variant!r}; choose fp32 or int8.")
    graph = path / files[variant]
    if not graph.exists():
        candidates = sorted(path.glob("*.onnx"))
        if variant != "fp32" or len(candidates) != 1:
            raise ModelNotFound(f"{path} has no {files[variant]} (export with `tandem export-onnx`{' --int8' if variant == 'int8' else ''}).")
        graph = candidates[0]
    return graph, path


def make_session(graph: Path, device: str | None, n_threads: int | None):
    """An InferenceSession on CUDA when possible; returns (session, note or None)."""
    import onnxruntime as ort  # local: the [onnx] extra, imported only to open an ONNX model

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # No spin-waiting: a drafter and a target share the cores, and spinning threads of
    # one session starve the other (measured: 5x slower speculative rounds on 2 cores).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if n_threads:
        opts.intra_op_num_threads = n_threads
    available = ort.get_available_providers()
    want_cuda = device in (None, "cuda") and CUDA_EP in available
    if device == "cuda" and CUDA_EP not in available:
        raise TandemError("CUDA was asked for but this onnxruntime has no CUDA execution provider.")
    providers = [CUDA_EP, CPU_EP] if want_cuda else [CPU_EP]
    if want_cuda:  # a missing GPU or CUDA library is reported by our note, not ORT's log spam
        ort.set_default_logger_severity(4)
    try:
        session = ort.InferenceSession(str(graph), opts, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
        raise ModelFormatError(f"onnxruntime could not load {graph}: {exc}") from None
    finally:
        ort.set_default_logger_severity(2)  # onnxruntime's default (warnings)
    active = session.get_providers()
    note = None
    if CUDA_EP not in active:
        if device == "cuda":
            raise TandemError("CUDA was asked for but onnxruntime's CUDA execution provider found no usable GPU.")
        why = "no usable GPU" if CUDA_EP in available else "this onnxruntime build has no CUDA provider"
        note = f"onnxruntime is running {graph.name} on CPU ({why} for the CUDA execution provider)."
    return session, note


class OnnxBackend(TokenizerDelegate, FixedTokenCache):
    """An ONNX decoder-with-past graph and its KV cache (see :class:`tandem.runtime.backends.protocol.Backend`)."""

    def __init__(self, path: str | os.PathLike[str], config: OnnxConfig | None = None) -> None:
        self.config = cfg = config or OnnxConfig()
        graph, folder = resolve_graph(Path(path), cfg.variant)
        self.path = graph
        self.name = folder.name if Path(path).is_dir() else graph.stem
        self.session, self.note = make_session(graph, cfg.device, cfg.n_threads)
        if self.note:
            log.warning(self.note)
        self.device = "cuda" if CUDA_EP in self.session.get_providers() else "cpu"
        meta = read_onnx_meta(folder)
        hf_config = read_json_optional(folder / "config.json")
        self.tokenizer = LlamaVocab.open(folder / "vocab.gguf") if (folder / "vocab.gguf").exists() else HFTokenizer(folder)
        self._inputs = {i.name: i for i in self.session.get_inputs()}
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._past_names = [n for n in self._inputs if n.startswith("past_key_values.")]
        self._present_names = [n.replace("past_key_values.", "present.") for n in self._past_names]
        if "input_ids" not in self._inputs or not self._past_names or "logits" not in self._outputs:
            raise ModelFormatError(f"{graph} is not a decoder-with-past graph (input_ids, past_key_values.*, logits).")
        missing = [n for n in self._present_names if n not in self._outputs]
        if missing:
            raise ModelFormatError(f"{graph} has no output {missing[0]} for its past input.")
        first = self._inputs[self._past_names[0]]
        self._kv_dtype = _NP_TYPES.get(first.type, np.float32)
        n_kv = first.shape[1] if isinstance(first.shape[1], int) else (
            meta.n_head_kv if meta else hf_config.get("num_key_value_heads"))
        head_dim = first.shape[3] if isinstance(first.shape[3], int) else (meta.head_dim if meta else None)
        if not n_kv or not head_dim:
            raise ModelFormatError(f"{graph}: cannot tell the KV head count and head size from the graph or its config.")
        self._kv_shape = (1, int(n_kv), 0, int(head_dim))
        self._n_vocab = int((meta.n_vocab if meta else 0) or hf_config.get("vocab_size") or self.tokenizer.n_vocab)
        trained = int((meta.n_ctx_train if meta else 0) or hf_config.get("max_position_embeddings") or 2048)
        self._n_ctx = cfg.n_ctx or min(trained, 4096)
        self._past = self._empty_past()
        self._tokens: list[int] = []

    def _empty_past(self) -> list[np.ndarray]:
        return [np.zeros(self._kv_shape, dtype=self._kv_dtype) for _ in self._past_names]

    # -- protocol -------------------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    def evaluate(self, tokens: Sequence[int], logits_for: Sequence[int] | None = None) -> np.ndarray:
        tokens = new_tokens(tokens)
        check_room(len(self._tokens), len(tokens), self._n_ctx)
        return chunked_logits(len(tokens), self.config.n_batch, self._n_vocab, logits_for,
                              lambda start, stop, rows: self._run(tokens[start:stop], rows))

    def truncate(self, n: int) -> None:
        n = max(0, n)
        if n < len(self._tokens):
            self._past = [p[:, :, :n] for p in self._past]
            del self._tokens[n:]

    def memory(self) -> MemoryReport:
        weights = self.path.stat().st_size
        data = Path(str(self.path) + ".data")
        if data.exists():
            weights += data.stat().st_size
        per_token = sum(self._kv_shape[1] * self._kv_shape[3] * np.dtype(self._kv_dtype).itemsize for _ in self._past_names)
        return MemoryReport(weights=weights, kv_cache=per_token * self._n_ctx,
                            scratch=self._n_vocab * 4 * self.config.n_batch, device=self.device)

    def compute_settings(self) -> ComputeSettings:
        return ComputeSettings(self.path, speed_settings(self.config, self.config.n_threads), self.config.n_threads)

    def set_threads(self, n: int) -> bool:
        """The thread count is fixed when the model is opened."""
        return False

    def close(self) -> None:
        self._past = self._empty_past()
        self._tokens = []
        self.tokenizer.close()

    def __enter__(self) -> OnnxBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------
    def _run(self, chunk: list[int], rows: list[int]) -> np.ndarray:
        n_past, t = len(self._tokens), len(chunk)
        feed: dict[str, np.ndarray] = {"input_ids": np.asarray([chunk], dtype=np.int64)}
        own_rows = "logits_index" in self._inputs
        if own_rows:
            feed["logits_index"] = np.asarray(rows, dtype=np.int64)
        if "attention_mask" in self._inputs:
            feed["attention_mask"] = np.ones((1, n_past + t), dtype=np.int64)
        if "position_ids" in self._inputs:
            feed["position_ids"] = np.arange(n_past, n_past + t, dtype=np.int64)[None]
        feed.update(zip(self._past_names, self._past, strict=True))
        try:
            results = self.session.run(["logits", *self._present_names], feed)
        except Exception as exc:  # onnxruntime's error types are not exported consistently
            raise TandemError(f"onnxruntime failed to evaluate a batch: {exc}") from None
        self._past = results[1:]
        self._tokens.extend(chunk)
        logits = np.asarray(results[0], dtype=np.float32).reshape(-1, self._n_vocab)
        return logits if own_rows else logits[rows]

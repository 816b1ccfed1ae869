"""``tandem-onnx.json``: what an exported ONNX graph does not say by itself.

Written by :func:`tandem.runtime.backends.onnx_export.export_onnx`, read by the ONNX
backend and by the planner (which must not import torch, hence this small module). The
dimensions use :class:`tandem.models.shape.DecoderShape`'s names. Files of format 1
spelt four keys the torch engine's old way; :func:`read_onnx_meta` translates them, so
exports made before still open.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

META_FILE = "tandem-onnx.json"
FP32_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
"""The graphs an export folder holds (here, not in the exporter, so the ONNX backend
opens a folder without importing torch)."""
FORMAT = "tandem-decoder-with-past/2"
_FORMAT_1_KEYS = {"n_layers": "n_layer", "n_kv_heads": "n_head_kv", "vocab_size": "n_vocab",
                  "context_length": "n_ctx_train"}
"""Format 1's key -> today's field (format 1 is otherwise the same)."""


@dataclass(frozen=True)
class OnnxMeta:
    """An export's dims, context, tokenizer and source."""

    n_layer: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    """The context the graph's RoPE table covers (the export's ``n_ctx``)."""
    tokenizer: str
    """``vocab.gguf`` or ``hf`` (tokenizer.json in the folder)."""
    source: str
    format: str = FORMAT

    def write(self, folder: Path) -> Path:
        path = folder / META_FILE
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        return path


def read_onnx_meta(folder: Path) -> OnnxMeta | None:
    """The folder's metadata; ``None`` when it has none or it is unreadable or incomplete
    (a foreign export, e.g. Optimum's: callers then ask the graph and config.json)."""
    try:
        raw = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
        values = {_FORMAT_1_KEYS.get(key, key): value for key, value in raw.items()}
        return OnnxMeta(**{f.name: values[f.name] for f in fields(OnnxMeta) if f.name in values})
    except (OSError, ValueError, TypeError, AttributeError):
        return None

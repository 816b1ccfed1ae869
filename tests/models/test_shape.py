"""One spelling of a decoder's dimensions: the GGUF reader and the config.json reader give
the same :class:`DecoderShape` for one model, and every richer type carries those dims."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from tandem.models.convert import read_hparams
from tandem.models.gguf_file import inspect_gguf
from tandem.models.shape import DecoderShape, dims_from_gguf, dims_from_hf
from tandem.models.twin import read_shape


def _gguf_dims(path: Path) -> DecoderShape:
    info = inspect_gguf(path)
    embd = next(t for t in info.tensors if t.name == "token_embd.weight")  # ggml order: (n_embd, n_vocab)
    return dims_from_gguf(info.arch_value, embd.shape[1],
                          tied=all(t.name != "output.weight" for t in info.tensors))


def test_gguf_and_config_json_give_the_same_dims(tinystories656k_dir: Path, tinystories656k_gguf: Path) -> None:
    config = json.loads((tinystories656k_dir / "config.json").read_text())
    from_hf, from_gguf = dims_from_hf(config), _gguf_dims(tinystories656k_gguf)
    assert from_hf == from_gguf
    assert (from_hf.n_embd, from_hf.n_layer, from_hf.n_head, from_hf.n_head_kv, from_hf.head_dim) == (128, 2, 8, 4, 16)
    assert read_hparams(config).dims() == from_hf.dims()  # convert's hparams extend the same dims
    assert read_shape(gguf.GGUFReader(tinystories656k_gguf)) == from_gguf  # and the twin reads them too


def test_count_params_matches_the_file(tinystories656k_gguf: Path, stories260k: Path) -> None:
    """The dense Llama rule counts exactly the tensors a plain Llama GGUF holds (tied or not)."""
    for path in (tinystories656k_gguf, stories260k):
        dims = _gguf_dims(path)
        assert dims.count_params() == inspect_gguf(path).n_params, path.name


def test_hf_reader_reports_a_missing_dimension() -> None:
    with pytest.raises(KeyError, match="hidden_size"):
        dims_from_hf({"num_attention_heads": 4, "vocab_size": 10, "num_hidden_layers": 1})

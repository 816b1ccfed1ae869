"""Damaged model files end in one `tandem: error:` line and a non-zero exit, never a
native abort, a hang or garbage: copies of the real SmolLM2 GGUF corrupted in the ways
that used to make llama.cpp assert (layer count, RMS epsilon), hang (a FIFO), trace back
(an unreadable file) or "generate" from NaN weights, each run through the real CLI."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest


def _field(reader, key: str):
    f = reader.fields[key]
    return f.parts[f.data[0]]


def _set(key: str, value) -> Callable:
    def corrupt(reader) -> None:
        _field(reader, key)[0] = value
    return corrupt


def _tensor(name: str):
    def pick(reader):
        return next(t for t in reader.tensors if t.name == name)
    return pick


def _nan_weights(reader) -> None:
    _tensor("blk.0.attn_norm.weight")(reader).data[:] = np.nan


def _inf_weights(reader) -> None:
    _tensor("output_norm.weight")(reader).data[:8] = np.inf


def _shrink_vocab_rows(reader) -> None:
    t = _tensor("token_embd.weight")(reader)
    t.field.parts[3][1] = 49000  # ne[1]: the rows of the embedding matrix


CORRUPTIONS: dict[str, Callable] = {
    "block_count 0": _set("llama.block_count", 0),
    "block_count 1000": _set("llama.block_count", 1000),
    "block_count 29 (one layer short)": _set("llama.block_count", 29),
    "rms epsilon NaN": _set("llama.attention.layer_norm_rms_epsilon", math.nan),
    "rms epsilon inf": _set("llama.attention.layer_norm_rms_epsilon", math.inf),
    "rms epsilon negative": _set("llama.attention.layer_norm_rms_epsilon", -1e-5),
    "head_count 0": _set("llama.attention.head_count", 0),
    "head_count_kv 0": _set("llama.attention.head_count_kv", 0),
    "head_count_kv 4 (does not divide 9)": _set("llama.attention.head_count_kv", 4),
    "head_count 7 (does not divide 576)": _set("llama.attention.head_count", 7),
    "context_length 0": _set("llama.context_length", 0),
    "embedding_length 512": _set("llama.embedding_length", 512),
    "vocab_size 50000": _set("llama.vocab_size", 50000),
    "embedding rows vs vocabulary": _shrink_vocab_rows,
    "NaN weights": _nan_weights,
    "inf weights": _inf_weights,
}


def _run(model: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem.app.cli", "run", "-m", str(model), "-p", "Hello",
                           "-n", "2", "--ctx", "256", "--threads", "1", "--quiet"],
                          capture_output=True, text=True, timeout=timeout)


def _assert_clean_error(p: subprocess.CompletedProcess, *, expect: str | None = None) -> None:
    assert p.returncode > 0, (p.returncode, p.stderr[-2000:])  # negative: killed by a signal (an abort)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("tandem: error:")]
    assert len(errors) == 1, p.stderr[-2000:]
    assert p.stdout.strip() == ""
    if expect:
        assert expect in errors[0], errors[0]


@pytest.fixture(scope="module")
def smollm2_copy(real_models, tmp_path_factory) -> Callable[[str], Path]:
    """A fresh copy of the SmolLM2 GGUF per case (the original is never written)."""
    folder = tmp_path_factory.mktemp("corrupt")

    def make(name: str) -> Path:
        path = folder / (name.replace(" ", "_").replace("(", "").replace(")", "") + ".gguf")
        shutil.copyfile(real_models.smollm2, path)
        return path

    return make


def test_intact_copy_runs(smollm2_copy) -> None:
    path = smollm2_copy("intact")
    p = _run(path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip()
    path.unlink()


BATCH = """
import contextlib, io, json, sys
from tandem.app.cli import main
for argv in json.loads(sys.stdin.read()):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    print(json.dumps({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()}), flush=True)
"""


def test_corrupted_metadata_or_weights_is_one_clean_error(smollm2_copy) -> None:
    """Every corruption in one CLI process (``tandem.app.cli.main`` per file, in turn): a
    native abort would kill the process, so the exit status and the count of answers
    still show it; a hang hits the timeout."""
    import json

    import gguf

    paths = {}
    for name, corrupt in CORRUPTIONS.items():
        path = paths[name] = smollm2_copy(name)
        reader = gguf.GGUFReader(path, "r+")
        corrupt(reader)
        reader.data.flush()
        del reader
    argvs = [["run", "-m", str(p), "-p", "Hello", "-n", "2", "--ctx", "256", "--threads", "1", "--quiet"]
             for p in paths.values()]
    try:
        proc = subprocess.run([sys.executable, "-c", BATCH], input=json.dumps(argvs), capture_output=True, text=True,
                              timeout=60 + 30 * len(argvs))
    finally:
        for p in paths.values():
            p.unlink()
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # negative: a native abort
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(CORRUPTIONS)
    for name, r in zip(CORRUPTIONS, results, strict=True):
        _assert_clean_error(subprocess.CompletedProcess([name], r["code"], r["stdout"], r["stderr"]))


def test_nan_weights_in_their_own_process(smollm2_copy) -> None:
    """Damaged weights pass every header check: the finite-logits probe after loading reports them."""
    import gguf

    path = smollm2_copy("nan-weights")
    reader = gguf.GGUFReader(path, "r+")
    _nan_weights(reader)
    reader.data.flush()
    del reader
    try:
        _assert_clean_error(_run(path), expect="NaN or infinite")
    finally:
        path.unlink()


def test_fifo_is_refused_without_hanging(tmp_path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    _assert_clean_error(_run(fifo, timeout=60), expect="not a regular file")


def test_directory_named_gguf_is_refused(tmp_path) -> None:
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    _assert_clean_error(_run(folder, timeout=60))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file anyway")
def test_unreadable_file_is_one_clean_error(smollm2_copy) -> None:
    path = smollm2_copy("unreadable")
    path.chmod(0)
    try:
        _assert_clean_error(_run(path, timeout=60), expect="permission denied")
    finally:
        path.chmod(0o600)
        path.unlink()


def test_unreadable_file_check_in_process(tmp_path, monkeypatch) -> None:
    """The same refusal without relying on file modes (root can read a mode-000 file)."""
    from tandem.errors import ModelFormatError
    from tandem.models.gguf_file import inspect_gguf

    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    with pytest.raises(ModelFormatError, match="permission denied"):
        inspect_gguf(path)

"""The strict GGUF reader, and fuzzing of the whole loading path with broken copies."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.errors import ModelFormatError, ModelNotFound, TandemError, UnsupportedModel
from tandem.models.gguf_file import check_runnable, inspect_gguf


def write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray] | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, value in (tensors or {"token_embd.weight": np.zeros((4, 8), np.float32)}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_fixture_header(stories260k: Path) -> None:
    info = inspect_gguf(stories260k)
    assert info.architecture == "llama"
    assert info.arch_value("block_count") == 5
    assert info.arch_value("embedding_length") == 64
    assert 250_000 < info.n_params < 300_000
    assert info.data_offset + max(t.offset + t.nbytes for t in info.tensors) <= info.file_size
    check_runnable(info)


def test_missing_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound):
        inspect_gguf(tmp_path / "nope.gguf")
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model" * 10)
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        inspect_gguf(text)
    with pytest.raises(ModelFormatError, match="folder"):
        inspect_gguf(tmp_path)


def test_unsupported_architecture_and_vocab_only(tmp_path: Path, vocab_gguf: Path) -> None:
    foo = write_gguf(tmp_path / "foo.gguf", "foo-arch")
    with pytest.raises(UnsupportedModel, match="foo-arch"):
        check_runnable(inspect_gguf(foo))
    with pytest.raises(ModelFormatError, match="vocabulary only"):
        check_runnable(inspect_gguf(vocab_gguf / "ggml-vocab-gpt-2.gguf"))


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.05, 0.2, 0.5, 0.9, 0.999])
def test_truncated_copies_fail_cleanly(tmp_path: Path, stories260k: Path, fraction: float) -> None:
    data = stories260k.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelFormatError):
        inspect_gguf(cut)


@pytest.mark.parametrize("head", [b"GGUF", b"GGUF\x03\x00\x00\x00", b"GGUF\x03\x00\x00\x00" + bytes(15)])
def test_a_file_cut_inside_its_header_is_called_truncated(tmp_path: Path, head: bytes) -> None:
    """(It was "not a GGUF model file (no GGUF magic bytes at its start)", magic and all.)"""
    cut = tmp_path / "magic_only.gguf"
    cut.write_bytes(head)
    with pytest.raises(ModelFormatError, match="is truncated"):
        inspect_gguf(cut)


def test_random_corruption_never_escapes_as_another_exception(tmp_path: Path, stories260k: Path) -> None:
    """Flip bytes in the header region: the reader either accepts or raises TandemError."""
    data = bytearray(stories260k.read_bytes())
    header_end = inspect_gguf(stories260k).data_offset
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for i in range(300):
        broken = bytearray(data[:header_end])
        for _ in range(rng.randint(1, 8)):
            broken[rng.randrange(len(broken))] = rng.randrange(256)
        path = tmp_path / f"c{i % 4}.gguf"
        path.write_bytes(bytes(broken) + data[header_end:])
        try:
            inspect_gguf(path)
            outcomes["ok"] += 1
        except TandemError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0 and sum(outcomes.values()) == 300


def _run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tandem.app.cli", *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=cwd,
    )


def test_loading_corrupted_models_end_in_one_message(tmp_path: Path, stories260k: Path) -> None:
    """The whole path (reader, then llama.cpp) on broken copies: clear error or a valid run, never a crash."""
    data = bytearray(stories260k.read_bytes())
    header_end = inspect_gguf(stories260k).data_offset
    rng = random.Random(99)
    cases = [data[: len(data) // 2], data[: header_end // 2], data[: header_end + 10]]
    for _ in range(5):
        broken = bytearray(data)
        for _ in range(4):
            broken[rng.randrange(header_end)] = rng.randrange(256)
        cases.append(broken)
    for i, blob in enumerate(cases):
        path = tmp_path / f"broken{i}.gguf"
        path.write_bytes(bytes(blob))
        r = _run_cli("run", "-m", str(path), "-p", "Once upon a time", "-n", "4")
        assert r.returncode >= 0, f"case {i}: killed by signal {-r.returncode}\n{r.stderr[-2000:]}"
        assert "Traceback" not in r.stderr, f"case {i}: {r.stderr[-2000:]}"
        if r.returncode != 0:
            assert r.stderr.startswith("tandem: error:"), r.stderr


def test_truncated_inside_the_vocabulary_names_the_offset(tmp_path: Path, stories260k: Path) -> None:
    """The vocabulary's strings are stepped over, not decoded, yet every length is checked."""
    data = stories260k.read_bytes()
    info = inspect_gguf(stories260k)
    assert info.metadata["tokenizer.ggml.tokens"].length > 64  # summarised, so skipped
    start = data.index(b"tokenizer.ggml.tokens")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: start + 2000])  # inside the token strings
    with pytest.raises(ModelFormatError, match="truncated or corrupted"):
        inspect_gguf(cut)


def test_a_file_read_again_is_the_same_and_a_changed_one_is_read_afresh(tmp_path: Path, stories260k: Path) -> None:
    import tandem.models.gguf_file as gguf_file

    copy = tmp_path / "copy.gguf"
    copy.write_bytes(stories260k.read_bytes())
    old = time.time() - 60
    os.utime(copy, (old, old))  # not racy: remembered
    first = inspect_gguf(copy)
    first.metadata["general.architecture"] = "changed by a caller"
    again = inspect_gguf(copy)
    assert again.architecture == "llama" and again.tensors == first.tensors
    assert any(v[0] == copy.resolve() for v in gguf_file._READ)
    copy.write_bytes(b"GGUF" + b"\0" * 100)  # a new version: read again, and refused
    with pytest.raises(ModelFormatError):
        inspect_gguf(copy)

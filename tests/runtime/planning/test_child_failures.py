"""Every child process the planner and setup run reports a death by signal by its name
(a CUDA build that crashed in the baseline child used to print "...baseline:" and nothing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from child_signals import dying_python

from tandem.errors import TandemError


@pytest.fixture(params=["SEGV", "KILL"])
def dying(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``sys.executable`` replaced by one that dies of the signal; returns its name."""
    monkeypatch.setattr(sys, "executable", str(dying_python(tmp_path, request.param)))
    return f"SIG{request.param}"


def test_the_process_baseline_child(dying: str) -> None:
    from tandem.runtime.planning import baseline

    with pytest.raises(TandemError) as caught:
        baseline._measure()
    assert str(caught.value).startswith("Could not measure this machine's process baseline: "
                                        f"the process baseline child died of {dying} (")


def test_a_crash_in_the_tiny_model_costs_one_figure_not_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline child's tiny llama.cpp model died of SIGSEGV on a CUDA build (H200): the
    child runs again without it, and only that figure falls back, saying why."""
    from tandem.runtime.planning import baseline

    python = tmp_path / "python-dies-with-llama"
    python.write_text(f'#!/bin/sh\n[ -n "${baseline.SKIP_LLAMA_ENV}" ] || kill -SEGV $$\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    measured = baseline._measure()
    assert measured.llama_context == baseline.LLAMA_CONTEXT_FALLBACK
    assert measured.llama_context_note.startswith("the tiny llama.cpp model's run died of SIGSEGV (")
    assert measured.rss > 0 and measured.bandwidth_gbs > 0


def test_the_llama_cpp_sizing_child(dying: str, stories260k: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.runtime.planning import llama_sizes

    monkeypatch.setattr(llama_sizes, "_MEMO", {})  # sizes an earlier test read stay out: a child must run
    sizes = llama_sizes.LlamaSizes(stories260k, persist=False)
    with pytest.raises(TandemError, match=f"the llama.cpp sizing child died of {dying} "):
        _ = sizes.runtime
    sizes.close()


def test_the_memory_probe_child(dying: str) -> None:
    from tandem.runtime.planning.memprobe import ProbeSpec, measure

    with pytest.raises(RuntimeError, match=f"the memory probe child died of {dying} "):
        measure(ProbeSpec(models=[]))


def test_the_selfcheck_decoding_child(dying: str, tmp_path: Path) -> None:
    from tandem.runtime.backends.selfcheck import decode_in_child

    said = decode_in_child(tmp_path / "tiny.gguf")
    assert said is not None and said.startswith(f"the decoding child died of {dying} (")

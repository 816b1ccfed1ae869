"""The CLI's stderr progress line: drawn on a terminal only, redrawn in place, erased at the end."""

from __future__ import annotations

import io
import time

from tandem.app.progress import Progress, bar


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_is_drawn_in_place_and_erased() -> None:
    term = FakeTerminal()
    with Progress("loading qwen", term, delay=0.0, interval=0.01) as progress:
        progress.stage("planning memory")
        deadline = time.monotonic() + 10
        while "planning memory" not in term.getvalue():
            assert time.monotonic() < deadline, term.getvalue()
            time.sleep(0.01)
    out = term.getvalue()
    assert out.startswith("\rtandem: loading qwen")
    assert "\n" not in out  # redrawn with carriage returns, never a new line per update
    last = out.rsplit("\r", 2)[-2]
    assert last.strip() == "" and len(last) >= len("tandem: loading qwen (planning memory)… 0 s")
    assert out.endswith("\r")


def test_nothing_on_a_pipe_or_for_quick_work() -> None:
    pipe = io.StringIO()
    with Progress("loading", pipe, delay=0.0, interval=0.01):
        time.sleep(0.05)
    assert pipe.getvalue() == ""
    term = FakeTerminal()
    with Progress("loading", term, delay=5.0):
        pass
    assert term.getvalue() == ""


def test_line_and_bar() -> None:
    p = Progress("converting", FakeTerminal(), enabled=False)
    p._started = 100.0
    p.stage("tensors")
    p.advance(9, 24)
    assert p.line(now=103.0) == "tandem: converting (tensors)… [#########---------------]  37% 9/24 3 s"
    assert bar(0, 0) == "[------------------------]   0% 0/0"


def test_convert_reports_each_tensor(tinystories656k_dir, tmp_path) -> None:
    from tandem.models.convert import convert_hf

    calls: list[tuple[int, int]] = []
    convert_hf(tinystories656k_dir, tmp_path / "m.gguf", "f32", progress=lambda done, total: calls.append((done, total)))
    total = calls[-1][1]
    assert total > 1 and calls == [(i, total) for i in range(1, total + 1)]


def test_a_fraction_shows_a_bar_without_counts() -> None:
    p = Progress("loading qwen", FakeTerminal(), enabled=False)
    p._started = 100.0
    p.stage("loading the model")
    p.fraction(0.375)
    assert p.line(now=101.0) == "tandem: loading qwen (loading the model)… [#########---------------]  38% 1 s"


def test_loading_a_real_model_reports_its_progress_to_the_end(real_models) -> None:
    """llama.cpp's own load progress reaches the engine's caller (the CLI's bar, the TUI's
    status): rising fractions that end at 1; a failing listener does not stop the load."""
    from tandem.runtime.engine.builder import open_engine
    from tandem.runtime.engine.spec import EngineSpec

    seen: list[float] = []
    with open_engine(EngineSpec(real_models.smollm2, draft_mode="off", n_ctx=256, threads=1),
                     on_load=seen.append) as engine:
        assert engine.target.tokenize("hi", add_bos=False)
    assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] == 1.0

    def broken(_: float) -> None:
        raise RuntimeError("a listener that fails")

    with open_engine(EngineSpec(real_models.smollm2, draft_mode="off", n_ctx=256, threads=1),
                     on_load=broken) as engine:
        assert engine.target.n_ctx >= 256


def test_plan_measures_behind_a_progress_line(stories260k, monkeypatch, capsys) -> None:
    """`tandem plan`'s first plan of a model measures for seconds (llama.cpp's buffer
    sizes, a new machine's baseline): the planning happens inside a progress line."""
    import tandem.app.commands.plan as plan_command
    from tandem.app.cli import main

    shown: list[str] = []
    inside: list[bool] = []

    class Recorded(Progress):
        def __init__(self, label: str, **kw) -> None:
            super().__init__(label, FakeTerminal(), **kw)
            shown.append(label)

        def __enter__(self):
            inside.append(True)
            return super().__enter__()

        def __exit__(self, *exc) -> None:
            inside.append(False)
            super().__exit__(*exc)

    planned = plan_command.make_plan

    def make_plan(req):
        assert inside == [True], "planned outside the progress line"
        return planned(req)

    monkeypatch.setattr(plan_command, "Progress", Recorded)
    monkeypatch.setattr(plan_command, "make_plan", make_plan)
    assert main(["plan", "-m", str(stories260k), "--ctx", "256"]) == 0
    assert shown == [f"planning {stories260k.name}"] and inside == [True, False]
    assert "fits:    yes" in capsys.readouterr().out

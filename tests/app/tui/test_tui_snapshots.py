"""Snapshots of the main screens (pytest-textual-snapshot; update with --snapshot-update).

Deterministic by construction: fixed terminal size, greedy decoding of the real fixture
model, timings masked (``--``), a fixed models-dir path on the first-run screen.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from textual.widgets import TextArea
from tui_pilot import ready

from tandem.app.tui.app import AppConfig, TandemApp
from tandem.app.tui.session import ChatSettings
from tandem.kernels.sampling_params import SamplingParams

SIZE = (100, 30)
NARROW, WIDE = (80, 24), (200, 50)
"""The smallest common terminal and a large one: every footer key, dialog button and
label must be on screen at both (the Pilot tests in test_tui_daily check the regions)."""


def make_app(model: Path | None, tmp_path: Path) -> TandemApp:
    # Plain decoding: model-free drafting (the default) learns across the tests of a process,
    # so its acceptance in the stats line would depend on which tests ran before.
    return TandemApp(AppConfig(model=model, settings=ChatSettings(SamplingParams(temperature=0.0), 60),
                               export_dir=tmp_path, mask_timings=True, threads=1, draft_mode="off"))


async def steady(pilot) -> None:
    """Stop text cursors blinking, so the screenshot does not depend on when it is taken."""
    for area in pilot.app.screen.query(TextArea):
        area.cursor_blink = False
    await pilot.pause()


async def chat_with_reply(pilot) -> None:
    """Wait for the model, send one message, wait for the reply to be stored and drawn."""
    screen = await ready(pilot.app, pilot)
    screen.input.load_text("Once upon a time")
    await pilot.press("enter")
    deadline = time.monotonic() + 30
    while screen.replies_done < 1:
        assert time.monotonic() < deadline
        await pilot.pause(0.05)
    await steady(pilot)


def test_chat_screen_after_a_reply(snap_compare, stories260k: Path, tmp_path: Path) -> None:
    assert snap_compare(make_app(stories260k, tmp_path), terminal_size=SIZE, run_before=chat_with_reply)


def test_settings_dialog(snap_compare, stories260k: Path, tmp_path: Path) -> None:
    async def run_before(pilot) -> None:
        await ready(pilot.app, pilot)
        await pilot.press("ctrl+o")
        await steady(pilot)

    assert snap_compare(make_app(stories260k, tmp_path), terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare, stories260k: Path, tmp_path: Path) -> None:
    async def run_before(pilot) -> None:
        await ready(pilot.app, pilot)
        await pilot.press("f1")
        await steady(pilot)

    assert snap_compare(make_app(stories260k, tmp_path), terminal_size=SIZE, run_before=run_before)


def test_model_picker(snap_compare, stories260k: Path, tmp_path: Path) -> None:
    from tandem.models.paths import models_dir

    shutil.copy(stories260k, models_dir() / "tiny-copy.gguf")

    async def run_before(pilot) -> None:
        await ready(pilot.app, pilot)
        await pilot.press("ctrl+t")
        await steady(pilot)

    assert snap_compare(make_app(stories260k, tmp_path), terminal_size=SIZE, run_before=run_before)


def test_first_run_without_models(snap_compare, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem.app.tui.app.models_dir", lambda: Path("/home/you/.local/share/tandem/models"))
    assert snap_compare(make_app(None, tmp_path), terminal_size=SIZE)


@pytest.mark.parametrize("size", [NARROW, WIDE], ids=["80x24", "200x50"])
def test_chat_screen_sizes(snap_compare, stories260k: Path, tmp_path: Path, size: tuple[int, int]) -> None:
    assert snap_compare(make_app(stories260k, tmp_path), terminal_size=size, run_before=chat_with_reply)


@pytest.mark.parametrize("size", [NARROW, WIDE], ids=["80x24", "200x50"])
@pytest.mark.parametrize("key", ["ctrl+o", "ctrl+t", "ctrl+f", "f1"], ids=["settings", "models", "search", "help"])
def test_dialog_sizes(snap_compare, stories260k: Path, tmp_path: Path, size: tuple[int, int], key: str) -> None:
    async def run_before(pilot) -> None:
        await ready(pilot.app, pilot)
        await pilot.press(key)
        await steady(pilot)

    assert snap_compare(make_app(stories260k, tmp_path), terminal_size=size, run_before=run_before)

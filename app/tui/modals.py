"""Dialogs: chat settings, rename, confirm, export, model picker, help; and the no-model screen."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Markdown, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from tandem.app.tui.session import ChatSettings
from tandem.app.tui.shown import plain, shown
from tandem.models.store import ModelEntry

NO_DRAFTER = "__none__"


class Dialog(ModalScreen):
    """A modal with Esc to cancel; subclasses compose inside a ``#dialog`` container."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall")]
    """Below 30 lines a long form scrolls inside the dialog (``-short`` in tandem.tcss)."""

    def action_cancel(self) -> None:
        self.dismiss(None)


class TextPrompt(Dialog):
    """One line of text (rename, export path). Enter accepts."""

    def __init__(self, title: str, value: str, *, placeholder: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.value = value
        self.placeholder = placeholder

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="small"):
            yield Label(shown(self.title_text), classes="dialog-title")
            yield Input(self.value, placeholder=self.placeholder, id="prompt-input")
            with Horizontal(classes="buttons"):
                yield Button("OK", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _accept(self) -> None:
        value = self.query_one("#prompt-input", Input).value.strip()
        if value:
            self.dismiss(value)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class Confirm(Dialog):
    BINDINGS = [Binding("y", "yes", "Yes"), Binding("n,escape", "cancel", "No")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="small"):
            yield Label(shown(self.question), classes="dialog-title")
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", id="no")

    @on(Button.Pressed, "#yes")
    def action_yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def action_cancel(self) -> None:
        self.dismiss(False)


SAMPLING_FIELDS: list[tuple[str, str, type]] = [
    ("temperature", "Temp (0 = greedy)", float),
    ("top_k", "Top-k (0 = off)", int),
    ("top_p", "Top-p", float),
    ("min_p", "Min-p", float),
    ("repetition_penalty", "Repetition penalty", float),
    ("presence_penalty", "Presence penalty", float),
    ("frequency_penalty", "Frequency penalty", float),
    ("seed", "Seed (blank = random)", int),
]


def parse_settings(system_prompt: str, raw: dict[str, str], base: ChatSettings) -> tuple[str, ChatSettings]:
    """Validate the settings form; raises ``ValueError`` with a message naming the field."""
    values: dict[str, object] = {}
    for name, label, kind in SAMPLING_FIELDS:
        text = raw.get(name, "").strip()
        if name == "seed" and not text:
            values[name] = None
            continue
        try:
            values[name] = kind(text)
        except ValueError:
            raise ValueError(f"{label.split(' (')[0]}: {text!r} is not a valid {kind.__name__}") from None
        if kind is float and not math.isfinite(values[name]):  # type: ignore[arg-type]
            raise ValueError(f"{label.split(' (')[0]}: {text!r} is not a number")
    if values["seed"] is not None and int(values["seed"]) < 0:  # type: ignore[call-overload]
        values["seed"] = None  # -1: a random seed, as in llama.cpp (a negative seed failed every reply)
    if float(values["temperature"]) < 0:  # type: ignore[arg-type]
        raise ValueError("Temperature cannot be negative")
    if not 0 < float(values["top_p"]) <= 1:  # type: ignore[arg-type]
        raise ValueError("Top-p must be in (0, 1]")
    if not 0 <= float(values["min_p"]) <= 1:  # type: ignore[arg-type]
        raise ValueError("Min-p must be in [0, 1]")
    if int(values["top_k"]) < 0:  # type: ignore[call-overload]
        raise ValueError("Top-k cannot be negative (0 = off)")
    if float(values["repetition_penalty"]) <= 0:  # type: ignore[arg-type]
        raise ValueError("Repetition penalty must be above 0 (1 = off)")
    for name, label in (("presence_penalty", "Presence penalty"), ("frequency_penalty", "Frequency penalty")):
        if not -2 <= float(values[name]) <= 2:  # type: ignore[arg-type]
            raise ValueError(f"{label} must be in [-2, 2] (0 = off)")
    try:
        max_tokens = int(raw.get("max_tokens", "").strip())
    except ValueError:
        raise ValueError("Max tokens must be a whole number") from None
    if max_tokens < 1:
        raise ValueError("Max tokens must be at least 1")
    params = replace(base.params, **values)  # type: ignore[arg-type]
    return system_prompt, ChatSettings(params, max_tokens, list(base.stop))


class SettingsScreen(Dialog):
    """Per-chat system prompt and sampling parameters. Returns ``(system_prompt, settings)``."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, system_prompt: str, settings: ChatSettings) -> None:
        super().__init__()
        self.system_prompt = system_prompt
        self.settings = settings

    def compose(self) -> ComposeResult:
        p = self.settings.params
        with Vertical(id="dialog", classes="scrolling"):
            yield Label("Chat settings", classes="dialog-title")
            # The form scrolls and the buttons stay below it: on a 24-line terminal the
            # whole form does not fit, and Save/Cancel must still be on screen.
            with VerticalScroll(id="dialog-body"):
                yield Label("System prompt")
                yield TextArea(plain(self.system_prompt), id="system-prompt")
                with Grid(id="sampling"):
                    for name, label, _ in SAMPLING_FIELDS:
                        value = getattr(p, name)
                        yield Label(label)
                        yield Input("" if value is None else str(value), id=f"f-{name}")
                    yield Label("Max reply tokens")
                    yield Input(str(self.settings.max_tokens), id="f-max_tokens")
            yield Label("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Save (ctrl+s)", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        raw = {name: self.query_one(f"#f-{name}", Input).value
               for name in [*(f[0] for f in SAMPLING_FIELDS), "max_tokens"]}
        try:
            result = parse_settings(self.query_one("#system-prompt", TextArea).text, raw, self.settings)
        except ValueError as exc:
            self.query_one("#settings-error", Label).update(shown(exc))
            return
        self.dismiss(result)

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class ModelPicker(Dialog):
    """Pick the target and the drafter from the local store. Returns ``(target, drafter|None)``."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "apply", "Apply", priority=True)]

    def __init__(self, models: list[ModelEntry], target: Path | None, drafter: Path | None,
                 speculative: bool) -> None:
        super().__init__()
        self.models = models
        self.target = target
        self.drafter = drafter
        self.speculative = speculative

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Models", classes="dialog-title")
            with Horizontal(id="pickers"):
                with Vertical():
                    yield Label("Target")
                    yield OptionList(*[Option(shown(m.name), id=str(i)) for i, m in enumerate(self.models)],
                                     id="target-list")
                with Vertical():
                    note = "" if self.speculative else " (speculative decoding unavailable)"
                    yield Label("Drafter" + note)
                    options = [Option("(none)", id=NO_DRAFTER)]
                    options += [Option(shown(m.name), id=str(i), disabled=not self.speculative)
                                for i, m in enumerate(self.models)]
                    yield OptionList(*options, id="drafter-list")
            with Horizontal(classes="buttons"):
                yield Button("Apply (ctrl+s)", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        paths = [m.path.resolve() for m in self.models]
        targets = self.query_one("#target-list", OptionList)
        drafters = self.query_one("#drafter-list", OptionList)
        if self.target is not None and self.target.resolve() in paths:
            targets.highlighted = paths.index(self.target.resolve())
        drafters.highlighted = 0
        if self.drafter is not None and self.drafter.resolve() in paths:
            drafters.highlighted = paths.index(self.drafter.resolve()) + 1
        targets.focus()

    @on(Button.Pressed, "#apply")
    def action_apply(self) -> None:
        t = self.query_one("#target-list", OptionList).highlighted
        d = self.query_one("#drafter-list", OptionList).highlighted
        if t is None:
            self.notify("Pick a target model", severity="warning")
            return
        drafter = None if not d else self.models[d - 1].path
        self.dismiss((self.models[t].path, drafter))

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        self.dismiss(None)


class HelpScreen(Dialog):
    BINDINGS = [Binding("escape,f1,q", "cancel", "Close")]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="dialog", classes="help"):
            yield Markdown(self.text)


NO_MODEL_TEXT = """\
# No model yet

Tandem runs models on this machine, and none is in the local store yet.

**Pull one** from the Hugging Face hub (one time, needs the network):

    tandem pull OWNER/REPO:Q4_K_M

**Or add a file you already have**: copy a `.gguf` file into

    {models_dir}

or point `TANDEM_MODEL_PATH` at a folder holding some, or start with a file directly:

    tandem chat -m path/to/model.gguf

`tandem models` lists what Tandem can see. Once a model is present, everything works offline.

Press **q** to quit.
"""


class NoModelScreen(Screen):
    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]

    def __init__(self, models_dir: Path) -> None:
        super().__init__()
        self.models_dir = models_dir

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="no-model"):
            yield Markdown(NO_MODEL_TEXT.format(models_dir=self.models_dir))
        yield Static("", id="spacer")
        yield Footer()

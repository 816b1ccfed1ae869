"""Text from a file, a model or an error, made safe for the chat app's widgets.

Chat titles and messages come from the history file, model names from file names,
errors quote both: any of them can hold terminal control sequences (an OSC 52 that
writes the clipboard, a CSI that clears the screen) or Textual markup (``[bold]``,
``[@click=app.quit]``). :func:`shown` cleans such text once, with the one cleaning rule
(:func:`tandem.app.terminal_text.strip_controls`), and returns it as
:class:`~textual.content.Content`, which widgets never read as markup. Strings a widget
only takes as ``str`` (titles, notifications) use :func:`plain`.
"""

from __future__ import annotations

from textual.content import Content

from tandem.app.terminal_text import strip_controls


def plain(text: object) -> str:
    """``text`` without control sequences or control characters."""
    return strip_controls(str(text))


def shown(text: object) -> Content:
    """``text`` cleaned, as content a widget shows literally (no markup)."""
    return Content(plain(text))

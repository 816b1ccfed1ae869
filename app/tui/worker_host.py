"""What a chat screen's collaborator needs to run work off the UI thread.

The model loader and the reply stream each run a thread worker whose messages must
reach the screen's handlers (Textual finds handlers on the node a message is posted
to). They are given the screen through this Protocol, so each says what it uses of it
and neither imports the screen.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from textual.message import Message
from textual.notifications import SeverityLevel
from textual.worker import Worker


class WorkerHost(Protocol):
    """A node that runs thread workers, takes their messages and tells the user."""

    def run_worker(self, work: Callable[[], None], *, thread: bool, group: str,
                   exclusive: bool, exit_on_error: bool) -> Worker[Any]:
        """Start ``work`` as a worker owned by the host (cancelled when it goes)."""
        ...

    def call_after_refresh(self, callback: Callable[..., Any], *args: Any) -> bool:
        """Run ``callback`` on the UI thread once the screen has been drawn."""
        ...

    def post_message(self, message: Message) -> bool:
        """Queue ``message`` for the host's handlers (safe from any thread)."""
        ...

    def call_from_thread(self, callback: Callable[..., Any], *args: Any) -> Any:
        """Run ``callback`` on the UI thread and wait for it (from a worker thread)."""
        ...

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True) -> None:
        """A toast the user sees."""
        ...

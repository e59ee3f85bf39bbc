"""The question ctrl+q asks when quitting would lose something: an answer still streaming, or turns not
saved since the last ctrl+s."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class QuitScreen(ModalScreen[str | None]):
    """Dismissed with "save" (save the transcript, then quit), "quit" (quit without saving) or None (stay)."""

    DEFAULT_CSS = """
    QuitScreen { align: center middle; }
    #quit-box { width: 64; height: auto; border: round $warning; background: $surface; padding: 0 1;
                grid-size: 1; grid-rows: auto 3; }
    #quit-buttons { height: 3; align-horizontal: right; }
    """
    BINDINGS = [("escape", "stay", "Cancel"), ("s", "choose('save')", "Save and quit"),
                ("q", "choose('quit')", "Quit without saving")]

    def __init__(self, reason: str):
        super().__init__()
        self.reason = reason

    def compose(self) -> ComposeResult:
        with Grid(id="quit-box"):
            yield Label(f"{self.reason}. Save the conversation before quitting?", id="quit-reason")
            with Horizontal(id="quit-buttons"):
                yield Button("Save and quit (s)", variant="primary", id="save")
                yield Button("Quit without saving (q)", variant="error", id="quit")
                yield Button("Cancel (esc)", id="stay")

    def on_mount(self) -> None:
        self.query_one("#save", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None if event.button.id == "stay" else event.button.id)

    def action_choose(self, choice: str) -> None:
        self.dismiss(choice)

    def action_stay(self) -> None:
        self.dismiss(None)

"""The settings dialog: placement (devices, draft, schedule) and temperature, changed from the app."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Grid, Horizontal
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from hetero_sd import validate
from hetero_sd.devices import devices
from hetero_sd.errors import InvalidArgumentError

SCHEDULES = ("sequential", "overlap")


class SettingsScreen(ModalScreen[dict | None]):
    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    #box { width: 60; height: auto; max-height: 22; border: round $primary; background: $surface; padding: 0 1;
           grid-size: 2; grid-columns: 16 1fr; grid-rows: 3; }
    #buttons { column-span: 2; height: 3; align-horizontal: right; }
    """
    BINDINGS = [("escape", "cancel", "Cancel")]

    def __init__(self, load_kwargs: dict, settings: dict):
        super().__init__()
        self.load_kwargs, self.settings = load_kwargs, settings

    def compose(self) -> ComposeResult:
        names = [d.name for d in devices() if d.available]
        target = self.load_kwargs.get("target_device", "cpu")
        draft = self.load_kwargs.get("draft_device") or target
        with Grid(id="box"):
            yield Label("target device")
            yield Select([(n, n) for n in names], value=target if target in names else names[0], id="target_device",
                         allow_blank=False)
            yield Label("draft device")
            yield Select([(n, n) for n in names], value=draft if draft in names else names[0], id="draft_device",
                         allow_blank=False)
            yield Label("draft")
            yield Input(str(self.load_kwargs.get("draft") or "none"), id="draft")
            yield Label("schedule")
            yield Select([(s, s) for s in SCHEDULES], value=self.settings.get("schedule", "sequential"),
                         id="schedule", allow_blank=False)
            yield Label("temperature")
            yield Input(f"{self.settings.get('temperature', 0.0):g}", id="temperature")
            with Horizontal(id="buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """Enter in a field applies the dialog (it must not reach the app, where it would be a chat turn)."""
        event.stop()
        self.apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "cancel":
            self.dismiss(None)
            return
        self.apply()

    def apply(self) -> None:
        try:
            temperature = validate.temperature_value(float(self.query_one("#temperature", Input).value))
        except ValueError as e:  # not a number, or refused by the shared check (negative, tiny, nan, inf)
            problem = (f"{e.problem} ({e.fix})" if isinstance(e, InvalidArgumentError)
                       else "temperature must be a number >= 0")
            self.notify(problem, severity="error")
            return
        draft = self.query_one("#draft", Input).value.strip()
        self.dismiss({"target_device": self.query_one("#target_device", Select).value,
                      "draft_device": self.query_one("#draft_device", Select).value,
                      "draft": None if draft in ("", "none") else draft,
                      "schedule": self.query_one("#schedule", Select).value, "temperature": temperature})

    def action_cancel(self) -> None:
        self.dismiss(None)

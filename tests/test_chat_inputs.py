"""The chat app against bad input: a refused temperature in the settings dialog, Enter in a
dialog field, an answer that fails, a model that never loads; driven by Textual's Pilot."""

from __future__ import annotations

from hetero_sd.cli import main
from hetero_sd.tui import ChatApp

from .test_chat import ask, run, settings, started, until


def test_settings_enter_applies_and_a_tiny_temperature_is_refused_in_the_dialog(tiny_llama, tiny_draft):
    from textual.widgets import Input

    app = ChatApp({"target": str(tiny_llama), "draft": str(tiny_draft)}, max_new_tokens=8)

    async def scenario():
        async with started(app, (120, 36), 120) as pilot:
            dialog = await settings(pilot, app)
            field = dialog.query_one("#temperature", Input)
            field.value = "1e-300"
            field.focus()
            await pilot.press("enter")
            await pilot.pause(0.2)
            assert app.screen is dialog  # refused: the dialog stays, with an error
            assert app.settings["temperature"] == 0.0 and not app.conversation.messages
            field.value = "0.5"
            await pilot.press("enter")  # Enter in a field applies the dialog; it is never a chat turn
            await pilot.pause(0.2)
            assert app.screen is not dialog and app.settings["temperature"] == 0.5
            assert not app.conversation.messages and not app.answers
            # every field sits inside the dialog's box at 120x36 (the chat box's dock rule once pulled
            # the dialog's inputs out of the grid)
            box = (await settings(pilot, app)).query_one("#box").region
            for w in app.screen.query("Input, Select, Button"):
                assert box.contains_region(w.region), w.id
            await pilot.press("escape")

    run(scenario)


def test_a_failing_answer_keeps_the_conversation(tiny_llama, tiny_draft, monkeypatch):
    app = ChatApp({"target": str(tiny_llama), "draft": str(tiny_draft)}, max_new_tokens=8)

    async def scenario():
        async with started(app, (100, 30), 120) as pilot:
            await ask(pilot, "t5 t9")
            await until(pilot, lambda: not app.generating, timeout=60)
            assert len(app.conversation.messages) == 2

            def broken(*a, **k):
                raise RuntimeError("probabilities are NaN")
            monkeypatch.setattr(app.runtime, "stream", broken)
            await ask(pilot, "t7 t8")
            await until(pilot, lambda: not app.generating, timeout=60)
            assert len(app.conversation.messages) == 2  # the first turn is kept
            assert app.query_one("#prompt").value == "t7 t8"  # the question is back in the box
            assert "RuntimeError" in str(app.query(".error").last().render())

    run(scenario)


def test_chat_exits_non_zero_when_the_model_never_loaded(monkeypatch, capsys, tmp_path):
    def load_then_quit(self):
        self.load_error = "target is missing"  # what load_runtime records; the user quits with ctrl+q
    monkeypatch.setattr(ChatApp, "run", load_then_quit)
    assert main(["chat", "--target", str(tmp_path / "missing")]) == 1
    assert "the model never loaded (target is missing)" in capsys.readouterr().err

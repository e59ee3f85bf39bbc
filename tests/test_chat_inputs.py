"""The chat app against bad or careless input: a refused temperature in the settings dialog, Enter in a
dialog field, an answer that fails, a model that never loads, a pasted megabyte, ctrl+q in the middle of
an answer, a link planted at the transcript's name, `--max-new-tokens 0`; driven by Textual's Pilot."""

from __future__ import annotations

import asyncio
import time

import pytest
from textual import events

from hetero_sd.cli import main
from hetero_sd.tui import ChatApp
from hetero_sd.tui.quit import QuitScreen
from hetero_sd.tui.conversation import save_transcript

from .chat_doubles import PacedRuntime
from .test_chat import ask, run, settings, started, until
from .test_chat_streaming import send


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


async def panel_toggled(app, timeout: float = 30.0) -> float:
    """Seconds from ctrl+b (as the terminal sends it) until the panel has been hidden or shown."""
    hidden = app.query_one("#panel").has_class("hidden")
    began = time.perf_counter()
    app.simulate_key("ctrl+b")
    while app.query_one("#panel").has_class("hidden") == hidden:
        if time.perf_counter() - began > timeout:
            raise TimeoutError(f"ctrl+b was not answered in {timeout} s")
        await asyncio.sleep(0.01)
    return time.perf_counter() - began


@pytest.mark.parametrize("size", [54_000, 1_048_576])
def test_a_pasted_megabyte_then_enter_keeps_the_app_answering(tiny_llama, tiny_draft, size):
    """The question is tokenized and checked in the worker: refused (longer than the context) with the
    fix, back in the box, while the screen answers keys within a second."""
    app = ChatApp({"target": str(tiny_llama), "draft": str(tiny_draft)}, max_new_tokens=8)
    text = ("lorem ipsum " * (size // 12 + 1))[:size].strip()

    async def scenario():
        async with started(app, (100, 30), 120) as pilot:
            box = app.query_one("#prompt")
            box.focus()
            box.post_message(events.Paste(text))  # a terminal's (bracketed) paste: one event
            await until(pilot, lambda: box.value, timeout=30)
            assert box.value == text
            app.simulate_key("enter")
            assert await panel_toggled(app) < 1.0
            await until(pilot, lambda: app.query(".error"), timeout=60)
            assert await panel_toggled(app) < 1.0
            error = str(app.query(".error").last().render())
            assert "the target's context is" in error and "fix: shorten the prompt" in error
            assert box.value == text and not app.conversation.messages  # nothing lost, nothing half-sent
            echo = str(app.query(".user").last().render())
            assert len(echo) < 5000 and f"{len(text):,} characters in all" in echo

    run(scenario)


def paced_app(tokenizer_folder, tmp_path, tokens: int, rate: float) -> tuple[ChatApp, PacedRuntime]:
    from transformers import AutoTokenizer

    runtime = PacedRuntime(AutoTokenizer.from_pretrained(str(tokenizer_folder)), tokens=tokens, rate=rate)
    app = ChatApp({"target": "paced"}, max_new_tokens=tokens, save_dir=tmp_path, loader=lambda **_: runtime)
    return app, runtime


def test_ctrl_q_mid_answer_asks_then_saves_the_stopped_answer_and_quits(tiny_llama, tmp_path):
    app, _ = paced_app(tiny_llama, tmp_path, tokens=200_000, rate=2000.0)  # 100 s: still streaming when asked

    async def scenario():
        async with started(app, (100, 30), 60) as pilot:
            await send(app, "Tell me everything.")
            await until(pilot, lambda: len(app.answers[0][1].text) > 20)
            await pilot.press("ctrl+q")
            assert isinstance(app.screen, QuitScreen) and app.return_code is None  # asked, not quit
            await pilot.press("escape")  # stay: the answer goes on
            assert not isinstance(app.screen, QuitScreen) and app.generating and app.return_code is None
            await pilot.press("ctrl+q")
            await pilot.press("s")  # save and quit: the answer stops, joins the conversation, is saved
            await until(pilot, lambda: app.return_code is not None, timeout=30)
            (saved,) = tmp_path.glob("hetero-sd-chat-*.md")
            answer = app.answers[0][1]
            assert answer.stopped and answer.text and app.conversation.messages[-1]["content"] == answer.text
            assert "Tell me everything." in saved.read_text() and answer.text in saved.read_text()

    run(scenario)


def test_ctrl_q_quits_at_once_only_when_nothing_would_be_lost(tiny_llama, tmp_path):
    app, _ = paced_app(tiny_llama, tmp_path, tokens=40, rate=4000.0)

    async def scenario():
        async with started(app, (100, 30), 60) as pilot:
            await send(app, "Hi.")
            await until(pilot, lambda: not app.generating)
            await pilot.press("ctrl+q")  # an answered turn not saved: asked
            assert isinstance(app.screen, QuitScreen)
            await pilot.press("escape")
            await pilot.press("ctrl+s")
            await pilot.press("ctrl+q")  # saved since: quits without a question
            await until(pilot, lambda: app.return_code is not None, timeout=10)
            assert not isinstance(app.screen, QuitScreen)

    run(scenario)
    assert len(list(tmp_path.glob("hetero-sd-chat-*.md"))) == 1


def test_ctrl_s_never_follows_a_link_or_replaces_a_file_at_the_transcripts_name(tiny_llama, tmp_path):
    app, _ = paced_app(tiny_llama, tmp_path, tokens=40, rate=4000.0)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "hetero-sd-chat-fixed.md").symlink_to(victim)  # planted at the timestamped name
    (tmp_path / "hetero-sd-chat-fixed-1.md").symlink_to(tmp_path / "made-through-a-link")  # dangling
    app.transcript_stem = lambda: "hetero-sd-chat-fixed"

    async def scenario():
        async with started(app, (100, 30), 60) as pilot:
            await send(app, "Remember this.")
            await until(pilot, lambda: not app.generating)
            await pilot.press("ctrl+s")
            await until(pilot, lambda: app.query(".note"), timeout=10)
            assert "hetero-sd-chat-fixed-2.md" in str(app.query(".note").last().render())

    run(scenario)
    assert victim.read_text() == "precious" and not (tmp_path / "made-through-a-link").exists()
    assert (tmp_path / "hetero-sd-chat-fixed.md").is_symlink() and (tmp_path / "hetero-sd-chat-fixed-1.md").is_symlink()
    saved = tmp_path / "hetero-sd-chat-fixed-2.md"
    assert not saved.is_symlink() and "Remember this." in saved.read_text()


def test_save_transcript_takes_the_next_free_name(tmp_path):
    first = save_transcript(tmp_path, "t", "one")
    (tmp_path / "t-1.md").write_text("kept")
    assert first.name == "t.md" and save_transcript(tmp_path, "t", "two").name == "t-2.md"
    assert (tmp_path / "t.md").read_text() == "one" and (tmp_path / "t-1.md").read_text() == "kept"


def test_chat_refuses_max_new_tokens_0_before_loading(capsys):
    assert main(["chat", "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "error: --max-new-tokens must be >= 1 for chat, got 0" in err and "fix: pass --max-new-tokens" in err

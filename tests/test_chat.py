"""`hetero-sd chat`: driven by Textual's Pilot, with the real default model for the end-to-end runs."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from hetero_sd.runtime import load
from hetero_sd.decoding.timeline import bars
from hetero_sd.tui import ChatApp
from hetero_sd.tui.conversation import AnswerBuilder, Baseline, Conversation, panel_text


async def until(pilot, condition, timeout: float = 300.0) -> None:
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            raise TimeoutError("the app did not get there in time")
        await pilot.pause(0.1)


def run(scenario):
    return asyncio.run(scenario())


async def ready(pilot, app, timeout: float = 300.0) -> None:
    await until(pilot, lambda: not app.query_one("#prompt").disabled, timeout)


@contextlib.asynccontextmanager
async def started(app, size: tuple[int, int], timeout: float = 300.0):
    """The app under Textual's Pilot at `size`, once its models have loaded (the prompt is enabled)."""
    async with app.run_test(size=size) as pilot:
        await ready(pilot, app, timeout)
        yield pilot


async def settings(pilot, app):
    """The settings dialog (ctrl+o), open: its screen."""
    await pilot.press("ctrl+o")
    await pilot.pause(0.2)
    return app.screen


async def ask(pilot, text: str) -> None:
    await pilot.click("#prompt")
    await pilot.press(*text, "enter")
    await pilot.pause(0.2)


def test_answer_marks_accepted_drafts_and_keeps_all_text(tiny_llama, tiny_draft):
    rt = load(str(tiny_llama), str(tiny_draft))
    builder = AnswerBuilder(rt)
    events = list(rt.stream("t5 t9 t12", max_new_tokens=20))
    for e in events:
        builder.add(e.token_ids, e.accepted)
    ids = [t for e in events for t in e.token_ids]
    assert builder.answer.text == rt.tokenizer.decode(ids, skip_special_tokens=True)
    drafts = sum(min(e.accepted or 0, len(e.token_ids)) for e in events)
    assert ("draft" in {s for _, s in builder.answer.segments}) == (drafts > 0)
    plain = builder.answer.render(show_sources=False)
    assert plain.plain == builder.answer.text and not plain.spans


def test_panel_and_transcript(tiny_llama, tiny_draft):
    rt = load(str(tiny_llama), str(tiny_draft))
    stats = rt.generate("t5 t9", max_new_tokens=12).stats
    text = panel_text(stats, rt.info, Baseline(10.0, 512), {"schedule": "sequential", "temperature": 0.0}).plain
    assert "tau" in text and "target" in text
    assert f"speedup   {stats.tokens_per_s / 10.0:.2f}x" in text  # the answer's rate over the baseline's
    assert "AR, 512 tokens, at load" in text  # which baseline it is
    assert f"answer    {stats.num_generated_tokens} tokens, done" in text  # its length, and that it ended
    streaming = panel_text(stats, rt.info, None, {}, done=False).plain
    assert f"answer    {stats.num_generated_tokens} tokens..." in streaming and "done" not in streaming
    assert bars([0, 1, 2]) == " ▄█" and bars([0.0, 0.0]) == "  "
    chat = Conversation()
    chat.ask("hello")
    assert "**user**:" in chat.markdown(rt.info) and chat.withdraw() == "hello" and not chat.messages


@pytest.mark.slow
def test_chat_streams_updates_stats_and_stops_on_escape(default_folder, tmp_path):
    app = ChatApp({"target": "default", "draft": "random"}, max_new_tokens=400, save_dir=tmp_path)

    async def scenario():
        async with started(app, (80, 24)) as pilot:
            await ask(pilot, "Tell me a long story about a dragon.")
            await until(pilot, lambda: app.answers and len(app.answers[0][1].text) > 20)
            assert "tau" in str(app.query_one("#panel").render())
            await pilot.press("escape")
            await until(pilot, lambda: not app.generating)
            reply, answer = app.answers[0]
            assert answer.stopped and answer.text
            assert app.conversation.messages[-1] == {"role": "assistant", "content": answer.text}
            assert app.last_stats.num_generated_tokens < 400
            # the partial answer stays on screen (wrapped into lines), marked as stopped
            assert reply.shown_text.split() == answer.text.split() + ["[stopped]"]
            await pilot.press("ctrl+s")
            await pilot.pause(0.2)
            saved = list(tmp_path.glob("hetero-sd-chat-*.md"))
            assert saved and answer.text in saved[0].read_text()

    run(scenario)


@pytest.mark.slow
def test_second_turn_uses_the_conversation(default_folder, tmp_path):
    app = ChatApp({"target": "default", "draft": "random"}, max_new_tokens=16, save_dir=tmp_path)

    async def scenario():
        async with started(app, (100, 30)) as pilot:
            for question in ("What is 2 plus 2?", "And times 3?"):
                await ask(pilot, question)
                await until(pilot, lambda: not app.generating)
            roles = [m["role"] for m in app.conversation.messages]
            assert roles == ["user", "assistant", "user", "assistant"]
            assert app.last_stats.num_prompt_tokens > 20  # the second prompt carries the first turn
            assert app.last_stats.num_cached_tokens > 0  # the prefix cache reused the first turn's caches

    run(scenario)


def test_a_missing_model_is_shown_in_the_app(tmp_path):
    app = ChatApp({"target": str(tmp_path / "no-such-model"), "draft": None})

    async def scenario():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.query(".error"), timeout=60)
            text = str(app.query_one(".error").render())
            assert "error" in text and "fix" in text
            assert app.query_one("#prompt").disabled

    run(scenario)


def test_the_app_warms_the_steps_before_its_first_answer(tiny_llama, tiny_draft):
    """Where a step shape costs something on its first use (Runtime.warms: captured or compiled steps; here the
    fixed-shape steps a GPU captures, said to), the app runs every shape of the caches once the models have loaded,
    before the baseline and any answer; where none does, it runs none."""
    import torch

    from hetero_sd.backends.policy import LoadPolicy

    calls = []
    for warms in (True, False):
        calls.clear()

        def loader(**kw):
            rt = load(**kw)
            real_warm, real_generate = rt.warm, rt.generate
            rt.warms = lambda: warms
            rt.warm = lambda *a: calls.append(("warm", real_warm(*a)))
            rt.generate = lambda *a, **k: calls.append(("generate",)) or real_generate(*a, **k)
            return rt

        policy = LoadPolicy(fused=False, quant=False, steps="fixed")
        app = ChatApp({"target": str(tiny_llama), "draft": str(tiny_draft), "dtype": torch.float32, "policy": policy},
                      max_new_tokens=8, loader=loader)

        async def scenario():
            async with started(app, (80, 24), 120):
                pass
        run(scenario)
        assert ("generate",) in calls
        assert (calls[0][0] == "warm" and calls[0][1] > 0) is warms, calls


def test_settings_change_temperature_and_schedule_from_the_app(tiny_llama, tiny_draft):
    from textual.widgets import Input, Select

    app = ChatApp({"target": str(tiny_llama), "draft": str(tiny_draft)}, max_new_tokens=8)

    async def scenario():
        async with started(app, (80, 24), 60) as pilot:
            screen = await settings(pilot, app)
            screen.query_one("#temperature", Input).value = "0.7"
            screen.query_one("#schedule", Select).value = "overlap"
            await pilot.click("#apply")
            await ready(pilot, app, timeout=60)
            assert app.settings["temperature"] == 0.7 and app.settings["schedule"] == "overlap"
            assert app.runtime.schedule == "overlap"  # reloaded with the new placement
            await ask(pilot, "t5 t9")
            await until(pilot, lambda: not app.generating, timeout=60)
            assert app.last_stats.schedule == "overlap"
            await pilot.press("ctrl+b")
            assert app.query_one("#panel").has_class("hidden")

    run(scenario)


def test_an_unknown_device_is_shown_in_the_app(tiny_llama):
    app = ChatApp({"target": str(tiny_llama), "draft": None, "target_device": "tpu"})

    async def scenario():
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.query(".error"), timeout=60)
            assert "unknown device 'tpu'" in str(app.query_one(".error").render())

    run(scenario)

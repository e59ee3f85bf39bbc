"""`hetero-sd chat`: a multi-turn chat that shows speculative decoding at work.

Generation runs in a worker thread and posts each verified block to the UI, so the app never freezes;
Esc stops between two blocks and keeps what was generated."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, Static

from hetero_sd.errors import HeteroSDError

from .session import Answer, AnswerBuilder, Conversation, measure_baseline, model_names, panel_text
from .settings import SettingsScreen


class Message(Static):
    DEFAULT_CSS = """
    Message { margin: 0 0 1 0; }
    Message.user { color: $text-accent; }
    Message.error { color: $text-error; }
    Message.note { color: $text-muted; }
    """


class ChatApp(App):
    TITLE = "hetero-sd chat"
    CSS = """
    #chat { width: 1fr; }
    #log { height: 1fr; padding: 0 1; }
    #panel { width: 30; border-left: solid $primary; padding: 0 1; }
    #panel.hidden { display: none; }
    #prompt { dock: bottom; }  /* only the chat box: a dialog's fields stay in their grid */
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New"),
        Binding("ctrl+s", "save", "Save"),
        Binding("ctrl+t", "toggle_sources", "Sources"),
        Binding("ctrl+b", "toggle_panel", "Panel"),
        Binding("ctrl+o", "settings", "Settings"),
        Binding("ctrl+q", "quit", "Quit"),
    ]

    def __init__(self, load_kwargs: dict, temperature: float = 0.0, max_new_tokens: int = 512,
                 save_dir: str | Path = "."):
        super().__init__()
        self.load_kwargs = dict(load_kwargs)
        self.settings = {"temperature": temperature, "schedule": load_kwargs.get("schedule", "sequential"),
                         "max_new_tokens": max_new_tokens}
        self.save_dir = Path(save_dir)
        self.runtime = None
        self.baseline_tps: float | None = None
        self.conversation = Conversation()
        self.stop_event = threading.Event()
        self.generating = False
        self.show_sources = True
        self.answers: list[tuple[Message, Answer]] = []
        self.last_stats = None
        self.load_error: str | None = None  # why the last load failed (the exit status says so if none ever loaded)
        self.ever_loaded = False

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal():
            with Vertical(id="chat"):
                yield VerticalScroll(id="log")
                yield Input(placeholder="Loading the model...", id="prompt", disabled=True)
            yield Static(id="panel")
        yield Footer()

    def on_mount(self) -> None:
        self.load_runtime()

    # --- model loading -------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="load")
    def load_runtime(self) -> None:
        from hetero_sd.runtime import load

        self.call_from_thread(self.set_ready, False, "Loading the model...")
        try:
            if self.runtime is not None:
                self.runtime.close()
            self.runtime = None
            self.runtime = load(**self.load_kwargs)
            self.runtime.prefix_cache = True  # a new turn reuses the caches of the conversation so far
        except Exception as e:  # any failure is shown in the app; the user can change settings or quit
            problem, fix = ((e.problem, e.fix) if isinstance(e, HeteroSDError) else
                            (f"{type(e).__name__}: {e}", "check the model settings (ctrl+o)"))
            self.load_error = problem
            self.call_from_thread(self.say, f"error: {problem}\nfix: {fix}", "error")
            self.call_from_thread(self.set_ready, False, "Fix the model settings (ctrl+o) or quit (ctrl+q)")
            return
        self.ever_loaded, self.load_error = True, None
        self.sub_title = model_names(self.runtime.info)
        for note in self.runtime.notes:
            self.call_from_thread(self.say, f"note: {note}", "note")
        self.call_from_thread(self.refresh_panel)
        self.baseline_tps = measure_baseline(self.runtime)
        self.call_from_thread(self.refresh_panel)
        self.call_from_thread(self.set_ready, True, "Ask something (Enter to send)")

    def set_ready(self, ready: bool, placeholder: str) -> None:
        box = self.query_one("#prompt", Input)
        box.disabled, box.placeholder = not ready, placeholder
        if ready:
            box.focus()

    # --- chatting ------------------------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "prompt":  # Enter in another field (a dialog's) is never a chat turn
            return
        text = event.value.strip()
        if not text or self.generating or self.runtime is None:
            return
        event.input.value = ""
        self.say(f"you: {text}", "user")
        reply = Message("")
        self.query_one("#log").mount(reply)
        answer = Answer()
        self.answers.append((reply, answer))
        self.generating = True
        self.stop_event.clear()
        self.generate(self.conversation.ask(text), reply, answer)

    @work(thread=True, exclusive=True, group="generate")
    def generate(self, messages: list[dict], reply: Message, answer: Answer) -> None:
        builder = AnswerBuilder(self.runtime)
        builder.answer = answer
        try:
            for event in self.runtime.stream(messages, temperature=self.settings["temperature"],
                                             max_new_tokens=self.settings["max_new_tokens"],
                                             schedule=self.settings["schedule"]):
                builder.add(event.token_ids, event.accepted)
                self.call_from_thread(self.show_progress, reply, answer, event.stats)
                if self.stop_event.is_set():
                    answer.stopped = True
                    break
        except Exception as e:  # never lose the conversation to an error in one answer
            self.call_from_thread(self.failed, reply, e)
            return
        self.call_from_thread(self.finished, reply, answer)

    def show_progress(self, reply: Message, answer: Answer, stats) -> None:
        reply.update(answer.render(self.show_sources))
        self.last_stats = stats
        self.refresh_panel()
        self.query_one("#log").scroll_end(animate=False)

    def finished(self, reply: Message, answer: Answer) -> None:
        reply.update(answer.render(self.show_sources))
        self.conversation.answered(answer)
        self.generating = False
        if self.last_stats is not None:
            for note in self.last_stats.notes:
                if note not in self.runtime.notes:
                    self.say(f"note: {note}", "note")

    def failed(self, reply: Message, error: Exception) -> None:
        reply.remove()
        self.answers.pop()
        question = self.conversation.withdraw()
        problem, fix = ((error.problem, error.fix) if isinstance(error, HeteroSDError) else
                        (f"the answer failed ({type(error).__name__}: {error})",
                         "change the settings (ctrl+o) and send again; the conversation is kept"))
        self.say(f"error: {problem}\nfix: {fix}", "error")
        box = self.query_one("#prompt", Input)
        box.value = box.value or question  # nothing the user typed is lost
        self.generating = False

    def say(self, text: str, kind: str) -> None:
        log = self.query_one("#log")
        log.mount(Message(text, classes=kind))
        log.scroll_end(animate=False)

    def refresh_panel(self) -> None:
        info = self.runtime.info if self.runtime else {}
        self.query_one("#panel", Static).update(panel_text(self.last_stats, info, self.baseline_tps, self.settings))

    # --- keys ----------------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating:
            self.stop_event.set()

    def action_new_chat(self) -> None:
        if self.generating:
            self.stop_event.set()
            self.notify("Stop the answer first (Esc)")
            return
        self.conversation = Conversation()
        self.answers.clear()
        self.query_one("#log").remove_children()
        self.last_stats = None
        self.refresh_panel()

    def action_save(self) -> None:
        """Write the transcript; a folder that cannot be written is reported in the app, and the
        conversation stays as it is (save again after fixing it)."""
        path = (self.save_dir / time.strftime("hetero-sd-chat-%Y%m%d-%H%M%S.md")).absolute()
        try:
            path.write_text(self.conversation.markdown(self.runtime.info if self.runtime else {}))
        except OSError as e:
            self.say(f"error: cannot save the conversation to {path} ({e.strerror or e})\n"
                     "fix: start hetero-sd chat with --save-dir set to a folder you can write to; "
                     "the conversation is kept here", "error")
            self.notify(f"not saved: {e.strerror or e}", severity="error")
            return
        self.say(f"saved {path}", "note")
        self.notify(f"saved {path}")

    def action_toggle_sources(self) -> None:
        self.show_sources = not self.show_sources
        for reply, answer in self.answers:
            reply.update(answer.render(self.show_sources))
        self.notify("accepted draft tokens " + ("in green" if self.show_sources else "not marked"))

    def action_toggle_panel(self) -> None:
        self.query_one("#panel").toggle_class("hidden")

    def action_settings(self) -> None:
        if self.generating:
            self.notify("Stop the answer first (Esc)")
            return
        self.push_screen(SettingsScreen(self.load_kwargs, self.settings), self.apply_settings)

    def apply_settings(self, changed: dict | None) -> None:
        if not changed:
            return
        self.settings.update(temperature=changed["temperature"], schedule=changed["schedule"])
        reload = any(self.load_kwargs.get(k) != changed[k] for k in ("target_device", "draft_device", "draft", "schedule"))
        self.load_kwargs.update({k: changed[k] for k in ("target_device", "draft_device", "draft", "schedule")})
        self.refresh_panel()
        if reload:
            self.load_runtime()

"""`hetero-sd chat`: a multi-turn chat that shows speculative decoding at work.

All model work (loading, the baseline, every answer) runs on one engine thread, the only thread that runs
torch: each thread that runs torch CPU work owns an OpenMP team, and a second team on the same cores
throttles both (the default target on a 2-core CPU: ~240 tok/s from a second thread against ~970 from
the one that loaded it). The engine never waits for the screen: each verified block goes into a queue
(a put, never blocking), and a timer drains it FPS times a second, appending the new text to the answer
(one chunk re-wrapped, `answer_view.py`) and refreshing the panel PANEL_HZ times a second. The engine runs
at its own speed whatever the tokens per second, and its stats' clock is the one the panel shows. Esc
stops between two blocks and keeps what was generated."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer, Header, Input, Static

from hetero_sd.errors import HeteroSDError

from .answer_view import AnswerView
from .quit import QuitScreen
from .conversation import (Answer, AnswerBuilder, Baseline, Conversation, measure_baseline, model_names, panel_text,
                      save_transcript)
from .settings import SettingsScreen

FPS = 5  # screen updates per second while an answer streams (each one takes the GIL from the engine)
PANEL_HZ = 2  # panel updates per second (its charts walk every step so far)
FRAME_CHARS = 32768  # characters of new text a frame shows at most (wrapping them takes ~30 ms)
SHOWN_QUESTION = 4000  # characters of a question echoed in the chat (all of it is sent and saved)


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
    #log { height: 1fr; padding: 0 1; overflow-y: scroll; }  /* its scrollbar from the start: one appearing mid-answer re-lays out the chat */
    #panel { width: 30; height: 1fr; border-left: solid $primary; padding: 0 1; }  /* fixed: repainted, never re-laid out */
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
                 save_dir: str | Path = ".", loader=None):
        super().__init__()
        self.load_kwargs = dict(load_kwargs)
        self.loader = loader  # load(**load_kwargs) -> Runtime; hetero_sd.runtime.load unless given
        self.settings = {"temperature": temperature, "schedule": load_kwargs.get("schedule", "sequential"),
                         "max_new_tokens": max_new_tokens}
        self.save_dir = Path(save_dir)
        self.runtime = None
        self.baseline: Baseline | None = None
        self.conversation = Conversation()
        self.saved_messages = 0  # messages of the conversation in the last saved transcript
        self.stop_event = threading.Event()
        self.generating = False
        self.quitting: str | None = None  # "save" or "quit" once the streaming answer has stopped
        self.show_sources = True
        self.answers: list[tuple[AnswerView, Answer]] = []
        self.engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetero-sd-chat-engine")
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # (view, segments | Answer | Exception, stats)
        self.backlog: list = []  # taken from the inbox, not yet shown
        self.panel_at = 0.0
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
        self.query_one("#log").anchor()  # follows the answer until the user scrolls up
        self.set_interval(1 / FPS, self.drain)
        self.load_runtime()

    def on_unmount(self) -> None:
        self.stop_event.set()  # an answer still running ends at its next block; nothing new starts
        self.engine.shutdown(wait=False, cancel_futures=True)

    # --- model loading -------------------------------------------------------------------------

    def load_runtime(self) -> None:
        self.engine.submit(self.load_on_engine)

    def load_on_engine(self) -> None:
        from hetero_sd.runtime import load

        ui = self.post_ui
        ui(self.set_ready, False, "Loading the model...")
        try:
            if self.runtime is not None:
                self.runtime.close()
            self.runtime = self.baseline = None
            self.runtime = (self.loader or load)(**self.load_kwargs)
            ui(self.refresh_panel)
            if self.runtime.warms():  # every step shape of the context, here rather than inside the first answers
                ui(self.set_ready, False, "Warming the steps up (each shape captured or compiled once)...")
                self.runtime.warm()
            # before the prefix cache is on: the baseline's prompt is computed, as a first question's is
            self.baseline = measure_baseline(self.runtime, self.settings["max_new_tokens"])
            self.runtime.prefix_cache = True  # a new turn reuses the caches of the conversation so far
        except Exception as e:  # any failure is shown in the app; the user can change settings or quit
            problem, fix = ((e.problem, e.fix) if isinstance(e, HeteroSDError) else
                            (f"{type(e).__name__}: {e}", "check the model settings (ctrl+o)"))
            self.load_error = problem
            ui(self.say, f"error: {problem}\nfix: {fix}", "error")
            ui(self.set_ready, False, "Fix the model settings (ctrl+o) or quit (ctrl+q)")
            return
        self.ever_loaded, self.load_error = True, None
        ui(setattr, self, "sub_title", model_names(self.runtime.info))
        for note in self.runtime.notes:
            ui(self.say, f"note: {note}", "note")
        ui(self.refresh_panel)
        ui(self.set_ready, True, "Ask something (Enter to send)")

    def post_ui(self, call, *args) -> None:
        """From the engine thread: run call(*args) on the UI's next frame, in order, without waiting."""
        self.inbox.put((None, call, args))

    def set_ready(self, ready: bool, placeholder: str) -> None:
        box = self.query_one("#prompt", Input)
        box.disabled, box.placeholder = not ready, placeholder
        if ready:
            box.focus()

    # --- chatting ------------------------------------------------------------------------------

    async def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id != "prompt":  # Enter in another field (a dialog's) is never a chat turn
            return
        text = event.value.strip()
        if not text or self.generating or self.runtime is None or self.quitting:
            return
        self.streaming(True)
        event.input.value = ""
        # a long question (a paste) is echoed in part: rendering a megabyte would stall the screen; it is
        # sent whole, and tokenized and checked against the context in the worker, off the UI thread
        shown = text if len(text) <= SHOWN_QUESTION else (
            f"{text[:SHOWN_QUESTION]}… ({len(text):,} characters in all, sent whole)")
        reply, answer = AnswerView(self.show_sources), Answer()
        await self.query_one("#log").mount_all([Message(f"you: {shown}", classes="user", markup=False), reply])
        self.answers.append((reply, answer))
        self.stop_event.clear()
        # the engine starts once the question is on screen: laying it out and drawing it do not compete
        # with the answer's first steps for the cores and the GIL
        self.call_after_refresh(self.engine.submit, self.generate, self.conversation.ask(text), reply, answer)

    def generate(self, messages: list[dict], reply: AnswerView, answer: Answer) -> None:
        """Runs the answer (its segments grow in `answer`); hands each block to the UI through `inbox`
        without waiting for it."""
        builder = AnswerBuilder(self.runtime)
        builder.answer = answer
        post = self.inbox.put
        try:
            for event in self.runtime.stream(messages, temperature=self.settings["temperature"],
                                             max_new_tokens=self.settings["max_new_tokens"],
                                             schedule=self.settings["schedule"]):
                post((reply, builder.add(event.token_ids, event.accepted), event.stats))
                if self.stop_event.is_set():
                    builder.answer.stopped = True
                    break
        except Exception as e:  # never lose the conversation to an error in one answer
            post((reply, e, None))
            return
        post((reply, builder.answer, None))

    def drain(self) -> None:
        """What the engine posted since the last frame, in order, up to FRAME_CHARS of new text (the rest
        waits for the next frames, so a flood of text never stalls the screen): text appended per answer,
        an answer's end, calls from the engine thread; then the panel."""
        while True:
            try:
                self.backlog.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        new: dict[AnswerView, list] = {}
        budget, taken, ended = FRAME_CHARS, 0, False
        while taken < len(self.backlog) and budget > 0:
            reply, item, extra = self.backlog[taken]
            taken += 1
            if isinstance(item, list):
                new.setdefault(reply, []).extend(item)
                budget -= sum(len(text) for text, _ in item)
                self.last_stats = extra
                continue
            self.show(new)  # what came before this event is on screen first
            new = {}
            if reply is None:
                item(*extra)
            else:
                (self.finished if isinstance(item, Answer) else self.failed)(reply, item)
                ended = True
        del self.backlog[:taken]
        self.show(new)
        if ended or (new and time.monotonic() - self.panel_at >= 1 / PANEL_HZ):
            self.refresh_panel()

    @staticmethod
    def show(new: dict) -> None:
        for reply, segments in new.items():
            reply.append(segments)

    def finished(self, reply: AnswerView, answer: Answer) -> None:
        reply.finish(answer.stopped)
        self.conversation.answered(answer)
        self.streaming(False)
        if self.last_stats is not None:
            for note in self.last_stats.notes:
                if note not in self.runtime.notes:
                    self.say(f"note: {note}", "note")
        if self.quitting:
            self.quit_now(self.quitting)

    def failed(self, reply: AnswerView, error: Exception) -> None:
        reply.remove()
        self.answers.pop()
        question = self.conversation.withdraw()
        problem, fix = ((error.problem, error.fix) if isinstance(error, HeteroSDError) else
                        (f"the answer failed ({type(error).__name__}: {error})",
                         "change the settings (ctrl+o) and send again; the conversation is kept"))
        self.say(f"error: {problem}\nfix: {fix}", "error")
        box = self.query_one("#prompt", Input)
        if not box.value:  # nothing the user typed is lost: the question comes back, the cursor after it
            box.value, box.cursor_position = question, len(question)
        self.streaming(False)
        if self.quitting:
            self.quit_now(self.quitting)

    def streaming(self, on: bool) -> None:
        """An answer starts or ends. While it streams the chat box's cursor does not blink: each blink
        repaints the box, and every repaint takes the GIL from the engine."""
        self.generating = on
        self.query_one("#prompt", Input).cursor_blink = not on

    def say(self, text: str, kind: str) -> None:
        self.query_one("#log").mount(Message(text, classes=kind, markup=False))  # typed text is never markup

    def refresh_panel(self) -> None:
        self.panel_at = time.monotonic()
        info = self.runtime.info if self.runtime else {}
        panel = panel_text(self.last_stats, info, self.baseline, self.settings, done=not self.generating)
        self.query_one("#panel", Static).update(panel, layout=False)  # a fixed column: no layout to redo

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

    def transcript_stem(self) -> str:
        return time.strftime("hetero-sd-chat-%Y%m%d-%H%M%S")

    def action_save(self) -> bool:
        """Write the transcript to a new file (never over an existing file or through a link); a folder
        that cannot be written is reported in the app, and the conversation stays as it is (save again
        after fixing it). An answer still streaming is not in it yet (it joins the conversation when it ends)."""
        folder = self.save_dir.absolute()
        try:
            path = save_transcript(folder, self.transcript_stem(),
                                   self.conversation.markdown(self.runtime.info if self.runtime else {}))
        except OSError as e:
            self.say(f"error: cannot save the conversation in {folder} ({e.strerror or e})\n"
                     "fix: start hetero-sd chat with --save-dir set to a folder you can write to; "
                     "the conversation is kept here", "error")
            self.notify(f"not saved: {e.strerror or e}", severity="error")
            return False
        self.saved_messages = len(self.conversation.messages)
        self.say(f"saved {path}", "note")
        self.notify(f"saved {path}")
        return True

    async def action_quit(self) -> None:
        """Quit at once when nothing would be lost; otherwise ask (save and quit, quit, or stay)."""
        if isinstance(self.screen, QuitScreen) or self.quitting:
            return
        unsaved = len(self.conversation.messages) > self.saved_messages
        if not self.generating and not unsaved:
            self.exit()
            return
        reason = "An answer is still streaming" if self.generating else "The conversation has unsaved turns"
        self.push_screen(QuitScreen(reason), self.quit_chosen)

    def quit_chosen(self, choice: str | None) -> None:
        if choice is None:
            return
        if self.generating:  # stop the answer first; it ends in the conversation, then we save and quit
            self.quitting = choice
            self.stop_event.set()
            self.notify("stopping the answer, then quitting")
            return
        self.quit_now(choice)

    def quit_now(self, choice: str) -> None:
        self.quitting = None
        if choice == "save" and not self.action_save():
            return  # not saved: the app stays, with the error shown
        self.exit()

    def action_toggle_sources(self) -> None:
        self.show_sources = not self.show_sources
        for reply, _ in self.answers:
            reply.set_sources(self.show_sources)
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

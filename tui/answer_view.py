"""An answer on screen, appended to as it streams, with a cost per frame that does not grow with its length.

One widget of the Line API (as Textual's own Log): the text is kept as chunks of at most CHUNK characters,
each wrapped into lines once, when it is sealed; new text goes into the last (live) chunk, the only one
wrapped again on the next frame. The screen asks only for the lines in view, and the layout sees one widget
of a known height, so an 8k-token or a 1 MB answer streams as smoothly as a short one. A change of width
(a resized terminal, the panel shown or hidden) wraps every chunk again, once."""

from __future__ import annotations

from rich.text import Text
from textual.geometry import Size
from textual.strip import Strip
from textual.widget import Widget

from .session import Segment, chunked, styled

CHUNK = 2048


class AnswerView(Widget):
    DEFAULT_CSS = """
    AnswerView { height: auto; margin: 0 0 1 0; }
    """

    def __init__(self, show_sources: bool):
        super().__init__()
        self.show_sources = show_sources
        self.chunks: list[list[Segment]] = [[]]  # the last one is live; the others are sealed
        self.tail_chars = 0
        self.stopped = False
        self.width = 0  # the width the lines below were wrapped at (0: not laid out yet)
        self.sealed_lines: list[Strip] = []
        self.live_lines: list[Strip] = []

    def append(self, segments: list[Segment]) -> None:
        """Add text at the end: the chunks it fills are sealed (wrapped once) and the live one re-wrapped."""
        if not segments:
            return
        self.chunks[-1] += segments
        self.tail_chars += sum(len(text) for text, _ in segments)
        if self.tail_chars > CHUNK:
            new = chunked(self.chunks[-1], CHUNK)
            self.chunks[-1:] = new
            self.tail_chars = sum(len(text) for text, _ in new[-1])
            if self.width:
                self.sealed_lines += [line for chunk in new[:-1] for line in self.wrap(chunk, live=False)]
        self.update_live()

    def finish(self, stopped: bool) -> None:
        self.stopped = stopped
        self.update_live()

    def update_live(self) -> None:
        height = self.line_count
        if self.width:
            self.live_lines = self.wrap(self.chunks[-1], live=True)
        self.refresh(layout=self.line_count != height or not self.width)

    def set_sources(self, show_sources: bool) -> None:
        """Re-render every chunk with or without the draft tokens marked (the whole answer, once)."""
        self.show_sources = show_sources
        self.rewrap(self.width)
        self.refresh()

    # --- the Line API ---------------------------------------------------------------------------

    def wrap(self, segments: list[Segment], live: bool) -> list[Strip]:
        text = styled(segments, self.show_sources)
        if not live and text.plain.endswith("\n"):
            text.right_crop(1)  # the next chunk starts on its own line
        elif live and self.stopped:
            text.append("  [stopped]", "italic dim")
        if not text.plain:
            return []
        console = self.app.console
        lines = console.render_lines(text, console.options.update_width(self.width), pad=False)
        return [Strip(line) for line in lines]

    def rewrap(self, width: int) -> None:
        self.width = width
        self.sealed_lines = [line for chunk in self.chunks[:-1] for line in self.wrap(chunk, live=False)]
        self.live_lines = self.wrap(self.chunks[-1], live=True)

    @property
    def line_count(self) -> int:
        return len(self.sealed_lines) + len(self.live_lines)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if width != self.width and width > 0:
            self.rewrap(width)
        return self.line_count

    def render_line(self, y: int) -> Strip:
        style = self.rich_style
        width = self.size.width
        if width != self.width and width > 0:
            self.rewrap(width)
        sealed = len(self.sealed_lines)
        lines = self.sealed_lines if y < sealed else self.live_lines
        y = y if y < sealed else y - sealed
        if y >= len(lines):
            return Strip.blank(width, style)
        return lines[y].apply_style(style).crop_extend(0, width, style)

    @property
    def shown_text(self) -> str:
        """What the screen holds, as plain text (line by line)."""
        return "\n".join(line.text for line in self.sealed_lines + self.live_lines)

"""An answer on screen, appended to as it streams, with a cost per frame that does not grow with its length.

One widget of the Line API (as Textual's own Log): the text is kept as chunks, each wrapped into lines once,
when it is sealed. A chunk is sealed as soon as its line is complete (at each newline), or when the line
being written passes CHUNK characters (cut at a space); only the last, live chunk (the line being written)
is wrapped again on the next frame. The screen asks only for the lines in view, and the layout sees one
widget of a known height, so an 8k-token or a 1 MB answer streams as smoothly as a short one. A change of
width (a resized terminal, the panel shown or hidden) wraps every chunk again, once."""

from __future__ import annotations

from rich.style import Style
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.widget import Widget

from .conversation import Segment, chunked, split_segments, styled

CHUNK = 1024


class AnswerView(Widget):
    DEFAULT_CSS = """
    AnswerView { height: auto; margin: 0 0 1 0; }
    """

    def __init__(self, show_sources: bool):
        super().__init__()
        self.show_sources = show_sources
        self.chunks: list[list[Segment]] = [[]]  # the last one is live; the others are sealed
        self.stopped = False
        self.width = 0  # the width the lines below were wrapped at (0: not laid out yet)
        self.sealed_lines: list[Strip] = []
        self.live_lines: list[Strip] = []
        self.shown: dict[int, Strip] = {}  # sealed lines as drawn (base style, width), by row
        self.base: Style | None = None  # the widget's style (from CSS), kept until the styles change

    def append(self, segments: list[Segment]) -> None:
        """Add text at the end: complete lines (and a line past CHUNK characters) are sealed and wrapped
        once; the line being written is wrapped again."""
        if not segments:
            return
        height, start = self.line_count, len(self.sealed_lines)
        live = self.chunks[-1] + segments
        text = "".join(t for t, _ in live)
        sealed = []
        if (cut := text.rfind("\n") + 1) > 0:
            head, live = split_segments(live, cut)
            sealed.append(head)
            text = text[cut:]
        if len(text) > CHUNK:
            *more, live = chunked(live, CHUNK)
            sealed += more
        self.chunks[-1:] = sealed + [live]
        if self.width:
            self.sealed_lines += [line for chunk in sealed for line in self.wrap(chunk, live=False)]
        self.update_live(height, start)

    def finish(self, stopped: bool) -> None:
        self.stopped = stopped
        self.update_live(self.line_count, len(self.sealed_lines))

    def update_live(self, height: int, start: int) -> None:
        """Wrap the line being written again. Rows from `start` on changed: a new height is a layout,
        else those rows are repainted."""
        if self.width:
            self.live_lines = self.wrap(self.chunks[-1], live=True)
        if self.line_count != height or not self.width:
            self.refresh(layout=True)
        else:
            self.refresh(Region(0, start, self.width, self.line_count - start))

    def set_sources(self, show_sources: bool) -> None:
        """Re-render every chunk with or without the draft tokens marked (the whole answer, once)."""
        self.show_sources = show_sources
        self.rewrap(self.width)
        self.refresh()

    # --- the Line API ---------------------------------------------------------------------------

    def wrap(self, segments: list[Segment], live: bool) -> list[Strip]:
        """A sealed chunk ends with its newline (dropped: the next chunk starts on its own line), so an
        empty one is a blank line; an empty live chunk has no line yet."""
        text = styled(segments, self.show_sources)
        if not live and text.plain.endswith("\n"):
            text.right_crop(1)
        elif live and self.stopped:
            text.append("  [stopped]", "italic dim")
        if live and not text.plain:
            return []
        console = self.app.console
        return [Strip(line) for line in console.render_lines(text, console.options.update_width(self.width), pad=False)]

    def rewrap(self, width: int) -> None:
        self.width = width
        self.shown.clear()
        self.sealed_lines = [line for chunk in self.chunks[:-1] for line in self.wrap(chunk, live=False)]
        self.live_lines = self.wrap(self.chunks[-1], live=True)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self.base = None
        self.shown.clear()

    @property
    def line_count(self) -> int:
        return len(self.sealed_lines) + len(self.live_lines)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if width != self.width and width > 0:
            self.rewrap(width)
        return self.line_count

    def render_line(self, y: int) -> Strip:
        if self.base is None:
            self.base = self.rich_style
        width = self.size.width
        if width != self.width and width > 0:
            self.rewrap(width)
        if y in self.shown:
            return self.shown[y]
        sealed = len(self.sealed_lines)
        if y >= self.line_count:
            return Strip.blank(width, self.base)
        line = (self.sealed_lines[y] if y < sealed else self.live_lines[y - sealed])
        line = line.apply_style(self.base).crop_extend(0, width, self.base)
        if y < sealed:
            self.shown[y] = line
        return line

    @property
    def shown_text(self) -> str:
        """What the screen holds, as plain text (line by line)."""
        return "\n".join(line.text for line in self.sealed_lines + self.live_lines)

"""Stop strings over streamed text: a stop string may arrive split across tokens (and steps), so text
that could be the start of one is held back until the next piece shows whether it is."""

from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # text received but not yet released
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    def feed(self, text: str) -> str:
        """Add new text; return what is safe to send now. After a stop string: nothing more (the stop
        string itself is not sent, as in OpenAI's API)."""
        if self.stopped:
            return ""
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out
        hits = [(at, s) for s in self.stops if (at := self.held.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits)  # the earliest stop string in the text
            self.stopped = True
            out, self.held = self.held[:at], ""
            return out
        keep = self.partial_suffix()
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def partial_suffix(self) -> int:
        """Length of the longest tail of the held text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), best, -1):
                if self.held.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of generation: what was held back was not a stop string after all."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

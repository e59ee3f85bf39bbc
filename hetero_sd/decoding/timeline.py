"""What each device did when: spans of work per lane, their overlap, and a Chrome trace of them.

A lane is one device worker (the target's or the draft's). Spans are recorded by the lane itself, so
the timeline shows when a device actually ran a job, not when the loop asked for it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Span:
    lane: str  # "target" or "draft"
    name: str  # prefill, verify, draft, predraft, context, decode
    start: float  # seconds since the timeline began
    end: float
    request: int = 0  # which request (pipelined schedules run two)
    step: int = 0


@dataclass
class Timeline:
    origin: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)  # lane -> device name, for the trace
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, lane: str, name: str, began: float, ended: float, request: int = 0, step: int = 0) -> None:
        with self.lock:
            self.spans.append(Span(lane, name, began - self.origin, ended - self.origin, request, step))

    def busy_s(self, lane: str) -> float:
        return sum(s.end - s.start for s in self.spans if s.lane == lane)

    def wall_s(self) -> float:
        return max((s.end for s in self.spans), default=0.0) - min((s.start for s in self.spans), default=0.0)

    def concurrent_s(self) -> float:
        """Seconds during which the target lane and the draft lane were both busy."""
        return overlap_of(merged(self.spans, "target"), merged(self.spans, "draft"))

    @property
    def overlap_fraction(self) -> float:
        """Share of the draft device's busy time hidden behind the target's (0 when run one after another)."""
        return overlap_fraction([self])

    def summary(self) -> dict:
        wall = self.wall_s()
        return {"wall_s": wall, "target_busy_s": self.busy_s("target"), "draft_busy_s": self.busy_s("draft"),
                "concurrent_s": self.concurrent_s(), "overlap_fraction": self.overlap_fraction,
                "target_utilisation": self.busy_s("target") / wall if wall else 0.0,
                "draft_utilisation": self.busy_s("draft") / wall if wall else 0.0}

    def sparkline(self, lane: str, width: int = 40) -> list[float]:
        """Busy fraction of `lane` in `width` equal slices of the wall time (for the terminal UI)."""
        if not self.spans:
            return [0.0] * width
        t0 = min(s.start for s in self.spans)
        slice_s = max(self.wall_s(), 1e-9) / width
        busy = [0.0] * width
        for a, b in merged(self.spans, lane):
            for i in range(int((a - t0) / slice_s), min(int((b - t0) / slice_s) + 1, width)):
                lo, hi = t0 + i * slice_s, t0 + (i + 1) * slice_s
                busy[i] += max(0.0, min(b, hi) - max(a, lo)) / slice_s
        return [min(x, 1.0) for x in busy]


BARS = " ▁▂▃▄▅▆▇█"


def overlap_fraction(timelines) -> float:
    """Share of the draft lanes' busy time hidden behind the target's, pooled over timelines."""
    draft = sum(t.busy_s("draft") for t in timelines)
    return sum(t.concurrent_s() for t in timelines) / draft if draft > 0 else 0.0


def bars(values: list[float], top: float | None = None) -> str:
    """A one-line bar chart of non-negative values."""
    top = top if top is not None else max(values, default=0.0)
    if top <= 0:
        return BARS[0] * len(values)
    return "".join(BARS[min(len(BARS) - 1, round(v / top * (len(BARS) - 1)))] for v in values)


def merged(spans: list[Span], lane: str) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s in sorted((s for s in spans if s.lane == lane), key=lambda s: s.start):
        if out and s.start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], s.end)
        else:
            out.append([s.start, s.end])
    return [(a, b) for a, b in out]


def overlap_of(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def chrome_trace(timelines: list[tuple[str, Timeline]]) -> dict:
    """Chrome/Perfetto trace: one process per labelled timeline, one thread row per lane."""
    events = []
    for pid, (label, tl) in enumerate(timelines, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        for tid, lane in enumerate(("target", "draft"), start=1):
            device = tl.devices.get(lane, "")
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": f"{lane} ({device})" if device else lane}})
        for s in tl.spans:
            events.append({"ph": "X", "name": s.name, "pid": pid, "tid": 1 if s.lane == "target" else 2,
                           "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6,
                           "args": {"request": s.request, "step": s.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}

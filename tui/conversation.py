"""What the chat app shows, kept apart from Textual so it can be tested on its own: the conversation,
which tokens came from accepted drafts, the transcript, and the side panel's figures."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rich.text import Text

from hetero_sd.runtime import Runtime, TextStream
from hetero_sd.decoding.stats import Stats
from hetero_sd.decoding.timeline import bars

BASELINE_PROMPT = "Describe a lighthouse in two sentences."
BASELINE_TOKENS = 512  # at most; an answer of the app's default length is compared with a baseline as long
BASELINE_SECONDS = 3.0  # and at most this long (a slow target stops earlier: the rate is per token)
DRAFT_STYLE = "bold green"
Segment = tuple[str, str]  # (text, source): "draft" or "target"


@dataclass
class Answer:
    """An assistant reply as segments of (text, source): "draft" for accepted draft tokens, "target"
    for tokens the target produced itself (prefill token, corrections, bonus tokens)."""

    segments: list[tuple[str, str]] = field(default_factory=list)
    stopped: bool = False

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)

    def render(self, show_sources: bool) -> Text:
        out = styled(self.segments, show_sources)
        if self.stopped:
            out.append("  [stopped]", "italic dim")
        return out


class AnswerBuilder:
    """Turns stream events into answer segments; text is decoded incrementally (never half a character)."""

    def __init__(self, runtime: Runtime):
        self.stream, self.answer = TextStream(runtime.tokenizer), Answer()

    def add(self, token_ids: list[int], accepted: int | None) -> list[Segment]:
        """The step's new segments (also kept in `answer`)."""
        drafted = min(accepted or 0, len(token_ids))
        new = []
        for ids, source in ((token_ids[:drafted], "draft"), (token_ids[drafted:], "target")):
            piece = self.stream.add(ids) if ids else ""
            if piece:
                new.append((piece, source))
        self.answer.segments += new
        return new


def styled(segments: list[Segment], show_sources: bool) -> Text:
    out = Text()
    for text, source in segments:
        out.append(text, DRAFT_STYLE if show_sources and source == "draft" else "")
    return out


def split_segments(segments: list[Segment], at: int) -> tuple[list[Segment], list[Segment]]:
    """The segments' first `at` characters and the rest, each keeping its source."""
    head, rest, seen = [], [], 0
    for text, source in segments:
        if seen >= at:
            rest.append((text, source))
        elif seen + len(text) <= at:
            head.append((text, source))
        else:
            head.append((text[:at - seen], source))
            rest.append((text[at - seen:], source))
        seen += len(text)
    return head, rest


def chunked(segments: list[Segment], limit: int) -> list[list[Segment]]:
    """The segments as chunks of at most `limit` characters, each ending after its last newline, else its
    last space, else at the limit (a line with neither is cut anywhere); sources are kept. Linear in the
    text's length, whatever the number of chunks."""
    text = "".join(t for t, _ in segments)
    cuts, start = [], 0
    while len(text) - start > limit:
        start += cut_point(text[start:start + limit], limit)
        cuts.append(start)
    chunks: list[list[Segment]] = [[]]
    seen = 0
    for piece, source in segments:
        end = seen + len(piece)
        while len(chunks) <= len(cuts) and cuts[len(chunks) - 1] < end:
            at = cuts[len(chunks) - 1] - seen
            if at > 0:
                chunks[-1].append((piece[:at], source))
            piece, seen = piece[at:], seen + at
            chunks.append([])
        if piece:
            chunks[-1].append((piece, source))
        seen = end
    return chunks


def cut_point(text: str, limit: int) -> int:
    """Where a chunk of at most `limit` characters ends: after its last newline, else its last space,
    else at the limit."""
    for sep in ("\n", " "):
        at = text.rfind(sep, 0, limit)
        if at > 0:
            return at + 1
    return limit


@dataclass
class Conversation:
    messages: list[dict] = field(default_factory=list)

    def ask(self, text: str) -> list[dict]:
        self.messages.append({"role": "user", "content": text})
        return list(self.messages)

    def answered(self, answer: Answer) -> None:
        self.messages.append({"role": "assistant", "content": answer.text})

    def withdraw(self) -> str:
        """Take back the last question (its answer failed), returning its text."""
        return self.messages.pop()["content"] if self.messages and self.messages[-1]["role"] == "user" else ""

    def markdown(self, info: dict) -> str:
        lines = ["# hetero-sd chat", "",
                 f"target: `{info.get('target')}` on {info.get('target_device')}; "
                 f"draft: `{info.get('draft')}` on {info.get('draft_device')}", ""]
        for m in self.messages:
            lines += [f"**{m['role']}**:", "", m["content"], ""]
        return "\n".join(lines)


@dataclass
class Baseline:
    """The speedup's denominator: autoregressive tokens/s of the loaded target, on the engine's own clock
    (`Stats.tokens_per_s`, prefill included, as every answer's tok/s is)."""

    tokens_per_s: float
    tokens: int

    def describe(self) -> str:
        return f"AR, {self.tokens} tokens, at load"


def measure_baseline(runtime: Runtime, max_new_tokens: int = BASELINE_TOKENS) -> Baseline:
    """The loaded target alone (no draft) on a fixed chat prompt, after a 4-token warm-up: as many tokens as
    an answer may have (up to BASELINE_TOKENS), or what BASELINE_SECONDS allow on a slow target."""
    runtime.generate(BASELINE_PROMPT, max_new_tokens=4, speculative=False)  # warm-up: first calls allocate
    prompt_ids, _ = runtime.encode(BASELINE_PROMPT)
    room = runtime.target.max_context - len(prompt_ids) - 1  # a small target's context bounds the baseline too
    events = runtime.stream(BASELINE_PROMPT, max_new_tokens=max(1, min(max_new_tokens, BASELINE_TOKENS, room)),
                            speculative=False, stop_at_eos=False)
    try:
        for event in events:
            if event.stats.total_s > BASELINE_SECONDS:
                break
    finally:
        events.close()  # a baseline cut short gives its caches back now
    return Baseline(event.stats.tokens_per_s, event.stats.num_generated_tokens)


def save_transcript(folder: Path, stem: str, text: str) -> Path:
    """Write `text` to a new file `stem.md` in `folder` (or `stem-1.md`, ... where that name is taken). The
    file is created with O_EXCL | O_NOFOLLOW: an existing file or link at the name is never followed,
    truncated or replaced, whoever put it there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for n in range(1000):
        path = folder / (f"{stem}.md" if n == 0 else f"{stem}-{n}.md")
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    raise FileExistsError(f"{folder / stem}.md and 999 numbered names after it exist")


def model_names(info: dict) -> str:
    """'target + draft' by folder name, for the window's subtitle."""
    def name(path) -> str:
        return str(path).rstrip("/").split("/")[-1]
    draft = f"draft {name(info['draft'])}" if info.get("draft") else "no draft"
    return f"{name(info.get('target', '?'))} + {draft}"


def panel_text(stats: Stats | None, info: dict, baseline: Baseline | None, settings: dict, width: int = 26,
               done: bool = True) -> Text:
    """The side panel: placement, the answer's length (and whether it is still streaming), speed (the
    answer's and the baseline's, both on the engine's clock), acceptance, device timelines and drift."""
    t = Text()

    def row(label: str, value: str, style: str = "") -> None:
        t.append(f"{label:<10}", "dim")
        t.append(f"{value}\n", style)

    row("target", f"{info.get('target_device', '?')}")
    row("draft", f"{info.get('draft_device')}" if info.get("draft") else "none (autoregressive)")
    row("schedule", settings.get("schedule", "sequential"))
    row("temp", f"{settings.get('temperature', 0.0):g}")

    def baseline_rows() -> None:
        row("baseline", f"{baseline.tokens_per_s:.1f} tok/s" if baseline else "measuring...")
        if baseline:
            t.append(f"  {baseline.describe()}\n", "dim")  # which baseline: the speedup's denominator

    if stats is None:
        baseline_rows()
        return t
    row("answer", f"{stats.num_generated_tokens} tokens" + (", done" if done else "..."))
    row("tok/s", f"{stats.tokens_per_s:.1f}", "bold")
    baseline_rows()
    if baseline and baseline.tokens_per_s > 0:
        row("speedup", f"{stats.tokens_per_s / baseline.tokens_per_s:.2f}x", "bold")
    row("tau", f"{stats.tau:.2f}" if stats.mode == "speculative" else "- (no draft)", "bold")
    if stats.mode == "speculative" and (stats.plain_steps or stats.controller is not None or stats.switches):
        now = "plain" if stats.current_size == 1 else f"block {stats.current_size}"
        by_mode = stats.tokens_by_mode
        row("step", now, "bold")
        row("tokens", f"{by_mode['speculative']} blocks / {by_mode['plain']} plain")
    if stats.mode == "speculative":
        hist = stats.acceptance_length_histogram
        t.append(f"tokens/step 1..{stats.block_size}\n", "dim")
        t.append(bars([float(v) for v in hist.values()])[:width] + "\n", "cyan")
        t.append("per position\n", "dim")
        t.append(bars(stats.acceptance_rate_per_position, top=1.0)[:width] + "\n", "cyan")
    if stats.timeline is not None:
        for lane in ("target", "draft"):
            t.append(f"{lane:<7}", "dim")
            t.append(bars(stats.timeline.sparkline(lane, width - 7), top=1.0) + "\n", "magenta")
        hits = f"  hits {stats.predraft_hit_rate:.0%}" if stats.predraft_steps else ""
        t.append(f"overlap {stats.timeline.overlap_fraction:.0%}{hits}\n", "dim")
    if stats.drift is not None and stats.drift.positions:
        d = stats.drift.to_dict()
        row("drift", f"cos {d['cosine']:.5f}")
        row("", f"top-1 {d['top1_agreement']:.1%}")
    elif stats.drift is not None:  # a reduced-precision device, but no block compared yet
        row("drift", "no draft block ran")
    else:
        row("drift", "- (float32 draft)" if stats.mode == "speculative" else "-")
    if stats.fallback:
        t.append("draft failed: target finished alone\n", "bold red")
    return t

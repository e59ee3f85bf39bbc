"""What the chat app shows, kept apart from Textual so it can be tested on its own: the conversation,
which tokens came from accepted drafts, the transcript, and the side panel's figures."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.text import Text

from hetero_sd.runtime import Runtime, TextStream
from hetero_sd.decoding.stats import Stats
from hetero_sd.decoding.timeline import bars

BASELINE_PROMPT = "Describe a lighthouse in two sentences."
BASELINE_TOKENS = 32
DRAFT_STYLE = "bold green"


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
        out = Text()
        for text, source in self.segments:
            out.append(text, DRAFT_STYLE if show_sources and source == "draft" else "")
        if self.stopped:
            out.append("  [stopped]", "italic dim")
        return out


class AnswerBuilder:
    """Turns stream events into answer segments; text is decoded incrementally (never half a character)."""

    def __init__(self, runtime: Runtime):
        self.stream, self.answer = TextStream(runtime.tokenizer), Answer()

    def add(self, token_ids: list[int], accepted: int | None) -> None:
        drafted = min(accepted or 0, len(token_ids))
        for ids, source in ((token_ids[:drafted], "draft"), (token_ids[drafted:], "target")):
            piece = self.stream.add(ids) if ids else ""
            if piece:
                self.answer.segments.append((piece, source))


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


def measure_baseline(runtime: Runtime) -> float:
    """Autoregressive tokens/s of the loaded target on a fixed prompt: the speedup's denominator."""
    runtime.generate(BASELINE_PROMPT, max_new_tokens=4, speculative=False)  # warm-up: first calls allocate
    began = time.perf_counter()
    out = runtime.generate(BASELINE_PROMPT, max_new_tokens=BASELINE_TOKENS, speculative=False, stop_at_eos=False)
    return out.stats.num_generated_tokens / (time.perf_counter() - began)


def model_names(info: dict) -> str:
    """'target + draft' by folder name, for the window's subtitle."""
    def name(path) -> str:
        return str(path).rstrip("/").split("/")[-1]
    draft = f"draft {name(info['draft'])}" if info.get("draft") else "no draft"
    return f"{name(info.get('target', '?'))} + {draft}"


def panel_text(stats: Stats | None, info: dict, baseline_tps: float | None, settings: dict, width: int = 26) -> Text:
    """The side panel: placement, speed, acceptance, device timelines and drift."""
    t = Text()

    def row(label: str, value: str, style: str = "") -> None:
        t.append(f"{label:<10}", "dim")
        t.append(f"{value}\n", style)

    row("target", f"{info.get('target_device', '?')}")
    row("draft", f"{info.get('draft_device')}" if info.get("draft") else "none (autoregressive)")
    row("schedule", settings.get("schedule", "sequential"))
    row("temp", f"{settings.get('temperature', 0.0):g}")
    if stats is None:
        row("baseline", f"{baseline_tps:.1f} tok/s" if baseline_tps else "measuring...")
        return t
    row("tok/s", f"{stats.tokens_per_s:.1f}", "bold")
    row("baseline", f"{baseline_tps:.1f} tok/s" if baseline_tps else "measuring...")
    if baseline_tps:
        row("speedup", f"{stats.tokens_per_s / baseline_tps:.2f}x", "bold")
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

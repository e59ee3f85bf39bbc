"""One peer's results: tokens, seconds and per-prompt rows with the loop counts of repetition.py."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from hetero_sd.backends.base import synchronize

from .repetition import add_counts, loop_counts, loop_figures


@dataclass
class PeerRow:
    name: str
    tokens: int = 0
    seconds: float = 0.0
    note: str = ""
    skipped: bool = False
    weights: str = ""  # which weights it reads, at what precision
    prompts: list[dict] = field(default_factory=list)  # per prompt: tokens, seconds, loop counts, extras

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, ids: list[int], seconds: float, tokens: int | None = None, lengths: list[int] | None = None,
            **extra) -> None:
        """One answer: its generated ids (for the loop rule), seconds, token count (default len(ids)),
        the tokens each verify step emitted (speculative peers that report them) and peer-specific extras."""
        counts = loop_counts(ids, lengths)
        tokens = len(ids) if tokens is None else tokens
        self.prompts.append({"tokens": tokens, "seconds": seconds, **extra, "loop": counts, "output_ids": list(ids)}
                            | loop_figures(counts))
        self.tokens += tokens
        self.seconds += seconds

    @property
    def tau(self) -> float | None:
        """Pooled over the verify steps of every prompt, for peers that report steps."""
        steps = [(p["tau"], p["steps"]) for p in self.prompts if p.get("tau") is not None and p.get("steps")]
        return sum(t * n for t, n in steps) / sum(n for _, n in steps) if steps else None

    def to_dict(self, spec_tokens_per_s: float, base_tokens_per_s: float | None = None) -> dict:
        d = asdict(self)
        ran = not self.skipped and self.seconds > 0
        d.update(tokens_per_s=self.tokens_per_s, tau=self.tau,
                 ratio_to_spec=self.tokens_per_s / spec_tokens_per_s if ran and spec_tokens_per_s else None,
                 ratio_to_autoregressive=self.tokens_per_s / base_tokens_per_s if ran and base_tokens_per_s else None)
        if any("identical" in p for p in self.prompts):
            d["identical"] = all(p["identical"] for p in self.prompts)
        if self.prompts:
            d |= loop_figures(add_counts([p["loop"] for p in self.prompts]))
        return d


def placement(runtime) -> tuple[str, torch.dtype]:
    """Where a transformers-based peer runs: on our target's torch device, in its dtype (float32 where ours is
    not a torch float dtype: the CPU's int8 numerics), so a GPU run compares like with like."""
    device = str(runtime.info.get("target_device") or "cpu")
    if device.split(":")[0] not in ("cpu", "cuda", "mps"):
        device = "cpu"
    dtype = getattr(torch, str(runtime.info.get("target_dtype")), None)
    return device, dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def synced(device: str, fn):
    """fn() and the device's queue drained: a peer's clock stops when its tokens exist."""
    out = fn()
    synchronize(device)
    return out


def failures(rows: list[dict], asked: str | None) -> list[str]:
    """The peers named in --peers that did not run, as "name: why" (the run fails on them: a comparison
    that silently lost a peer reads as complete). `--peers all` asks for whatever is installed, so there
    a skipped peer is a row with its note, not a failure."""
    if not asked or asked == "all":
        return []
    return [f"{r['name']}: {r['note']}" for r in rows if r["skipped"]]

"""Generation statistics, named as vLLM's speculative-decoding metrics are.

tau (mean_acceptance_length) counts the bonus token: a step that accepts a drafts emits a + 1 tokens."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from hetero_sd.backends.drift import Drift
from .timeline import Timeline


@dataclass
class Stats:
    mode: str = "speculative"  # or "autoregressive"
    schedule: str = "sequential"  # or "overlap", "pipeline"
    block_size: int = 0
    draft_format: str | None = None  # e.g. "dflash", "dflash2 (top-8 selector, conv kernel 4)"
    target_dtype: str = ""  # the target's numerics: a bfloat16 target is a different target than float32
    draft_dtype: str = ""  # the draft's numerics (never reach the output; bf16 on CPUs with native bf16)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed)
    num_generated_tokens: int = 0
    num_drafts: int = 0  # verify steps that checked a drafted block
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    drafted_per_step: list[int] = field(default_factory=list)  # block size - 1 (varies under the controller)
    gated_drafts: int = 0  # drafts left unverified by the confidence gate (not in num_draft_tokens)
    lookup_weight: float = 0.0  # the context lookup's weight in the proposals (0: off; decoding/lookup.py)
    lookup_drafts: int = 0  # drafts where the lookup's guess replaced the draft's own most likely token
    lookup_blocks: int = 0  # blocks of the lookup's guesses alone, verified without a draft pass (controller)
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = ""
    fallback: str | None = None  # why the draft was dropped mid-generation (the target finished alone)
    predraft_steps: int = 0  # overlap schedule: verify steps during which the draft pre-drafted
    predraft_guesses: int = 0  # pre-drafted blocks (one per guessed outcome)
    predraft_hits: int = 0  # steps whose next block was ready when verification ended
    acceptance: str = "host"  # where the blocks were accepted: "device" (read once a step) or "host" (and why)
    device_steps: int = 0  # blocks verified and accepted on the device (decoding/loop.verify_on_device)
    notes: list[str] = field(default_factory=list)  # announced fallbacks and other events
    timeline: Timeline | None = field(default=None, repr=False)  # per-device spans of this generation
    drift: Drift | None = field(default=None, repr=False)  # precision drift of the draft device, if measured
    request: int = 0  # which request of the timeline is this one (pipelined runs share a timeline)
    plain_steps: int = 0  # plain decode steps that the block-size controller chose in a speculative run
    switches: list[list] = field(default_factory=list)  # [generated tokens so far, "plain"|"speculative", size]
    controller: dict | None = None  # the controller's costs, corrections and probes (block size "auto")
    current_size: int = 0  # the latest step's size (1: plain), for live views
    constrained: dict | None = None  # under a grammar: its kind, masks computed, their seconds, drafts cut (constrained.py)

    def record_step(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_per_step.append(accepted)
        self.drafted_per_step.append(drafted)

    def record_emitted(self, tokens: int, finish_reason: str) -> None:
        """Tokens the budget let through this step, and why generation ended once it has."""
        self.num_generated_tokens += tokens
        self.finish_reason = finish_reason or self.finish_reason

    def record_plain(self) -> None:
        self.plain_steps += 1

    def record_choice(self, size: int) -> None:
        """A step's size (1: plain decoding); a change between plain and speculative is a switch."""
        mode = "plain" if size == 1 else "speculative"
        self.current_size = size
        if not self.switches or self.switches[-1][1] != mode:
            self.switches.append([self.num_generated_tokens, mode, size])

    @property
    def tokens_by_mode(self) -> dict[str, int]:
        """Generated tokens by where they came from: the prefill, plain decode steps, verified blocks."""
        first = min(self.num_generated_tokens, 1)
        if self.mode == "autoregressive":
            return {"prefill": first, "plain": self.num_generated_tokens - first, "speculative": 0}
        return {"prefill": first, "plain": self.plain_steps,
                "speculative": max(self.num_generated_tokens - first - self.plain_steps, 0)}

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per verify step, bonus included."""
        if not self.num_drafts:  # no block verified: plain steps (one token each), or nothing yet
            return 1.0 if self.mode == "autoregressive" or self.plain_steps else 0.0
        return (self.num_accepted_tokens + self.num_drafts) / self.num_drafts

    tau = mean_acceptance_length

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Position i (1-based): fraction of the steps that drafted position i whose first i drafts
        were all accepted."""
        n = max(self.block_size - 1, 0)
        rates = []
        for i in range(1, n + 1):
            steps = [a for a, d in zip(self.accepted_per_step, self.drafted_per_step) if d >= i]
            rates.append(sum(a >= i for a in steps) / len(steps) if steps else 0.0)
        return rates

    @property
    def block_size_histogram(self) -> dict[int, int]:
        """Block size (anchor + drafts) -> steps that used it; 1 counts the controller's plain steps."""
        counts = Counter(d + 1 for d in self.drafted_per_step)
        if self.plain_steps:
            counts[1] = self.plain_steps
        return dict(sorted(counts.items()))

    @property
    def acceptance_length_histogram(self) -> dict[int, int]:
        """Emitted tokens per step (accepted + bonus) -> number of steps."""
        counts = Counter(a + 1 for a in self.accepted_per_step)
        return {k: counts.get(k, 0) for k in range(1, self.block_size + 1)}

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (vLLM's TPOT): the decoding loop's own rate, without the prefill
        and the first token's wait (TTFT) that end-to-end tokens/s include."""
        n = self.num_generated_tokens - 1
        return (self.total_s - self.ttft_s) / n if n > 0 and self.total_s > self.ttft_s else 0.0

    @property
    def other_s(self) -> float:
        return max(self.total_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    @property
    def predraft_hit_rate(self) -> float:
        return self.predraft_hits / self.predraft_steps if self.predraft_steps else 0.0

    def close(self) -> None:
        """Derive the device times from the timeline once the generation is over."""
        if self.timeline is None:
            return
        spans = [s for s in self.timeline.spans if s.request == self.request]
        self.prefill_s = sum(s.end - s.start for s in spans if s.name == "prefill")
        self.draft_s = sum(s.end - s.start for s in spans if s.lane == "draft")
        self.verify_s = sum(s.end - s.start for s in spans if s.lane == "target") - self.prefill_s

    @classmethod
    def pooled(cls, stats, block_size: int) -> "Stats":
        """Several generations as one: every verify step, token and device second (bench's totals;
        tau is then pooled over all the steps)."""
        total = cls(block_size=block_size)
        for s in stats:
            for d, a in zip(s.drafted_per_step, s.accepted_per_step):
                total.record_step(d, a)
            for name in ("num_generated_tokens", "plain_steps", "predraft_steps", "predraft_guesses",
                         "predraft_hits", "prefill_s", "draft_s", "verify_s", "total_s"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
        return total

    def to_dict(self) -> dict:
        timeline, drift = self.timeline, self.drift
        self.timeline = self.drift = None  # spans go to traces, not into every stats dict
        d = asdict(self)
        self.timeline, self.drift = timeline, drift
        d["drift"] = drift.to_dict() if drift else None
        d.pop("accepted_per_step")
        d.pop("drafted_per_step")
        d["block_size_histogram"] = self.block_size_histogram
        d["timeline"] = timeline.summary() if timeline else None
        d["predraft_hit_rate"] = self.predraft_hit_rate
        d.update(mean_acceptance_length=self.mean_acceptance_length, tau=self.tau,
                 draft_acceptance_rate=self.draft_acceptance_rate,
                 acceptance_rate_per_position=self.acceptance_rate_per_position,
                 acceptance_length_histogram=self.acceptance_length_histogram,
                 tokens_per_s=self.tokens_per_s, tpot_s=self.tpot_s, other_s=self.other_s, tokens_by_mode=self.tokens_by_mode)
        return d

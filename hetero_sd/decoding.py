"""The decoding loops, written once for every backend (reference §3).

Both loops are generators of `Step`s so that `Runtime.generate` and `Runtime.stream` (and the chat
app) share them. Invariant of the speculative loop: the anchor (last emitted token) sits at position
`target.length`; it is in neither the target's cache nor the draft's context yet."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from backends.base import DraftBackend, TargetBackend

from .sampling import Sampler, draft_tokens, verify
from .stats import Stats


@dataclass
class Step:
    tokens: list[int]  # newly emitted tokens (cut at a stop token or the length limit)
    accepted: int | None = None  # drafts accepted this step (None: prefill or autoregressive step)
    drafted: int = 0


class Budget:
    """Counts emitted tokens; ends generation at a stop token or max_new_tokens."""

    def __init__(self, max_new_tokens: int, stop_ids: Sequence[int], stats: Stats):
        self.left, self.stop_ids, self.stats = max_new_tokens, set(stop_ids), stats
        self.done = max_new_tokens <= 0

    def take(self, tokens: list[int]) -> list[int]:
        kept = []
        for t in tokens:
            if self.done:
                break
            kept.append(t)
            self.left -= 1
            if t in self.stop_ids:
                self.done, self.stats.finish_reason = True, "stop"
            elif self.left <= 0:
                self.done, self.stats.finish_reason = True, "length"
        self.stats.num_generated_tokens += len(kept)
        return kept


def prefill(target: TargetBackend, prompt_ids: Sequence[int], sampler: Sampler, stats: Stats, features: bool):
    began = time.perf_counter()
    target.crop(0)
    out = target.forward(prompt_ids, last_only=True, features=features)
    first = sampler.sample(out.logits)[0]
    stats.num_prompt_tokens = len(prompt_ids)
    stats.prefill_s = stats.ttft_s = time.perf_counter() - began
    return first, out.features


def autoregressive(target: TargetBackend, prompt_ids: Sequence[int], sampler: Sampler, budget: Budget,
                   stats: Stats) -> Iterator[Step]:
    token, _ = prefill(target, prompt_ids, sampler, stats, features=False)
    yield Step(budget.take([token]))
    while not budget.done:
        began = time.perf_counter()
        token = sampler.sample(target.forward([token], features=False).logits)[0]
        stats.verify_s += time.perf_counter() - began
        yield Step(budget.take([token]))


def speculative(target: TargetBackend, draft: DraftBackend, prompt_ids: Sequence[int], sampler: Sampler,
                budget: Budget, stats: Stats, rule: str = "match") -> Iterator[Step]:
    anchor, pending = prefill(target, prompt_ids, sampler, stats, features=True)
    draft.crop(0)
    yield Step(budget.take([anchor]))
    while not budget.done:
        began = time.perf_counter()
        draft.add_context(pending)
        drafted, q = draft_tokens(sampler, draft.propose(anchor), rule)
        draft.synchronize()
        verifying = time.perf_counter()
        start = target.length
        out = target.forward([anchor] + drafted, features=True)
        verdict = verify(sampler, out.logits, drafted, q, rule)
        keep = verdict.accepted + 1  # anchor + accepted drafts are now context; the bonus is the next anchor
        target.crop(start + keep)
        pending = out.features[:keep]
        target.synchronize()
        stats.draft_s += verifying - began
        stats.verify_s += time.perf_counter() - verifying
        stats.record_step(len(drafted), verdict.accepted)
        anchor = verdict.tokens[-1]
        yield Step(budget.take(verdict.tokens), verdict.accepted, len(drafted))

"""Block size per step: fixed, or chosen from measured acceptance and measured cost.

A block of size B (anchor + B-1 drafts) emits E(B) = 1 + sum_{i<B} prod_{k<=i} a_k tokens on average,
where a_k is the chance that draft k is accepted given that drafts 1..k-1 were. It costs one draft
pass and one B-token verify. The adaptive policy picks the B that maximises E(B) / cost(B), with a_k
counted from the steps so far (a position seldom reached is assumed to behave like the one before
it, so that fully accepted short blocks make the policy try longer ones) and cost(B) measured on the
first steps at each size, then tracked as a running average. Smaller blocks are the same draft with fewer
mask positions; the output is the target's either way (verification decides)."""

from __future__ import annotations

import threading


class FixedBlock:
    adaptive = False

    def __init__(self, size: int):
        self.size = size

    def choose(self) -> int:
        return self.size

    def observe(self, size: int, drafted: int, accepted: int, seconds: float) -> None:
        pass


class AdaptiveBlock:
    adaptive = True
    DECAY = 0.98  # older steps weigh less: acceptance changes with the text (code, prose, lists)

    def __init__(self, max_size: int):
        self.sizes = sorted({s for s in (2, 4, 8, 16, 32) if s < max_size} | {max_size})
        self.reached = [0.0] * max_size  # [k]: weighted steps that drafted position k+1 with 1..k accepted
        self.accepted = [0.0] * max_size
        self.cost: dict[int, float] = {}
        self.lock = threading.Lock()  # `pipeline` runs two requests' loops on one shared policy

    def choose(self) -> int:
        with self.lock:
            untried = [s for s in self.sizes if s not in self.cost]
            if untried:  # measure each size once on real steps before trusting the model
                return untried[-1]
            return max(self.sizes, key=lambda s: self.expected_tokens(s) / self.cost[s])

    def rates(self, count: int) -> list[float]:
        """Conditional acceptance per position, each shrunk towards the previous position's (a prior
        worth two steps): a position seldom reached is assumed to behave like the one before it."""
        out, prior = [], 0.5
        for k in range(count):
            prior = (self.accepted[k] + 2.0 * prior) / (self.reached[k] + 2.0)
            out.append(prior)
        return out

    def expected_tokens(self, size: int) -> float:
        total, chain = 1.0, 1.0
        for rate in self.rates(size - 1):
            chain *= rate
            total += chain
        return total

    def observe(self, size: int, drafted: int, accepted: int, seconds: float) -> None:
        with self.lock:
            self.record(size, drafted, accepted, seconds)

    def record(self, size: int, drafted: int, accepted: int, seconds: float) -> None:
        for k in range(len(self.reached)):
            self.reached[k] *= self.DECAY
            self.accepted[k] *= self.DECAY
        for k in range(min(accepted + 1, drafted)):  # positions 1..accepted+1 were reached
            self.reached[k] += 1.0
            self.accepted[k] += k < accepted
        old = self.cost.get(size)
        self.cost[size] = seconds if old is None else 0.8 * old + 0.2 * seconds

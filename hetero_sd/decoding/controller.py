"""Per step, plain decoding or a DFlash block of size 2..B: whichever is expected to be fastest.

A block of size b (anchor + b-1 drafts) emits E(b) = 1 + sum_{i<b} prod_{k<=i} a_k tokens on average,
where a_k is the chance that draft k is accepted given that drafts 1..k-1 were; it costs one draft pass
of size b and one verify of b tokens. A plain decode step emits one token for one decode step. The
controller picks the mode with the most expected tokens per second:
- costs: measured once per machine (costs.py: decode, verify of k tokens, draft of size b), corrected
  online by the times the steps of this runtime actually take (another schedule, threads, context);
- acceptance: counted per position on this generation's steps, decayed per emitted token so that it
  follows the text (code, prose, lists), shrunk towards a prior carried over from earlier generations.

Plain decoding observes no acceptance, so in plain mode the controller re-probes speculation with the
smallest block. Probes are paid from a budget: plain steps earn PROBE_BUDGET of their time, and a probe
spends what it cost beyond the plain steps it replaced (the draft's catch-up on the context included),
so failed probes cost at most that share of the time, across generations. A probe that pays earns
its cost back. Probes come after GAP plain steps, or REPEAT_GAP when the text repeats itself (its
last tokens occurred before in the prompt or the answer: code, lists and quotes are where drafts are
right), once the budget covers one. The other way round, a run of blocks observes no plain step: a
runtime that has seen few takes PLAIN_CHECK of them after PLAIN_CHECK_AFTER blocks in a row (and every
PLAIN_CHECK_EVERY blocks), whose median sets the plain cost outright. Whatever is chosen, the target
decides every token: the choice changes speed, never the output."""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

from .costs import Costs

PLAIN = 1  # the block size that stands for plain decoding in choices and histograms
PRIOR_EVIDENCE = 4.0  # steps' worth of an even chance behind the prior's rates (Acceptance.conditional)


class FixedBlock:
    """Always the same block size (the draft's own, or one the user forced)."""

    def __init__(self, size: int):
        self.size = size

    def choose(self) -> int:
        return self.size

    def peek(self) -> int:
        return self.size

    def emitted(self, tokens: list[int]) -> None:
        pass

    def observe(self, size: int, drafted: int, accepted: int, seconds: float, context_s: float = 0.0) -> None:
        pass

    def observe_plain(self, seconds: float) -> None:
        pass


def interpolate(points: dict[int, float], x: int) -> float:
    """Piecewise-linear through measured (size, seconds) points, extended linearly past both ends."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    lo = max([k for k in xs[:-1] if k <= x], default=xs[0])
    hi = xs[xs.index(lo) + 1]
    y = points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
    return max(y, 0.25 * min(points.values()))  # extrapolating down never reaches zero cost


@dataclass
class CostModel:
    """Seconds per step of each kind, from measured costs times an online correction per kind."""

    costs: Costs
    spec_factor: float = 1.0  # observed / modelled, speculative steps
    plain_factor: float = 1.0  # observed / modelled, plain steps
    learn: bool = True  # False: the measured costs as they are (tests and replays)
    modelled: dict[int, float] = field(default_factory=dict, repr=False)
    ALPHA = 0.2
    CLIP = (0.5, 2.0)  # one observation moves a factor at most this far from where it is: a page fault
    #                    or a stall elsewhere is not the step's cost, but repeated ones move it anywhere
    SHARED = 0.05  # what moves one kind's factor pulls the other's along (a busier machine slows both)
    STALE = (2 / 3, 1.5)  # a plain factor settled outside this range: the measured costs are not this
    STALE_AFTER = 32  # machine's now (measured under load, or the machine changed); plain steps seen
    plain_seen: int = 0
    ratio: float = 1.0  # plain_factor / spec_factor as the last plain check measured it (1: the cached costs')

    def step(self, size: int) -> float:
        if size == PLAIN:
            return self.plain_factor * self.costs.decode_s
        return self.spec_factor * self.model(size)

    def lookup_step(self, size: int) -> float:
        """A lookup block: the verify of `size` tokens without a draft pass."""
        return self.spec_factor * self.verify(size)

    def verify(self, size: int) -> float:
        return interpolate(self.costs.verify_s, size)

    def model(self, size: int) -> float:
        # memoised: the controller asks for every size on the steps where it re-decides
        if size not in self.modelled:
            self.modelled[size] = interpolate(self.costs.draft_s, size) + self.verify(size)
        return self.modelled[size]

    def took(self, size: int, seconds: float) -> float:
        """What a step is taken to have cost: as observed, or as modelled when not learning."""
        return seconds if self.learn else self.step(size)

    def observe(self, size: int, seconds: float, lookup: bool = False) -> None:
        if not self.learn:
            return
        if lookup:  # its own model: no draft pass
            self.spec_factor = self.moved(self.spec_factor, seconds / self.verify(size))
            return
        if size == PLAIN:
            self.plain_seen += 1
            self.plain_factor = self.moved(self.plain_factor, seconds / self.costs.decode_s)
            # a kind not chosen any more is never observed again: without this pull a stale, high
            # estimate (a stall while it ran) would keep the controller away from it for good. The pull
            # keeps the two kinds at the ratio a plain check measured: it must not undo that measurement
            self.spec_factor += self.SHARED * (self.plain_factor / self.ratio - self.spec_factor)
        else:
            self.spec_factor = self.moved(self.spec_factor, seconds / self.model(size))
            self.plain_factor += self.SHARED * (self.ratio * self.spec_factor - self.plain_factor)

    def measured_plain(self, seconds: list[float]) -> None:
        """A deliberate check of a few plain steps in a row (AutoBlock's plain check): their median sets the
        plain factor outright. It is a measurement, not one step that may have stalled, and the clip would
        take dozens of steps to undo costs cached 3x off, steps the controller would spend speculating."""
        if not self.learn:
            return
        self.plain_seen += len(seconds)
        self.plain_factor = statistics.median(seconds) / self.costs.decode_s
        self.ratio = self.plain_factor / self.spec_factor

    def moved(self, factor: float, ratio: float) -> float:
        low, high = self.CLIP  # relative to the factor, not to 1: costs cached under load converge too
        return factor + self.ALPHA * (min(max(ratio, low * factor), high * factor) - factor)

    def stale(self) -> bool:
        """Whether enough plain steps have shown that the measured costs are off for this machine now."""
        low, high = self.STALE
        return self.plain_seen >= self.STALE_AFTER and not low <= self.plain_factor <= high

    def to_dict(self) -> dict:
        return {**self.costs.to_json(), "spec_factor": round(self.spec_factor, 3),
                "plain_factor": round(self.plain_factor, 3)}


@dataclass
class Acceptance:
    """Per-position acceptance counts: reached[k] counts steps that drafted position k+1 with positions
    1..k accepted, accepted[k] those that accepted it too."""

    size: int
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    scale: float = 1.0  # decay not yet applied: a plain step only multiplies this (it runs every ~10 ms)

    def __post_init__(self):
        self.reached = self.reached or [0.0] * self.size
        self.accepted = self.accepted or [0.0] * self.size

    def add(self, drafted: int, accepted: int) -> None:
        self.settle()
        for k in range(min(accepted + 1, drafted)):
            self.reached[k] += 1.0
            self.accepted[k] += k < accepted

    def decay(self, factor: float) -> None:
        self.scale *= factor

    def settle(self) -> None:
        if self.scale != 1.0:
            self.reached = [r * self.scale for r in self.reached]
            self.accepted = [a * self.scale for a in self.accepted]
            self.scale = 1.0

    def rates(self, count: int, prior: list[float], weight: float, guess_weight: float = 1.0) -> list[float]:
        """Conditional acceptance per position, shrunk towards the prior (worth `weight` steps); where
        the prior has no evidence either, a position is assumed to behave like the one before it (a
        guess, worth `guess_weight` steps)."""
        self.settle()
        out, previous = [], prior[0] if prior else 0.5
        for k in range(count):
            base, w = (prior[k], weight) if k < len(prior) else (previous, guess_weight)
            previous = (self.accepted[k] + w * base) / (self.reached[k] + w)
            out.append(previous)
        return out

    def conditional(self, shrink: float = 0.0) -> list[float]:
        """Conditional rates where there is evidence (the next generations' prior), each shrunk towards the
        position before it (1/2 for position 1) by `shrink` steps' worth: a prior drawn from one block must
        not weigh what one drawn from a hundred does (a warm-up that drafted one failed block would otherwise keep
        a whole run plain)."""
        self.settle()
        out, previous = [], 0.5
        for a, r in zip(self.accepted, self.reached):
            if r <= 0.5:
                break
            previous = (a + shrink * previous) / (r + shrink)
            out.append(previous)
        return out


class Memory:
    """What outlives a generation: the measured costs with their online corrections, and the
    acceptance of earlier generations (the prior). Shared by concurrent requests, hence the lock."""

    def __init__(self, costs: Costs, max_size: int, learn_costs: bool = True):
        self.lock = threading.Lock()
        self.cost = CostModel(costs, learn=learn_costs)
        self.history = Acceptance(max_size)
        # what the last probe cost beyond plain decoding: the price of the next one (first guess: the
        # modelled smallest block against a decode step, without the draft's catch-up)
        self.probe_price = max(self.cost.step(2) - self.cost.step(PLAIN), 0.0)
        # seconds that probes may still spend beyond plain decoding: a fresh runtime may look once
        self.probe_credit = self.probe_price

    def earn(self, plain_s: float, budget: float) -> None:
        # capped: a long plain stretch banks a couple of probes, not a burst of them
        self.probe_credit = min(self.probe_credit + budget * plain_s, 2 * self.probe_price)

    def spend(self, excess_s: float) -> None:
        self.probe_credit -= excess_s
        self.probe_price = max(excess_s, 0.0)

    def prior(self) -> list[float]:
        with self.lock:
            return self.history.conditional(shrink=PRIOR_EVIDENCE)

    def absorb(self, acceptance: Acceptance) -> None:
        with self.lock:
            acceptance.settle()
            self.history.settle()
            for k in range(min(len(acceptance.reached), len(self.history.reached))):
                self.history.reached[k] += acceptance.reached[k]
                self.history.accepted[k] += acceptance.accepted[k]
            self.history.decay(0.9)  # newer generations count more: prompts change


class Repeats:
    """Whether the text has just repeated itself: its last n tokens occurred before (prompt included)."""

    N = 3

    def __init__(self, tokens: list[int]):
        self.tail: list[int] = []
        self.seen: set[tuple[int, ...]] = set()
        self.add(list(tokens))
        self.last = False

    def add(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tail = (self.tail + [t])[-self.N:]
            if len(self.tail) == self.N:
                gram = tuple(self.tail)
                self.last = gram in self.seen
                self.seen.add(gram)


class AutoBlock:
    """The controller for one generation (see the module docstring)."""

    DECAY = 0.98  # per emitted token: evidence halves every ~34 tokens of text
    PRIOR_WEIGHT = 4.0  # steps' worth of earlier generations: one lucky accept must not turn a draft
    #                     that never paid into a block on every step (the largest of noisy estimates wins)
    # GAP and STATE_WEIGHT: from replays of the default draft's recorded acceptance on 4 x 12 prompts at the
    # measured step costs (benchmarks/controller_replay.py): GAP 4, STATE_WEIGHT 1 gave 1.016 / 1.033 / 1.014 /
    # 0.990 tokens per decode step's time (chat / HumanEval / math / summarize), these 1.042 / 1.038 / 1.023 /
    # 0.993; on a second recording +0.5-1.0% on average across catch-up costs: small, but every time. (Fixed
    # blocks of 2: 1.004 / 1.065 / 1.066 / 0.920.) STATE_WEIGHT 3-4 replayed a little better still but re-try a
    # block one longer than the draft's reach too often (test_controller); a larger PROBE_BUDGET, or states
    # keyed by the target's probability of the anchor, moved nothing beyond the replays' noise (~1%).
    GAP = 8  # plain steps between probes, at least
    PROBE_BUDGET = 0.01  # failed probes may cost this share of the plain steps' time, at most
    REPEAT_GAP = 2  # plain steps before a probe when the text repeats itself
    RECHECK = 4  # plain steps between re-decisions in a plain stretch
    STATE_WEIGHT = 2.0  # steps' worth of the generation's overall rates behind each state's own rates: a real
    #                     draft's hits come less in clean stretches than an oracle's; its states' rates are noisy
    # Only plain steps show what a plain step costs. Costs cached from a busier moment (a test suite beside
    # a first run) can make blocks look better than plain decoding for good: so after this many blocks in
    # a row a runtime that has seen fewer than PLAIN_CHECK plain steps takes PLAIN_CHECK of them, and
    # again after PLAIN_CHECK_EVERY blocks (~1.5% of the steps when blocks really pay).
    PLAIN_CHECK = 4
    PLAIN_CHECK_AFTER = 16
    PLAIN_CHECK_EVERY = 256

    def __init__(self, max_size: int, memory: Memory, prompt_ids: list[int] = (), allow_plain: bool = True,
                 lookup=None):
        """lookup: the generation's lookup.ContextLookup, when a step may be a lookup block (its guesses
        verified without a draft pass: where the text repeats itself, the lookup alone is right about as
        often as the draft and the lookup together, 80% vs 81% at position 1 on chat; lookup_tune.py)."""
        self.max_size, self.memory, self.allow_plain, self.lookup = max_size, memory, allow_plain, lookup
        self.via_lookup = False  # whether the step just chosen is a lookup block
        self.lookup_acceptance = Acceptance(max_size)
        self.lookup_blocks = 0
        self.acceptance = Acceptance(max_size)
        # Acceptance comes in stretches (code, lists, quoted text: the draft is right for a while, then
        # not), so the rates are also kept apart by the outcome of the last block: "hot" when it accepted
        # every drafted token. After a full accept the long blocks pay; after a miss, plain decoding may.
        # And by whether the text repeats itself at the anchor (its last 3 tokens occurred before): there the
        # context lookup guesses (lookup.py) and the draft is right more often too. Held-out anchors of the
        # default target's answers, position 1 right with the lookup: 80% on chat and 90% on code after a
        # repeat, 50% and 67% elsewhere (measured on held-out answers of the default pair).
        self.by_state = {(hot, repeat): Acceptance(max_size) for hot in (True, False) for repeat in (True, False)}
        self.hot = False
        self.prior = memory.prior()
        self.repeats = Repeats(list(prompt_ids))
        self.plain_run = 0
        self.probing = False
        self.probes = self.probe_hits = 0
        self.block_run = 0  # blocks since the last plain step
        self.checking: list[float] | None = None  # a plain check's step times, while one runs
        self.check_left = 0
        self.plain_checks = 0

    # --- the choice -------------------------------------------------------------------------------
    def rates(self) -> list[float]:
        overall = self.acceptance.rates(self.max_size - 1, self.prior, self.PRIOR_WEIGHT)
        return self.by_state[self.state()].rates(self.max_size - 1, overall, self.STATE_WEIGHT)

    def state(self) -> tuple[bool, bool]:
        return self.hot, self.repeats.last

    def speeds(self) -> dict[int, float]:
        """Expected tokens per second of every choice: plain (size 1) and each block size."""
        with self.memory.lock:
            cost = self.memory.cost
            out = {PLAIN: 1.0 / cost.step(PLAIN)} if self.allow_plain else {}
            expected, chain = 1.0, 1.0
            for size, rate in enumerate(self.rates(), start=2):
                chain *= rate
                expected += chain
                out[size] = expected / cost.step(size)
        return out

    def best(self) -> int:
        speeds = self.speeds()
        return max(speeds, key=lambda s: (speeds[s], -s))

    def peek(self) -> int:
        """The choice as it stands, without counting a step (pre-drafting asks ahead of time)."""
        best = self.best()
        return best if best != PLAIN else self.best_block()

    def best_block(self) -> int:
        speeds = {s: v for s, v in self.speeds().items() if s != PLAIN}
        return max(speeds, key=lambda s: (speeds[s], -s))

    def best_lookup(self, speeds: dict[int, float]) -> int:
        """The size of the lookup block that beats every choice in `speeds` here, else 0. Only where the text
        repeats itself; its acceptance is counted apart, shrunk towards the draft's in this state."""
        if self.lookup is None or not self.repeats.last:
            return 0
        guesses = len(self.lookup.chain(self.max_size - 1))
        rates = self.lookup_acceptance.rates(guesses, self.rates(), self.STATE_WEIGHT)
        best, top = 0, max(speeds.values())
        with self.memory.lock:
            expected, chain = 1.0, 1.0
            for size, rate in enumerate(rates, start=2):
                chain *= rate
                expected += chain
                if expected / self.memory.cost.lookup_step(size) > top:
                    best, top = size, expected / self.memory.cost.lookup_step(size)
        return best

    def choose(self) -> int:
        self.via_lookup = False
        if self.check_left:  # a plain check under way
            self.check_left -= 1
            return PLAIN
        # In a plain stretch only plain steps are observed, which barely move the speeds; re-deciding
        # every RECHECK steps keeps the controller's own cost off steps that now take ~12 ms
        settled = 0 < self.plain_run and self.plain_run % self.RECHECK and not self.repeats.last
        best = PLAIN if settled else self.best()
        if not settled and self.lookup is not None:
            size = self.best_lookup(self.speeds())
            if size:
                best, self.via_lookup = size, True
        if best != PLAIN:
            self.plain_run = 0
            self.block_run += 1
            if self.plain_check_due():
                self.block_run, self.checking, self.check_left = 0, [], self.PLAIN_CHECK - 1
                self.plain_checks += 1
                self.via_lookup = False
                return PLAIN
            self.lookup_blocks += self.via_lookup
            return best
        self.block_run = 0
        if self.probe_due():
            # the smallest block: it asks only whether position 1 is right again, which is what
            # turns the state hot, at the least cost, so probes can come twice as often for the budget
            self.probing, self.plain_run = True, 0
            self.probes += 1
            return min(2, self.max_size)
        self.plain_run += 1
        return PLAIN

    def plain_check_due(self) -> bool:
        if not self.allow_plain:
            return False
        with self.memory.lock:
            seen = self.memory.cost.plain_seen
        return self.block_run > (self.PLAIN_CHECK_AFTER if seen < self.PLAIN_CHECK else self.PLAIN_CHECK_EVERY)

    def probe_due(self) -> bool:
        if self.plain_run < (self.REPEAT_GAP if self.repeats.last else self.GAP):
            return False
        with self.memory.lock:
            return self.memory.probe_credit >= self.memory.probe_price

    # --- what happened ----------------------------------------------------------------------------
    def emitted(self, tokens: list[int]) -> None:
        self.repeats.add(tokens)
        for acceptance in (self.acceptance, *self.by_state.values(), self.lookup_acceptance):
            acceptance.decay(self.DECAY ** len(tokens))

    def observe(self, size: int, drafted: int, accepted: int, seconds: float, context_s: float = 0.0) -> None:
        """A speculative step took `seconds`, plus `context_s` for the draft's catch-up on context."""
        if self.via_lookup:
            self.lookup_acceptance.add(drafted, accepted)
            self.hot = accepted >= drafted
            with self.memory.lock:
                self.memory.cost.observe(size, seconds, lookup=True)
            return
        self.acceptance.add(drafted, accepted)
        self.by_state[self.state()].add(drafted, accepted)  # (observed before the step's tokens are emitted)
        self.hot = accepted >= drafted
        with self.memory.lock:
            self.memory.cost.observe(size, seconds)
            if self.probing:  # its price: what it cost beyond the plain steps that its tokens replace
                cost = self.memory.cost
                self.memory.spend(cost.took(size, seconds) + context_s - (accepted + 1) * cost.step(PLAIN))
        if self.probing:
            self.probing = False
            self.probe_hits += self.best() != PLAIN

    def observe_plain(self, seconds: float) -> None:
        with self.memory.lock:
            if self.checking is None:
                self.memory.cost.observe(PLAIN, seconds)
            else:
                self.checking.append(seconds)
                if len(self.checking) == self.PLAIN_CHECK:
                    self.memory.cost.measured_plain(self.checking)
                    self.checking = None
            self.memory.earn(self.memory.cost.took(PLAIN, seconds), self.PROBE_BUDGET)

    def finish(self) -> dict:
        """Hand this generation's acceptance to the runtime's memory; the stats' view of the controller."""
        self.memory.absorb(self.acceptance)
        with self.memory.lock:
            costs = self.memory.cost.to_dict()
            credit = self.memory.probe_credit
        return {"costs": costs, "probes": self.probes, "probes_that_paid": self.probe_hits,
                "lookup_blocks": self.lookup_blocks,
                "plain_checks": self.plain_checks,
                "probe_credit_s": round(credit, 4),
                "acceptance_prior": [round(p, 3) for p in self.prior]}

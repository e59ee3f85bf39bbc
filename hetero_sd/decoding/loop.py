"""The decoding loops, written once for every backend and schedule (DFlash generation at batch 1: prefill,
then draft a block at the anchor, verify it in one target forward, keep the accepted prefix and the bonus).

Loops are generators of `Step`s so that `Runtime.generate`, `Runtime.stream` and the chat app share
them. Every backend call goes through a device lane (lanes.py), which runs it on that device's
thread and records it in the timeline. Invariant of the speculative loops: the anchor (last emitted
token) sits at position `target.length`; it is in neither the target's cache nor the draft's
context yet.

Schedules:
- `sequential`: draft the block, then verify it.
- `overlap`: while the target verifies block k, the draft device pre-drafts block k+1 for the most
  likely verification outcomes (see `hypotheses`); a pre-draft whose guess was right is used at once,
  the others are discarded unread. Pipelining two requests is the other overlap (Runtime.generate_many).

Acceptance on the device: where nothing needs the host between a draft and its verification (no penalties,
grammar or gate: the runtime decides, `Request.on_device`), the drafted ids go from the draft's argmax or draws
(steered by the context lookup along its own path) into the target's inputs without the host reading them, the
verdict is computed on the device, and the host reads one small tensor per step (`verify_on_device`,
on_device.py). On an accelerator every read is a stall: the device idles while the host works out what is next.

Fault tolerance: if the draft raises or returns non-finite logits, the generation finishes
autoregressively on the target from the same state, and the stats say so; no token is lost."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Sequence

import torch

from hetero_sd.backends.base import DraftBackend, TargetBackend, uploaded

from .controller import PLAIN, AutoBlock, FixedBlock
from .lanes import Lanes
from .lookup import ContextLookup
from . import on_device
from .sampling import Sampler, draft_tokens, gated, verify
from hetero_sd.backends.base import logits_of
from .stats import Stats

SCHEDULES = ("sequential", "overlap")
MAX_HYPOTHESES = 8
FAULT = object()  # what a failed draft or pre-draft returns


@dataclass
class Guessed:
    """A lookup block's proposals: the context lookup's guesses, verified without a draft pass."""

    tokens: list[int]


@dataclass
class Step:
    tokens: list[int]  # newly emitted tokens (cut at a stop token or the length limit)
    accepted: int | None = None  # drafts accepted this step (None: prefill or autoregressive step)
    drafted: int = 0


class Budget:
    """Counts emitted tokens; ends generation at a stop token or max_new_tokens. It keeps its own
    counters; `Request.emit` records them in the generation's Stats."""

    def __init__(self, max_new_tokens: int, stop_ids: Sequence[int]):
        self.left, self.stop_ids = max_new_tokens, set(stop_ids)
        self.done = max_new_tokens <= 0
        self.finish_reason = ""  # "stop" or "length" once done

    def take(self, tokens: list[int]) -> list[int]:
        kept = []
        for t in tokens:
            if self.done:
                break
            kept.append(t)
            self.left -= 1
            if t in self.stop_ids:
                self.done, self.finish_reason = True, "stop"
            elif self.left <= 0:
                self.done, self.finish_reason = True, "length"
        return kept


@dataclass
class Request:
    """Everything one generation needs; the loops below read it and never keep state elsewhere."""

    target: TargetBackend
    draft: DraftBackend | None
    prompt_ids: Sequence[int]
    sampler: Sampler
    budget: Budget
    stats: Stats
    lanes: Lanes
    rule: str = "match"
    gate: float | None = None  # verify only the drafts before the first below this draft probability (sampling.gated)
    policy: FixedBlock | AutoBlock | None = None  # the size of each step (speculative loops; None without a draft)
    draft_s: float = 0.0  # what the current step waited for its draft, for the controller's cost model
    context_s: float = 0.0  # of which the draft's catch-up on context (long after a plain stretch)
    reuse: int = 0  # prompt positions already in the target's cache and the draft's context (prefix cache)
    keep_context: bool = False  # the prefix cache keeps this generation's caches: bring the draft up to date
    lookup: ContextLookup | None = None  # context lookup mixed into the draft's proposals (lookup.py)
    on_device: bool = False  # sequential blocks verified and accepted on the device (verify_on_device)

    def block_size(self) -> int:
        """The one entry point for the size of the next step: 1 is a plain decode step, 2.. a DFlash
        block of that size (the policy's choice, recorded in the stats)."""
        size = self.policy.choose()
        self.stats.record_choice(size)
        return size

    def emit(self, tokens: list[int]) -> list[int]:
        if self.sampler.constraint is not None:  # nothing after the token that completes a grammar
            tokens = self.sampler.constraint.through_end(tokens)
        kept = self.budget.take(tokens)
        self.sampler.emitted(kept)  # the penalties count what was generated; a grammar advances
        if self.sampler.constraint is not None and self.sampler.constraint.finished and not self.budget.done:
            self.budget.done, self.budget.finish_reason = True, "stop"  # the grammar is complete (constrained.py)
        self.stats.record_emitted(len(kept), self.budget.finish_reason)
        if self.lookup:
            self.lookup.extend(kept)
        if self.policy:
            self.policy.emitted(kept)
        return kept


class DraftFault(RuntimeError):
    """The draft device failed or produced non-finite logits."""


def checked(logits):
    # one reduction: a NaN or an infinity anywhere makes the sum non-finite (torch.isfinite(x).all() took
    # ~0.1 ms a block on a 49k-column row, ~1.5% of a decoding step on the 2-core EPYC). Finite logits of
    # a reduced head's rows at draft_vocab.FLOOR (-1e30) sum to ~-4e36 at 16 rows x 262k columns: still finite.
    if not torch.isfinite(logits_of(logits).sum()):
        raise DraftFault("the draft produced non-finite logits (NaN or inf)")
    return logits


def prefill(r: Request, features: bool):
    def forward_prompt():
        r.target.crop(r.reuse)  # the prefix cache's positions stay; only the rest is computed
        return r.target.forward(r.prompt_ids[r.reuse:], last_only=True, features=features)
    out = r.lanes.target("prefill", forward_prompt)
    r.stats.num_prompt_tokens = len(r.prompt_ids)
    return r.sampler.at(len(r.prompt_ids)).sample(out.logits, argmax=out.argmax)[0], out.features


def autoregressive(r: Request) -> Iterator[Step]:
    token, _ = prefill(r, features=False)
    yield Step(r.emit([token]))
    yield from finish_autoregressive(r, token)


def finish_autoregressive(r: Request, token: int) -> Iterator[Step]:
    """Plain decoding from a state where `token` is emitted but not yet in the target's cache."""
    while not r.budget.done:
        out = r.lanes.target("decode", lambda: r.target.forward([token], features=False))
        # randomness keyed by position (sampling.py); a greedy token read off the step's argmax
        token = r.sampler.at(r.target.length).sample(out.logits, argmax=out.argmax)[0]
        r.lanes.step += 1
        yield Step(r.emit([token]))


def plain_step(r: Request, anchor: int, pending: list[torch.Tensor]) -> tuple[Step, int]:
    """One plain decode step inside a speculative generation (the controller chose it). The anchor's
    context features join `pending`, so that the draft can take over again at any step."""
    began = time.perf_counter()
    out = r.lanes.target("decode", lambda: r.target.forward([anchor]))
    token = r.sampler.at(r.target.length).sample(out.logits, argmax=out.argmax)[0]
    r.policy.observe_plain(time.perf_counter() - began)
    r.stats.record_plain()
    r.lanes.step += 1
    pending.append(out.features)
    return Step(r.emit([token])), token


def on_draft(r: Request, label: str, job):
    """Run a draft job; on a fault, record it (stats and an announced note) and return None."""
    try:
        return r.lanes.draft(label, job, sync=not r.on_device)  # on the device: the verify waits, not the host
    except Exception as e:  # any device error: CUDA, Core ML, NaN... the target finishes the job
        fault(r, e)
        return None


def fault(r: Request, e: Exception) -> None:
    r.stats.fallback = f"{type(e).__name__}: {e}"
    r.stats.notes.append(f"the draft on {r.lanes.draft_lane.device} failed at step {r.lanes.step} "
                         f"({r.stats.fallback}); finishing this generation autoregressively on the target")


def first_block(r: Request, anchor: int, context: torch.Tensor) -> torch.Tensor | None:
    """The block after prefill, drafted at the draft's own size (draft_step's experiments)."""
    r.draft.crop(0)
    return timed_draft(r, partial(next_block, r, [context], anchor, None))


def timed_draft(r: Request, job) -> torch.Tensor | None:
    began = time.perf_counter()
    logits = on_draft(r, "draft", job)
    r.draft_s = time.perf_counter() - began
    return logits


def verify_block(r: Request, anchor: int, logits, launch=None):
    """Verify the drafted block (or a lookup block's guesses, `Guessed`) in one target forward (`launch`
    submits it, for the overlap schedule); crop the rejected tail. Returns (step, verdict, features of the
    positions now in context)."""
    start = r.target.length
    # the block's seconds count its proposals (draws from q when sampling, a grammar's masks, the gate), as a plain
    # step's count its draw: left out, a block looked cheaper to the controller than it was, by a draw per row
    began = time.perf_counter()
    if isinstance(logits, Guessed):
        drafted, q = logits.tokens, None
        if not r.sampler.params.greedy and r.rule == "rejection":  # a point mass on each guess
            q = torch.zeros(len(drafted), r.target.config.vocab_size)
            q[torch.arange(len(drafted)), torch.tensor(drafted)] = 1.0
        r.stats.lookup_blocks += 1
    else:
        drafted, q = draft_tokens(r.sampler.at(start + 1), logits, r.rule, r.lookup)  # row i: position start + 1 + i
        if r.lookup:
            r.stats.lookup_drafts = r.lookup.steered
    if r.sampler.constraint is not None:  # cut at the first token the grammar forbids (constrained.py)
        drafted, q = r.sampler.constraint.proposals(r.sampler, drafted, q, r.rule)
    if r.gate is not None and not isinstance(logits, Guessed):
        keep = gated(logits, drafted, q, r.gate)
        r.stats.gated_drafts += len(drafted) - keep
        drafted, q = drafted[:keep], (q[:keep] if q is not None else None)
    if launch is None:
        out = r.lanes.target("verify", partial(r.target.forward, [anchor] + drafted))
    else:
        out = launch(drafted).result()
    return settled(r, start, len(drafted), verify(r.sampler, out.logits, drafted, q, r.rule), out.features, began)


def settled(r: Request, start: int, drafts: int, verdict, features: torch.Tensor, began: float):
    """A verified block's outcome kept: the target cropped to the anchor and the accepted drafts (now context;
    the bonus is the next anchor), the stats and the controller told (the step's seconds since `began`, beside
    its draft's). Returns (step, verdict, the features of the positions now in context)."""
    keep = verdict.accepted + 1
    r.target.crop(start + keep)
    r.stats.record_step(drafts, verdict.accepted)
    r.policy.observe(drafts + 1, drafts, verdict.accepted, r.draft_s - r.context_s + time.perf_counter() - began,
                     r.context_s)
    r.lanes.step += 1
    return Step(r.emit(verdict.tokens), verdict.accepted, drafts), verdict, features[:keep]


@dataclass
class Proposed:
    """A block's proposals launched on the device, not read (propose_on_device): where the block starts, the ids,
    q (rejection rule) and what the verdict's read carries along."""

    start: int
    drafted: torch.Tensor
    q: torch.Tensor | None
    checks: torch.Tensor


def propose_on_device(r: Request, logits: torch.Tensor) -> Proposed:
    """draft_tokens where the draft's logits are (on_device.proposals): launched, nothing read."""
    start = r.target.length
    sampler = r.sampler.at(start + 1)  # row i: position start + 1 + i
    drafted, q, steered = on_device.proposals(sampler, logits, r.rule, r.lookup)
    # read with the verdict: checked()'s test of the logits, and the rows the lookup changed
    return Proposed(start, drafted, q, on_device.checks(logits, steered))


def verify_on_device(r: Request, anchor: int, p: Proposed):
    """verify_block with nothing for the host to decide between draft and verify: the proposals go into the target's
    inputs on the device (TargetBackend.forward_block), the verdict is computed there, and the host reads it once
    (on_device.py): the same tokens and accepted counts as verify_block. Non-finite draft logits show in that read:
    the step is dropped (the target cropped back) and the loop finishes autoregressively from the same anchor, as
    when checked() finds them first. Returns None then. Timing as verify_block's; on the device path the draft's
    span is its launch, so the step's seconds are the whole step's (the draft's device work is waited for inside
    the verify, or ran while the last step was being consumed)."""
    began = time.perf_counter()

    def verify_job():
        out = r.target.forward_block(anchor, p.drafted)
        return out, on_device.verdict(r.sampler.at(p.start + 1), out.logits, p.drafted, p.q, p.checks, r.rule,
                                      out.argmax)

    out, (verdict, tokens, (_, changed)) = r.lanes.target("verify", verify_job)
    if r.lookup:
        r.lookup.steered += changed
        r.stats.lookup_drafts = r.lookup.steered
    if verdict is None:
        r.target.crop(p.start)
        fault(r, DraftFault("the draft produced non-finite logits (NaN or inf)"))
        return None
    r.stats.device_steps += 1
    return settled(r, p.start, len(tokens), verdict, out.features, began)


def ahead(r: Request, anchor: int, pending: list[torch.Tensor]):
    """The next step's choice, and where it is a draft block, its device work launched now, before the step just
    verified is yielded: the draft's catch-up, its block and the proposals run on the device while the host hands
    the step on (the caller's work, text decoding, a stream's write). Returns the choice (an int) for a plain or
    lookup step, (the logits, their Proposed) for a launched block, or FAULT (the draft failed: recorded)."""
    size = r.block_size()
    if size == PLAIN or getattr(r.policy, "via_lookup", False):
        return size
    logits = timed_draft(r, partial(next_block, r, pending, anchor, None, size))
    if logits is None:
        return FAULT
    return logits, propose_on_device(r, logits)


def first_token(r: Request):
    """The prefill's token, yielded; returns (the anchor, the features the draft has not been given yet)
    with the draft's context cut back to what the prefix cache reuses."""
    anchor, features = prefill(r, features=True)
    yield Step(r.emit([anchor]))
    r.draft.crop(r.reuse)
    return anchor, [features]


def speculative(r: Request) -> Iterator[Step]:
    """Draft a block, verify it; or, when the controller says so, a plain decode step. `pending` holds
    the context features the draft has not been given yet (it catches up on its next block). On the device path
    the next block is launched before a verified step is yielded (`ahead`)."""
    anchor, pending = yield from first_token(r)
    launched = None  # what `ahead` returned for this step
    while not r.budget.done:
        proposed = None
        if launched is FAULT:
            yield from finish_autoregressive(r, anchor)
            return
        if isinstance(launched, tuple):  # (a type test: comparing the logits with a value costs a torch op)
            logits, proposed = launched
        else:
            logits, anchor = yield from plain_or_drafted(r, anchor, pending, None, launched)
            if logits is FAULT:
                return
            if logits is None:
                launched = None
                continue
            if r.on_device and isinstance(logits, torch.Tensor):
                proposed = propose_on_device(r, logits)
        verified = verify_on_device(r, anchor, proposed) if proposed is not None else verify_block(r, anchor, logits)
        if verified is None:  # the draft's logits were not finite (found in the step's one read)
            yield from finish_autoregressive(r, anchor)
            return
        step, verdict, features = verified
        anchor = verdict.tokens[-1]
        # a draft block took the pending features into the draft's context; a lookup block ran no draft
        pending = pending + [features] if isinstance(logits, Guessed) else [features]
        launched = None
        if proposed is not None and not r.budget.done:
            launched = ahead(r, anchor, pending)
            if isinstance(launched, tuple):
                pending = []  # the launched block's catch-up took them
        yield step
    keep_context(r, pending)


def plain_or_drafted(r: Request, anchor: int, pending: list[torch.Tensor], ready: torch.Tensor | None,
                     size: int | None = None):
    """This step as the controller chooses it (or chose it: `size`): a plain decode step (yielded; returns (None,
    the new anchor)) or the next block, pre-drafted (`ready`) or fresh (returns (its logits, the anchor)). A faulty
    draft: the rest of the generation autoregressively (yielded), and returns (FAULT, the anchor)."""
    size = r.block_size() if size is None else size
    if size == PLAIN:
        step, anchor = plain_step(r, anchor, pending)
        yield step
        return None, anchor
    if getattr(r.policy, "via_lookup", False):
        r.draft_s = r.context_s = 0.0
        return Guessed(r.lookup.chain(size - 1)), anchor
    logits = timed_draft(r, partial(next_block, r, pending, anchor, ready, size))
    if logits is None:
        yield from finish_autoregressive(r, anchor)
        return FAULT, anchor
    return logits, anchor


def keep_context(r: Request, pending: list[torch.Tensor]) -> None:
    """At the end of a generation whose caches the prefix cache keeps, the draft takes the context features
    it has not seen yet (after a plain stretch, many), so that a next turn can reuse its context as far as
    the target's cache. After the last token: it delays no text."""
    if r.keep_context and pending:
        on_draft(r, "context", lambda: r.draft.add_context(pending[0] if len(pending) == 1 else torch.cat(pending)))


def next_block(r: Request, context: list[torch.Tensor], anchor: int, ready: torch.Tensor | None,
               size: int | None = None) -> torch.Tensor:
    """Extend the draft's context with the positions emitted since its last block (joined once here, not
    per plain step), then the next block: pre-drafted or fresh. The catch-up is timed apart: after a
    plain stretch it is most of the step, a cost of the switch and not of the block size."""
    began = time.perf_counter()
    r.draft.add_context(context[0] if len(context) == 1 else torch.cat(context))
    r.context_s = time.perf_counter() - began
    block = ready if ready is not None else r.draft.propose(anchor, size=size)
    # on the device, the finite check joins the step's one read (verify_on_device)
    return block if r.on_device and isinstance(block, torch.Tensor) else checked(block)


def overlapped(r: Request, max_hypotheses: int = MAX_HYPOTHESES) -> Iterator[Step]:
    anchor, pending = yield from first_token(r)
    ready, pace = None, Pace()  # ready: the block pre-drafted for this anchor, if a guess was right
    while not r.budget.done:
        logits, anchor = yield from plain_or_drafted(r, anchor, pending, ready)
        if logits is FAULT:
            return
        if logits is None:  # a plain step: a pre-drafted block, if any, is dropped unread
            ready = None
            continue
        jobs = {}

        def launch(drafted, anchor=anchor, start=r.target.length, logits=logits):
            jobs["began"] = time.perf_counter()
            verifying = r.lanes.submit("target", "verify", partial(r.target.forward, [anchor] + drafted))
            guesses = hypotheses(logits, drafted, max_hypotheses)  # computed while the target works
            ahead = r.policy.peek()  # the next block's size as it looks now
            jobs["predraft"] = r.lanes.submit("draft", "predraft", partial(
                predraft, r.draft, guesses, start, verifying, pace, jobs["began"], ahead))
            return verifying

        step, verdict, verified = verify_block(r, anchor, logits, launch)
        pace.verify_s = pace.mix(pace.verify_s, time.perf_counter() - jobs["began"])
        anchor, pending = verdict.tokens[-1], [verified]
        ready = on_predraft(r, jobs["predraft"], (verdict.accepted, anchor))
        yield step
        if ready is FAULT:
            yield from finish_autoregressive(r, anchor)
            return
    keep_context(r, pending)


def on_predraft(r: Request, future, outcome: tuple[int, int]):
    """The pre-drafted block for what verification decided, None on a miss, FAULT on a draft fault."""
    try:
        blocks = future.result()
    except Exception as e:
        fault(r, e)
        return FAULT
    r.stats.predraft_guesses += len(blocks)
    r.stats.predraft_steps += 1
    hit = blocks.get(outcome)
    r.stats.predraft_hits += hit is not None
    return hit


def hypotheses(logits: torch.Tensor, drafted: list[int], limit: int) -> list[tuple[int, int]]:
    """The likeliest verification outcomes (j drafts accepted, bonus token c) under the draft's own
    distribution: P ~ prod_{i<j} q_i(d_i) * q_j(c) with c != d_j, where d are the drafted tokens.
    Full acceptance is left out: the block has no prediction for the token after it."""
    if not drafted:  # a gated block with nothing to verify: a plain step's outcome, no guess needed
        return []
    logp = logits_of(logits)[:len(drafted)].float().log_softmax(-1)  # DFlash2: the unary scores, an approximation
    # where the draft's logits are (a GPU draft's: one small read at the end, not its [n, vocab] rows)
    n, device = logp.shape[0], logp.device  # (a gated block: its verified rows only)
    drafted = uploaded(torch.tensor(drafted[:n]), device)
    rows = torch.arange(n, device=device)
    prefix = torch.cat([logp.new_zeros(1), logp[rows, drafted].cumsum(0)[:-1]])
    others = logp.index_put((rows, drafted), logp.new_tensor(float("-inf")))
    k = min(limit, others.shape[-1] - 1)
    top = others.topk(k, -1)
    best = (prefix[:, None] + top.values).flatten().topk(min(limit, n * k)).indices
    return list(map(tuple, torch.stack([best // k, top.indices.flatten()[best]], 1).tolist()))


class Pace:
    """Running estimates of a verify and of one pre-draft, so that pre-drafting stops in time: a guess
    still running when verification ends would delay the next step on a miss."""

    def __init__(self):
        self.verify_s: float | None = None
        self.guess_s: float | None = None

    @staticmethod
    def mix(old: float | None, new: float) -> float:
        return new if old is None else 0.7 * old + 0.3 * new

    def fits(self, verify_began: float) -> bool:
        if self.verify_s is None or self.guess_s is None:
            return True
        return time.perf_counter() + self.guess_s <= verify_began + self.verify_s


def predraft(draft: DraftBackend, guesses: list[tuple[int, int]], start: int, verifying, pace: Pace,
             verify_began: float, size: int | None = None) -> dict:
    """Draft the next block for each guessed outcome, likeliest first, while verification runs.
    Context is lagged: the draft has features only up to `start`; the block sits at its true position."""
    blocks = {}
    for accepted, bonus in guesses:
        if verifying.done() or not pace.fits(verify_began):
            break
        began = time.perf_counter()
        blocks[(accepted, bonus)] = draft.propose(bonus, position=start + accepted + 1, size=size)
        pace.guess_s = pace.mix(pace.guess_s, time.perf_counter() - began)
    return blocks

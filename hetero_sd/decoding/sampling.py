"""Turning logits into tokens, and the two lossless acceptance rules for a drafted block.

Both rules keep the target's distribution exactly (after temperature, top-k and top-p):
- `match` (point mass): sample a target token at every block position and accept drafts while they
  equal it. Every emitted token is a target sample; the draft only decides how many come per step.
- `rejection` (Leviathan et al. 2023): accept draft token d ~ q with probability min(1, p(d)/q(d));
  at the first rejection emit a sample from norm(max(p - q, 0)). Accepts more when q is close to p.
At temperature 0 both reduce to greedy prefix matching. A DFlash2 draft's tokens and q come from its
candidate selector (selection.py): q is zero off each position's candidates, the rules are unchanged."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hetero_sd.backends.base import SelectorBlock, uploaded

from .penalties import History, min_p_filter, penalize

RULES = ("match", "rejection")


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's maximum, the first where several tie (torch's and numpy's rule alike). A CPU
    float32 row goes through numpy: torch's CPU argmax took 27 us for one 49,152-column row and 55-79 for three
    on a 2-core Zen 5 EPYC, numpy's 3.3 and 7; two a speculative step, one a plain step."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return np.argmax(logits.numpy(), axis=-1).tolist()
    return logits.argmax(-1).tolist()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0  # keep the tokens with p >= min_p * p(top token)
    repetition_penalty: float = 1.0  # the penalties (penalties.py) depend on the tokens so far
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) != (1.0, 0.0, 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Randomness as a function of (seed, position): every draw for the token at absolute position n
    comes from a hash of (seed, n, purpose), never from a stream shared across steps. A seeded
    generation is then the same whatever block sizes the controller picks (a block samples each of its
    positions exactly as plain steps would), and under `match` it equals seeded autoregressive sampling
    token for token. Positions a block drafted but did not emit are drawn again by the next block with
    the same values; that keeps the rules lossless because nothing emitted depended on them (each
    rule stops at the first rejected position). The loop sets `position` (the row-0 position of the
    next block or step); calls that name no offset get a fresh key per call at that position."""

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        self.history = History()  # the prompt (the runtime sets it) and the emitted tokens: penalties
        self.seed = secrets.randbits(64) if seed is None else seed
        self.position = 0
        self.calls = 0  # draws at this position that named no offset (each gets its own key)
        self.constraint = None  # a grammar the output must follow (constrained.Constraint), or None

    def at(self, position: int) -> "Sampler":
        self.position, self.calls = position, 0
        return self

    def key(self, offset: int | None, purpose: str) -> int:
        if offset is None:
            offset, purpose = 0, f"{purpose}#{self.calls}"
            self.calls += 1
        h = hashlib.blake2b(f"{self.seed}/{self.position + offset}/{purpose}".encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little")

    def uniforms(self, n: int, offset: int | None, purpose: str) -> list[float]:
        """n values in [0, 1): row i at position + offset + i (53 random bits each)."""
        if offset is None:
            return [(self.key(None, purpose) >> 11) * 2.0 ** -53 for _ in range(n)]
        return [(self.key(offset + i, purpose) >> 11) * 2.0 ** -53 for i in range(n)]

    def generator(self, device: torch.device, purpose: str = "select") -> torch.Generator:
        """A torch generator keyed by (seed, position, purpose), for samplers that need one (DFlash2)."""
        return torch.Generator(device=device).manual_seed(self.key(0, purpose))

    def penalize(self, logits: torch.Tensor, drafted: Sequence[int] | None = None) -> torch.Tensor:
        """The penalties, given the tokens emitted so far (and drafted[:i] for row i: penalties.py); under a
        grammar, row i masked by its state after drafted[:i] (constrained.py)."""
        p = self.params
        if p.penalized:
            logits = penalize(logits, self.history, drafted, p.repetition_penalty, p.presence_penalty,
                              p.frequency_penalty)
        logits = logits.float()
        return logits if self.constraint is None else self.constraint.mask(logits, drafted)

    def emitted(self, tokens: list[int]) -> None:
        self.history.output += tokens
        if self.constraint is not None:
            self.constraint.advance(tokens)

    def probs(self, logits: torch.Tensor, drafted: Sequence[int] | None = None) -> torch.Tensor:
        """[N, V] float32 logits -> [N, V] probabilities after the penalties, temperature, top-k, top-p
        and min-p. drafted: row i follows drafted[:i] (a verified block), for the penalties."""
        p = self.params
        logits = self.penalize(logits, drafted) / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = (cumulative - sorted_logits.softmax(-1)) >= p.top_p
            drop[..., 0] = False  # a top_p that rounds to 0 in float32 (1e-46) still keeps the likeliest
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        if p.min_p > 0:
            logits = min_p_filter(logits, p.min_p)
        return logits.softmax(-1)

    def draw(self, probs: torch.Tensor, offset: int | None = None, purpose: str = "sample") -> torch.Tensor:
        """One token per row by inverse CDF (float64, so a zero-probability token is never drawn)."""
        u = uploaded(torch.tensor(self.uniforms(probs.shape[0], offset, purpose), dtype=torch.float64), probs.device)
        return inverse_cdf(probs, u)

    def sample(self, logits: torch.Tensor, drafted: Sequence[int] | None = None,
               argmax: torch.Tensor | None = None) -> list[int]:
        """One token per row, row i being the token at position + i. `argmax`: each row's argmax where the step
        computed it on the device (TargetOutput.argmax), which a greedy row without penalties or a grammar reads
        instead of reducing the logits again."""
        if self.params.greedy:
            if argmax is not None and not self.params.penalized and self.constraint is None:
                return argmax.tolist()
            return argmax_rows(self.penalize(logits, drafted))
        return self.draw(self.probs(logits, drafted), 0).tolist()

    def uniform(self, device: torch.device, offset: int | None = None) -> float:
        return self.uniforms(1, offset, "accept")[0]


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, one_scan: bool | None = None) -> torch.Tensor:
    """Row i's token where its cumulative float64 sum first passes u[i] x its total. On a CPU row by row: torch's
    CPU cumsum along the last dimension of a [3, 49152] float64 tensor took ~0.7 ms, of one row ~0.035 ms (2-core
    Zen 5), each row's sums the same either way (bitwise). On an accelerator (`one_scan`) all rows at once: five
    kernels, not five a row, each launched by the host (a block's draws were most of a sampled step's launches)."""
    if one_scan is None:
        one_scan = probs.device.type != "cpu"
    if one_scan:
        cdf = probs.double().cumsum(-1)
        return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0].clamp_max(probs.shape[-1] - 1)
    idx = []
    for i, row in enumerate(probs):
        cdf = row.double().cumsum(-1)
        idx.append(torch.searchsorted(cdf, (u[i] * cdf[-1]).reshape(1), right=True))
    return torch.cat(idx).clamp_max(probs.shape[-1] - 1)


@dataclass
class Verdict:
    accepted: int  # how many drafted tokens were accepted
    tokens: list[int]  # accepted drafts followed by the bonus/correction token


def draft_tokens(sampler: Sampler, draft_logits, rule: str, lookup=None) -> tuple[list[int], torch.Tensor | None]:
    """The block's proposals, and q (the distribution they were drawn from) when the rule needs it.
    draft_logits: [n, vocab], or a DFlash2 SelectorBlock (its selector draws the tokens and gives q).
    lookup: a lookup.ContextLookup whose guesses are mixed into q (DFlash blocks; not a selector's walk)."""
    if sampler.constraint is not None:  # row i masked by the grammar after the proposals before it
        return sampler.constraint.draft(sampler, draft_logits, rule)
    if isinstance(draft_logits, SelectorBlock):
        return draft_logits.choose(sampler, rule)
    if sampler.params.greedy or rule == "match":
        tokens = argmax_rows(draft_logits)
        return (lookup.steer(draft_logits, tokens) if lookup else tokens), None
    q = sampler.probs(draft_logits)
    if lookup:
        return lookup.mix(q, lambda probs, i: sampler.draw(probs, i, "draft")[0])
    return sampler.draw(q, 0, "draft").tolist(), q


def gated(draft_logits, drafted: list[int], q: torch.Tensor | None, threshold: float) -> int:
    """How many of the block's drafts to verify: those before the first position whose draft distribution's
    top probability is below `threshold`. The draft's own confidence predicts acceptance (chat, E1's draft:
    below 0.3 ~20% right, above 0.9 ~94%), and verify rows past the first rejection are wasted target work
    (each row of a verify block costs ~0.1-0.15 decode steps on the 2-core CPUs). Lossless at any threshold,
    also when sampling: a block's rows are drafted in one pass, so position i's distribution does not depend
    on the tokens drawn at it or before it, and cutting there is a shorter block, as if the draft had proposed
    fewer. (Cutting on q of the DRAWN token would not be: the accepted drafts would then be selected by their
    own value, and the rejection rule's residual no longer restores the target's distribution; the chi-square
    test in test_sampling.py fails that way at p ~ 1e-8.)"""
    if isinstance(draft_logits, SelectorBlock) or not drafted:
        return len(drafted)
    # (softmax, not exp(max - logsumexp): torch's logsumexp takes ~1.3 ms on 7 rows x 49k columns where a reduced
    # head's rows hold draft_vocab.FLOOR, softmax ~0.1 ms; 2-core Zen 5)
    n = len(drafted)
    conf = (q[:n] if q is not None else torch.softmax(draft_logits[:n].float(), -1)).amax(-1)
    low = (conf < threshold).nonzero()
    return int(low[0, 0]) if low.numel() else n


def verify(sampler: Sampler, target_logits: torch.Tensor, drafted: list[int], q: torch.Tensor | None,
           rule: str) -> Verdict:
    """target_logits[i] is the target's distribution for the token after block position i."""
    if not sampler.params.greedy and rule == "match":
        return matched(sampler, target_logits, drafted)
    if sampler.params.greedy:
        posterior = sampler.sample(target_logits, drafted)
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == posterior[accepted]:
            accepted += 1
        return Verdict(accepted, drafted[:accepted] + [posterior[accepted]])
    return rejection(sampler, sampler.probs(target_logits, drafted), drafted, q.to(target_logits.device))


def matched(sampler: Sampler, target_logits: torch.Tensor, drafted: list[int]) -> Verdict:
    """Sampling with the match rule: the target draws each position (row i with the uniform of position
    + i, as `sample` draws all rows at once), and a draft is kept while it equals the draw. Rows past the first
    mismatch are never drawn: their cumulative sums over the vocabulary (float64) were most of a step's
    sampling work, and only ~tau of a block's rows are ever needed. Without penalties or a grammar each row's
    probabilities are computed only when it is drawn too (with them, row i depends on drafted[:i]: all rows)."""
    rows = None if not (sampler.params.penalized or sampler.constraint is not None) else sampler.probs(target_logits, drafted)
    for i in range(len(drafted) + 1):
        probs = rows[i:i + 1] if rows is not None else sampler.probs(target_logits[i:i + 1])
        token = int(sampler.draw(probs, i)[0])
        if i == len(drafted) or token != drafted[i]:
            return Verdict(i, drafted[:i] + [token])
    raise AssertionError("unreachable: the last row always ends the block")


def rejection(sampler: Sampler, p: torch.Tensor, drafted: list[int], q: torch.Tensor) -> Verdict:
    idx = torch.arange(len(drafted), device=p.device)
    d = torch.tensor(drafted, dtype=torch.long, device=p.device)  # (empty after a gate that kept no draft)
    ratio = (p[idx, d] / q[idx, d]).tolist()
    for i, r in enumerate(ratio):
        if sampler.uniform(p.device, i) >= r:  # reject: resample from the residual distribution
            residual = (p[i] - q[i]).clamp_min(0)
            total = residual.sum()
            # total == 0 only when p == q, where a rejection has probability zero; guard rounding.
            correction = sampler.draw((residual / total if total > 0 else p[i])[None], i, "residual")[0].item()
            return Verdict(i, drafted[:i] + [correction])
    return Verdict(len(drafted), drafted + [sampler.draw(p[len(drafted)][None], len(drafted))[0].item()])

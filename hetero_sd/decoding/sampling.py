"""Turning logits into tokens, and the two lossless acceptance rules for a drafted block.

Both rules keep the target's distribution exactly (after temperature, top-k and top-p):
- `match` (point mass): sample a target token at every block position and accept drafts while they
  equal it. Every emitted token is a target sample; the draft only decides how many come per step.
- `rejection` (Leviathan et al. 2023): accept draft token d ~ q with probability min(1, p(d)/q(d));
  at the first rejection emit a sample from norm(max(p - q, 0)). Accepts more when q is close to p.
At temperature 0 both reduce to greedy prefix matching. A DFlash2 draft's tokens and q come from its
candidate selector (selection.py): q is zero off each position's candidates, the rules are unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hetero_sd.backends.selection import SelectorBlock

from .penalties import History, min_p_filter, penalize

RULES = ("match", "rejection")


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
    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        self.history = History()  # the prompt (the runtime sets it) and the emitted tokens: penalties
        self.seed = seed
        self.generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self.generators:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed)
            self.generators[device] = g
        return self.generators[device]

    def penalize(self, logits: torch.Tensor, drafted: Sequence[int] | None = None) -> torch.Tensor:
        """The penalties, given the tokens emitted so far (and drafted[:i] for row i: penalties.py)."""
        p = self.params
        if not p.penalized:
            return logits.float()
        return penalize(logits, self.history, drafted, p.repetition_penalty, p.presence_penalty,
                        p.frequency_penalty)

    def emitted(self, tokens: list[int]) -> None:
        self.history.output += tokens

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
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        if p.min_p > 0:
            logits = min_p_filter(logits, p.min_p)
        return logits.softmax(-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self.generator(probs.device)).squeeze(-1)

    def sample(self, logits: torch.Tensor, drafted: Sequence[int] | None = None) -> list[int]:
        """One token per row."""
        if self.params.greedy:
            return self.penalize(logits, drafted).argmax(-1).tolist()
        return self.draw(self.probs(logits, drafted)).tolist()

    def uniform(self, device: torch.device) -> float:
        return torch.rand((), generator=self.generator(device), device=device).item()


@dataclass
class Verdict:
    accepted: int  # how many drafted tokens were accepted
    tokens: list[int]  # accepted drafts followed by the bonus/correction token


def draft_tokens(sampler: Sampler, draft_logits, rule: str) -> tuple[list[int], torch.Tensor | None]:
    """The block's proposals, and q (the distribution they were drawn from) when the rule needs it.
    draft_logits: [n, vocab], or a DFlash2 SelectorBlock (its selector draws the tokens and gives q)."""
    if isinstance(draft_logits, SelectorBlock):
        return draft_logits.choose(sampler, rule)
    if sampler.params.greedy or rule == "match":
        return draft_logits.argmax(-1).tolist(), None
    q = sampler.probs(draft_logits)
    return sampler.draw(q).tolist(), q


def verify(sampler: Sampler, target_logits: torch.Tensor, drafted: list[int], q: torch.Tensor | None,
           rule: str) -> Verdict:
    """target_logits[i] is the target's distribution for the token after block position i."""
    if sampler.params.greedy or rule == "match":
        posterior = sampler.sample(target_logits, drafted)
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == posterior[accepted]:
            accepted += 1
        return Verdict(accepted, drafted[:accepted] + [posterior[accepted]])
    return rejection(sampler, sampler.probs(target_logits, drafted), drafted, q.to(target_logits.device))


def rejection(sampler: Sampler, p: torch.Tensor, drafted: list[int], q: torch.Tensor) -> Verdict:
    idx = torch.arange(len(drafted), device=p.device)
    d = torch.tensor(drafted, device=p.device)
    ratio = (p[idx, d] / q[idx, d]).tolist()
    for i, r in enumerate(ratio):
        if sampler.uniform(p.device) >= r:  # reject: resample from the residual distribution
            residual = (p[i] - q[i]).clamp_min(0)
            total = residual.sum()
            # total == 0 only when p == q, where a rejection has probability zero; guard rounding.
            correction = sampler.draw((residual / total if total > 0 else p[i])[None])[0].item()
            return Verdict(i, drafted[:i] + [correction])
    return Verdict(len(drafted), drafted + [sampler.draw(p[len(drafted)][None])[0].item()])

"""A DFlash2 block before its tokens are chosen, and how the acceptance rules see it.

A DFlash2 draft does not draft each position independently: its candidate selector walks the block in
order, scoring the top-k candidates of each position given the token chosen at the position before
(the anchor for the first). At temperature > 0 the walk samples, and the proposal q of position i is
a distribution over that position's candidates given the tokens drafted before it. Written into the
vocabulary with zeros elsewhere, it is an ordinary proposal distribution for `sampling.rejection`:
accepting d_i with probability min(1, p(d_i) / q(d_i)) and resampling from max(p - q, 0) on a
rejection keeps the target's distribution exactly, because each q_i is conditioned only on drafts
that were accepted (they equal the emitted tokens). Off the candidates q is 0, so the residual there
is p itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# walk(temperature, generator) -> (tokens, candidates [n, k], q over the candidates [n, k] or None at T=0)
Walk = Callable[[float, torch.Generator | None], tuple[list[int], torch.Tensor, torch.Tensor | None]]


@dataclass
class SelectorBlock:
    logits: torch.Tensor  # [n, vocab] float32: the draft's logits, the selector's unary scores
    walk: Walk

    def choose(self, sampler, rule: str) -> tuple[list[int], torch.Tensor | None]:
        """The drafted tokens, and q (dense over the vocabulary) when the rule needs it. Greedy decoding
        and the `match` rule take the selector's greedy walk (its most likely path, as argmax is for DFlash)."""
        if sampler.params.greedy or rule == "match":
            return self.walk(0.0, None)[0], None
        tokens, candidates, q = self.walk(sampler.params.temperature, sampler.generator(self.logits.device))
        return tokens, torch.zeros_like(self.logits).scatter(-1, candidates, q.float())


def logits_of(block) -> torch.Tensor:
    """The per-position logits of a drafted block, whichever format drafted it."""
    return block.logits if isinstance(block, SelectorBlock) else block

"""Repetition, presence and frequency penalties (OpenAI's and vLLM's meanings), applied to the target's
logits before temperature and the filters, so that the acceptance rules see the penalised distribution
and stay lossless.

- repetition_penalty r (vLLM/HF): a token seen in the prompt or the output has its logit divided by r
  when positive, multiplied by r when negative (r > 1 discourages repeats; 1 is off).
- presence_penalty a and frequency_penalty f (OpenAI): logit -= a * [count > 0] + f * count, counting
  the generated tokens only.

A penalty depends on the tokens before the position it scores. In a verified block, row i scores the
token after the anchor and drafts d_1..d_i, so row i is penalised with the emitted tokens plus
d_1..d_i: the distribution the target has at that position if those drafts are accepted, which is
the only case in which row i decides a token."""

from __future__ import annotations

from typing import Sequence

import torch


class History:
    """The prompt and the tokens emitted so far, for one generation's sampler."""

    def __init__(self, prompt_ids: Sequence[int] = ()):
        self.prompt = list(prompt_ids)
        self.output: list[int] = []

    def counts(self, rows: int, vocab: int, drafted: Sequence[int] | None, device) -> torch.Tensor:
        """[rows, vocab] counts of generated tokens before each row: the output so far, plus drafted[:i]
        for row i (None: every row after the output only)."""
        base = torch.bincount(torch.tensor(self.output, dtype=torch.long), minlength=vocab)[:vocab]
        counts = base.to(device=device, dtype=torch.float32).expand(rows, vocab).clone()
        if drafted:
            d = torch.tensor(list(drafted)[:rows - 1], dtype=torch.long, device=device)
            steps = torch.zeros(rows, vocab, device=device)
            steps[torch.arange(1, len(d) + 1, device=device), d] = 1.0  # row i+1 gains draft i
            counts += steps.cumsum(0)
        return counts


def penalize(logits: torch.Tensor, history: History, drafted: Sequence[int] | None, repetition: float,
             presence: float, frequency: float) -> torch.Tensor:
    """[N, V] float logits -> penalised logits (a new tensor)."""
    rows, vocab = logits.shape
    counts = history.counts(rows, vocab, drafted, logits.device)
    logits = logits.float()
    if repetition != 1.0:
        seen = counts > 0
        if history.prompt:
            prompt = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            prompt[torch.tensor(history.prompt, dtype=torch.long, device=logits.device)] = True
            seen |= prompt
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    if presence:
        logits = logits - presence * (counts > 0).float()
    if frequency:
        logits = logits - frequency * counts
    return logits


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens whose probability is at least min_p times the top token's (after temperature)."""
    probs = logits.softmax(-1)
    keep = probs >= min_p * probs.max(-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))

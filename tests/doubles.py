"""Test doubles for the draft seam."""

from __future__ import annotations

import torch

from hetero_sd.backends.base import DraftBackend, WrappedDraft
from hetero_sd.runtime import Runtime


class OracleDraft(DraftBackend):
    """Proposes the true continuation (from a baseline run), wrong after `correct` tokens. Where it is
    wrong, the true token is its second choice, so the overlap schedule's guesses can find it."""

    def __init__(self, sequence: list[int], block_size: int, vocab: int, correct: int | None = None,
                 right=None):
        self.sequence, self.block_size, self.vocab = sequence, block_size, vocab
        self.correct = block_size - 1 if correct is None else correct
        self.right = right  # right(position) -> bool: right only on stretches of the text (and `correct`)
        self.mask_token_id, self.device, self.length = 0, "cpu", 0

    @property
    def context_length(self) -> int:
        return self.length

    def add_context(self, features: torch.Tensor) -> None:
        self.length += features.shape[0]

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        size = size or self.block_size
        if position is None:
            position = self.length
            assert self.sequence[position] == anchor, "anchor must sit at the draft's context length"
        truth = self.sequence[position + 1:position + size]
        truth += [5] * (size - 1 - len(truth))
        logits = torch.zeros(size - 1, self.vocab)
        for i, t in enumerate(truth):
            if i < self.correct and (self.right is None or self.right(position + 1 + i)):
                logits[i, t] = 20.0
            else:
                logits[i, (t + 1) % self.vocab], logits[i, t] = 20.0, 15.0
        return logits


class FaultyDraft(WrappedDraft):
    """Wraps a draft and fails on its `at`-th block: raises, or returns NaN logits."""

    def __init__(self, inner: DraftBackend, at: int, kind: str = "raise"):
        super().__init__(inner)
        self.at, self.kind, self.calls = at, kind, 0

    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        self.calls += 1
        logits = self.inner.propose(anchor, position, size)
        if self.calls >= self.at:
            if self.kind == "raise":
                raise RuntimeError("injected device fault")
            return logits * float("nan")
        return logits


def with_draft(rt: Runtime, draft: DraftBackend, schedule: str = "sequential", block: str | int = "fixed",
               memory=None) -> Runtime:
    """The same target with another draft (a new runtime: its request slots hold the draft)."""
    return Runtime(rt.target, draft, rt.tokenizer, rt.stop_ids, rt.info, schedule, block, memory)

"""A draft on a reduced-precision device with the float32 reference drafting alongside it, so that
the runtime can report the device's precision drift (drift.py). Decoding uses only the
device's proposals."""

from __future__ import annotations

import torch

from .drift import Drift

from .base import DraftBackend


class ShadowedDraft(DraftBackend):
    """The device draft, with the float32 reference drafting alongside to measure drift."""

    def __init__(self, device: DraftBackend, reference: DraftBackend, every: int = 1):
        self.inner, self.reference, self.every = device, reference, every
        self.block_size, self.mask_token_id, self.device = device.block_size, device.mask_token_id, device.device
        self.meter, self.calls = Drift(device.device), 0

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    def add_context(self, features: torch.Tensor) -> None:
        self.inner.add_context(features)
        self.reference.add_context(features)

    def crop(self, length: int) -> None:
        self.inner.crop(length)
        self.reference.crop(length)

    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        logits = self.inner.propose(anchor, position, size)
        self.calls += 1
        if self.calls % self.every == 0:
            ref = self.reference.propose(anchor, position, size)
            self.meter.add(ref, logits, self.reference.last_hidden, self.inner.last_hidden)
        return logits

    def fork(self) -> "ShadowedDraft":
        return ShadowedDraft(self.inner.fork(), self.reference.fork(), self.every)

    def synchronize(self) -> None:
        self.inner.synchronize()
        self.reference.synchronize()

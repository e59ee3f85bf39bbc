"""The seam between decoding math and devices.

A target backend runs the frozen target over new tokens, appending to a KV cache it can crop, and
captures the hidden states the draft conditions on. A draft backend keeps the context features it has
been given and fills one block [anchor, mask, ...] per call. Everything returned is a torch tensor
(on whatever torch device the backend likes); the decoding loop never looks inside a backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from hetero_sd.models.config import ArchConfig


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [T, vocab] float32: every new position, or only the last one
    features: torch.Tensor | None  # [T, len(layer_ids) * hidden]: context features for the draft


def feature_parts(layer_ids: list[int], captured: list, num_layers: int, final_norm) -> list:
    """Captured hidden states (in layer order) arranged as in `layer_ids`, the last layer's after the
    final norm as in HF's hidden_states: the context features a DFlash draft was trained on."""
    by_layer = dict(zip(sorted(set(layer_ids)), captured))
    return [final_norm(by_layer[i]) if i == num_layers - 1 else by_layer[i] for i in layer_ids]


class TargetBackend(ABC):
    config: ArchConfig
    device: str
    layer_ids: list[int]  # target layers whose outputs are captured as context features
    max_context: int

    @property
    @abstractmethod
    def length(self) -> int:
        """Positions held in the KV cache."""

    @abstractmethod
    def forward(self, token_ids: Sequence[int], *, last_only: bool = False,
                features: bool = True) -> TargetOutput:
        """Run the tokens at positions length..length+T-1 and append them to the cache."""

    @abstractmethod
    def crop(self, length: int) -> None:
        """Forget every position from `length` on (rejected drafts)."""

    def synchronize(self) -> None:
        """Wait for queued device work (for honest timings on asynchronous devices)."""

    def fork(self) -> "TargetBackend":
        """Another instance over the same weights with its own empty cache (two requests at once)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve two requests at once")


class DraftBackend(ABC):
    block_size: int
    mask_token_id: int
    device: str

    @property
    @abstractmethod
    def context_length(self) -> int:
        """Positions of context features held; the next anchor sits at this position."""

    @abstractmethod
    def add_context(self, features: torch.Tensor) -> None:
        """Append context features [T, L*H] for the next T positions."""

    @abstractmethod
    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        """Fill [anchor, mask * (B-1)] in one pass: float32 logits [B-1, vocab] for block positions 1...
        (a DFlash2 draft returns a hetero_sd.selection.SelectorBlock: those logits and its selector's walk.)
        The anchor sits at `position` (default: right after the context). A later position drafts on a
        lagged context, for pre-drafting while the positions in between are still being verified.
        `size` (default block_size) may be smaller: fewer mask positions, for the block-size controller."""

    @abstractmethod
    def crop(self, length: int) -> None:
        """Forget context from position `length` on."""

    def synchronize(self) -> None:
        pass

    def fork(self, target: TargetBackend) -> "DraftBackend":
        """Another instance over the same weights with its own empty context, paired with `target`."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve two requests at once")

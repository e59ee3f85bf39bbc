"""`ane-sim`: the draft as the ANE would run it, emulated on the CPU.

It runs ane_compiler's fp16-safe graph with every op's result rounded to fp16 (storage and arithmetic;
products inside one matmul accumulate in float32 before the rounding). It is an emulation of the
ANE's number format, not of its speed: its timings say nothing about the Neural Engine."""

from __future__ import annotations

import torch

from ane_compiler.graph import SafeDraftGraph, to_fp16

from ..base import DraftBackend

WINDOW = 1024  # context positions given to the graph (the compiled package has a fixed window)


class AneSimDraft(DraftBackend):
    device = "ane-sim"
    emulated = True

    def __init__(self, reference, window: int = WINDOW):
        """reference: the loaded float32 TorchDraft whose weights and RoPE tables this draft uses."""
        self.graph = SafeDraftGraph(reference, rounding=to_fp16)
        self.rope, self.window = reference.rope, window
        self.block_size, self.mask_token_id = reference.block_size, reference.mask_token_id
        self.eps = reference.arch.rms_norm_eps
        self.features = torch.zeros(0, reference.fc.shape[0])
        self.last_hidden: torch.Tensor | None = None

    @property
    def context_length(self) -> int:
        return self.features.shape[0]

    def add_context(self, features: torch.Tensor) -> None:
        self.features = torch.cat([self.features, features.detach().float().cpu()])

    def crop(self, length: int) -> None:
        self.features = self.features[:length]

    def fork(self, target) -> "AneSimDraft":
        twin = object.__new__(AneSimDraft)
        twin.__dict__.update(self.__dict__, features=self.features[:0], last_hidden=None)
        return twin

    @torch.inference_mode()
    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        start = self.context_length if position is None else position
        size = min(size or self.block_size, self.block_size)
        first = max(0, self.context_length - self.window)
        feats = self.features[first:]
        scale = feats.abs().amax(-1, keepdim=True).clamp_min(1e-12)  # float32, on the host
        ids = torch.full((size,), self.mask_token_id)
        ids[0] = anchor
        ctx_cos, ctx_sin = self.rope.at(first, feats.shape[0])
        blk_cos, blk_sin = self.rope.at(start, size)
        r = self.graph.round  # inputs enter the graph in its number format
        logits, hidden = self.graph(ids, r(feats / scale), self.eps / scale ** 2, r(ctx_cos.float()),
                                    r(ctx_sin.float()), r(blk_cos.float()), r(blk_sin.float()),
                                    torch.zeros(feats.shape[0]))
        self.last_hidden = hidden
        return logits

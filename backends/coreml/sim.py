"""`ane-sim`: the draft as the ANE would run it, emulated on the CPU.

It runs ane_compiler's fp16-safe graph with every op's result rounded to fp16 (storage and arithmetic;
products inside one matmul accumulate in float32 before the rounding). It is an emulation of the
ANE's number format, not of its speed: its timings say nothing about the Neural Engine."""

from __future__ import annotations

import torch

from hetero_sd.ane_compiler.graph import SafeDraftGraph, sequence_first, to_fp16

from .host import WINDOW, WindowedDraft


class AneSimDraft(WindowedDraft):
    device = "ane-sim"

    def __init__(self, reference, window: int = WINDOW):
        super().__init__(reference, window)
        self.graph = SafeDraftGraph(reference, rounding=to_fp16)

    @torch.inference_mode()
    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        size = min(size or self.block_size, self.block_size)
        x = self.inputs(anchor, position, self.format.block_rows(size, self.block_size))
        r = self.graph.round  # inputs enter the graph in its number format
        logits, hidden = self.graph(*(r(v) if k != "feature_eps" else v for k, v in x.items()))
        self.last_hidden = sequence_first(hidden)[:size - 1]
        return self.full_logits(sequence_first(logits)[:size - 1])

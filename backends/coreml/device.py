"""Core ML devices (macOS): the compiled draft package run by Core ML on the Neural Engine (`ane`,
compute units CPU_AND_NE), the GPU (`coreml-gpu`) or the CPU (`coreml-cpu`).

The package has fixed shapes: a window of WINDOW context positions (padded and masked when the context
is shorter; the last WINDOW positions when longer) and the draft's block size. A smaller block asked
for by the block-size controller is answered with the first rows of a full block: what a draft trained at
its block size only needs (DraftFormat.block_rows), and one trained on short blocks too saw full ones."""

from __future__ import annotations

import numpy as np
import torch

from hetero_sd.ane_compiler.graph import sequence_first

from .host import WINDOW, WindowedDraft

COMPUTE_UNITS = {"ane": "CPU_AND_NE", "coreml-gpu": "CPU_AND_GPU", "coreml-cpu": "CPU_ONLY"}


class CoreMLDraft(WindowedDraft):
    pad = True

    def __init__(self, reference, model, device: str, window: int = WINDOW):
        """model: a coremltools MLModel of the package (or anything with the same `predict`)."""
        super().__init__(reference, window)
        self.model, self.device = model, device

    @classmethod
    def open(cls, reference, package, device: str, window: int = WINDOW) -> "CoreMLDraft":
        import coremltools as ct

        units = getattr(ct.ComputeUnit, COMPUTE_UNITS[device])
        return cls(reference, ct.models.MLModel(str(package), compute_units=units), device, window)

    def propose(self, anchor: int, position: int | None = None, size: int | None = None) -> torch.Tensor:
        size = min(size or self.block_size, self.block_size)
        x = self.inputs(anchor, position, self.block_size)
        out = self.model.predict({k: v.numpy().astype(np.float32) for k, v in x.items()})
        as_rows = lambda name: sequence_first(torch.from_numpy(np.asarray(out[name], dtype=np.float32)))[:size - 1]
        self.last_hidden = as_rows("hidden")
        return self.full_logits(as_rows("logits"))
